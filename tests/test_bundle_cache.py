"""Where the extracted bundle and ``model_dir()`` live by default (packer/runtime/bundle_cache.py).

``$XDG_CACHE_HOME/packer/bundles-<uid>`` (``~/.cache``): on disk, not in RAM as ``/dev/shm`` was,
so a weight file held only in its layer blob is materialized on disk (beside a build under the
home directory: on its btrfs or XFS the kernel shares the extents). A folder found there is
trusted only as a private directory of this user in a parent no one else can change; what it
holds is checked as before (tests/test_one_copy.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from packer.runtime import bundle_cache
from packer.runtime.bundle_cache import private_root

UID = os.getuid()


def test_the_default_is_under_the_users_cache_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    base = private_root()
    assert base == tmp_path / "xdg" / "packer" / f"bundles-{UID}"
    assert base.stat().st_mode & 0o777 == 0o700 and (base.parent.stat().st_mode & 0o777) == 0o700
    assert private_root() == base  # found again, checked again
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert private_root() == tmp_path / "home" / ".cache" / "packer" / f"bundles-{UID}"


def test_an_unusable_cache_directory_falls_through_to_dev_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("")  # a read-only home's cache cannot be made: the next place
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file" / "cache"))
    calls: list[Path] = []
    monkeypatch.setattr(bundle_cache, "_check_private", lambda base, uid: calls.append(base))
    base = private_root()
    assert base.name == f"packer-bundles-{UID}" and base.parent != tmp_path / "file"
    assert calls == [base]


@pytest.mark.parametrize("plant", ["group-writable", "a link", "a file"])
def test_a_planted_folder_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plant: str) -> None:
    """A folder another user could have made or can write is no cache of ours: refused, never used."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    base = tmp_path / "xdg" / "packer" / f"bundles-{UID}"
    base.parent.mkdir(parents=True, mode=0o700)
    if plant == "group-writable":
        base.mkdir()
        base.chmod(0o777)
    elif plant == "a link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        base.symlink_to(tmp_path / "elsewhere")
    else:
        base.write_text("")
    with pytest.raises(PermissionError, match=f"{base}: not a private directory of uid {UID}; pass root="):
        private_root()


def test_a_parent_others_can_change_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Our own private folder in a parent anyone may write (and not sticky) can be swapped under us."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    parent = tmp_path / "xdg" / "packer"
    parent.mkdir(parents=True)
    parent.chmod(0o777)
    with pytest.raises(PermissionError, match=f"{parent}: can be changed by another user; pass root="):
        private_root()
    parent.chmod(0o1777)  # sticky, as /tmp and /dev/shm: others cannot rename what is ours
    assert private_root() == parent / f"bundles-{UID}"


def test_model_dir_materializes_on_disk_beside_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A default build's weight file (held in its layer blob) is materialized under the cache directory on
    the build's own file system here, never on tmpfs; PACKER_BUNDLE_CACHE still chooses the place."""
    import subprocess
    import sys

    from packer.building import build
    from packer.recipe import demo_recipe

    out = tmp_path / "out"
    build(demo_recipe(), out, sandbox=False)
    env = {k: v for k, v in os.environ.items() if k != "PACKER_BUNDLE_CACHE"}
    env |= {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "PACKER_STARTUP_LOG": "off"}
    r = subprocess.run([sys.executable, str(out / "packer_loader.py"), "--model-dir"], capture_output=True,
                       text=True, env=env, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    d = Path(r.stdout.strip())
    assert d.parent == tmp_path / "xdg" / "packer" / f"bundles-{UID}"
    weights = (d / "model.safetensors").resolve()
    assert weights.parent == d.with_name(d.name + ".weights")
    assert weights.stat().st_dev == out.stat().st_dev  # the build's file system: extents shared where it can
    chosen = tmp_path / "chosen"
    r = subprocess.run([sys.executable, str(out / "packer_loader.py"), "--model-dir"], capture_output=True,
                       text=True, env={**env, "PACKER_BUNDLE_CACHE": str(chosen)}, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).parent == chosen
