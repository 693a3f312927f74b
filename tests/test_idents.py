"""packer.util.idents: the grammar of identifiers from inputs and the resolve-inside-root rule."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from packer.errors import SourceError, WeightsError
from packer.reading import read_ref_file
from packer.util.idents import (
    check_rel_name,
    confined,
    digest_parts,
    is_commit,
    is_ref_name,
    link_roots,
)
from tests.hf_cache import populate_cache

SHA256 = hashlib.sha256(b"").hexdigest()


@pytest.mark.parametrize(("value", "parts"), [
    (f"sha256:{SHA256}", ("sha256", SHA256)),
    (f"sha512:{hashlib.sha512(b'').hexdigest()}", ("sha512", hashlib.sha512(b"").hexdigest())),
    ("sha256:../../../../canary", None), (f"sha256:{SHA256[:-1]}", None), (f"sha256:{SHA256.upper()}", None),
    (f"sha256:{SHA256}/", None), (f"md5:{SHA256[:32]}", None), (SHA256, None), (12, None), (None, None),
    (f"sha512:{SHA256}", None), ("sha256:/etc/passwd", None),
])
def test_digest_grammar(value: object, parts: tuple[str, str] | None) -> None:
    assert digest_parts(value) == parts


@pytest.mark.parametrize(("value", "ok"), [
    ("main", True), ("v1.0", True), ("refs/pr/1", True), ("release/2025-01", True),
    ("", False), ("../x", False), ("a/../b", False), ("/abs", False), ("a//b", False), (".hidden", False),
    ("a/.b", False), ("x.lock", False), ("x.", False), ("@", False), ("a@{1}", False), ("a b", False),
    ("a:b", False), ("a\\b", False), ("a\nb", False), ("x" * 256, False),
])
def test_ref_name_grammar(value: str, ok: bool) -> None:
    assert is_ref_name(value) is ok


def test_commit_grammar() -> None:
    assert is_commit("0" * 40) and not is_commit("0" * 39) and not is_commit("A" * 40)
    assert not is_commit("0" * 40 + "\n")


def test_ref_file(tmp_path: Path) -> None:
    ref = tmp_path / "main"
    ref.write_bytes(b"\t" + b"a" * 40 + b"\r\n")
    assert read_ref_file(ref, where="src", error=SourceError) == "a" * 40
    for bad in (b"../../models--x--y/snapshots/" + b"a" * 40, b"/" + b"a" * 40, b"a" * 40 + b" " + b"b" * 40,
                b"a" * 5000, b"\xff" * 40):
        ref.write_bytes(bad)
        with pytest.raises(SourceError, match=rf"src: {ref} does not hold a commit hash"):
            read_ref_file(ref, where="src", error=SourceError)


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../b", "", "a//b", "./a", "a\\b", "a\x1b[2Jb", 3])
def test_rel_name_refused(name: object) -> None:
    with pytest.raises(WeightsError, match="is not a relative file name"):
        check_rel_name(name, where="index", error=WeightsError)


def test_rel_name_accepted() -> None:
    assert str(check_rel_name("sub/model-00001-of-00002.safetensors", where="i", error=WeightsError)) == \
        "sub/model-00001-of-00002.safetensors"


def test_link_roots_of_a_hub_snapshot_and_a_directory(tmp_path: Path) -> None:
    snap = populate_cache(tmp_path, "acme/tiny", {"config.json": b"{}"})
    repo = tmp_path.resolve() / "models--acme--tiny"
    assert link_roots(snap) == (repo / "snapshots" / snap.name, repo / "blobs")
    assert link_roots(tmp_path) == (tmp_path.resolve(),)
    # a component folder of the snapshot: the folder, and still its repository's blobs
    snap = populate_cache(tmp_path, "acme/sd", {"unet/a/w.bin": b"w"})
    repo = tmp_path.resolve() / "models--acme--sd"
    assert link_roots(snap / "unet" / "a") == (repo / "snapshots" / snap.name / "unet" / "a", repo / "blobs")


def test_confined(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    (tmp_path / "outside").write_bytes(b"x")
    os.symlink("../outside", tmp_path / "root" / "leak")
    (tmp_path / "root" / "ok").write_bytes(b"y")
    os.symlink("ok", tmp_path / "root" / "alias")
    assert confined(tmp_path / "root" / "alias", [tmp_path / "root"], error=WeightsError) == \
        (tmp_path / "root" / "ok").resolve()
    with pytest.raises(WeightsError, match=r"leak: symlink leads outside .*root \(to .*outside\); copy the file"):
        confined(tmp_path / "root" / "leak", [tmp_path / "root"], error=WeightsError)
    # a sibling whose name starts with the root's is not inside it
    (tmp_path / "root2").mkdir()
    with pytest.raises(WeightsError, match="leads outside"):
        confined(tmp_path / "root2", [tmp_path / "root"], error=WeightsError)
