"""buildah (vfs storage, chroot isolation, no daemon) builds the generated OUT/Dockerfile."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from packer.oci import build_image
from packer.oci.plan import image_rel
from packer.recipe import ImageConfig
from packer.util.fsutil import FileEntry
from tests import dockerfile_reader as reader
from tests.oci_validate import all_files, make_base, make_out, require_tool, run, validate_layout

# read back by buildah's own Dockerfile parser and lexer, not only by tests/dockerfile_reader.py
HOSTILE_ENV = "$HOME ${X:-y} 'q' \"d\" \\ #é日本😀"


def _build_out(out: Path, compression: str) -> list[FileEntry]:
    files, manifest = make_out(out)
    build_image(out, cfg=ImageConfig(compression=compression, env=(("V", HOSTILE_ENV),)), name="demo", version="1.0",
                source={"kind": "demo", "uri": "demo", "revision": None},
                artifact_files=files, artifact_manifest=manifest)
    return files


def _buildah(tmp_path: Path, out: Path) -> Path:
    """``buildah build`` OUT/Dockerfile onto a :func:`make_base` layout; the built image's layout."""
    buildah = require_tool("buildah")
    base = tmp_path / "base"
    make_base(base, tag="v1")
    store = [buildah, "--root", str(tmp_path / "storage"), "--runroot", str(tmp_path / "run"),
             "--storage-driver", "vfs"]
    env = {"BUILDAH_ISOLATION": "chroot", "TMPDIR": str(tmp_path)}
    try:
        run([*store, "build", "--isolation", "chroot", "--build-arg", f"BASE_IMAGE=oci:{base}:v1",
             "-f", str(out / "Dockerfile"), "-t", "localhost/model:test", str(out)], env=env)
        run([*store, "push", "--quiet", "localhost/model:test", f"oci:{tmp_path / 'built'}:t"],
            env=env)
    finally:
        run([*store, "rmi", "--all", "--force"], env=env)
    return tmp_path / "built"


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
def test_buildah_builds_generated_dockerfile(tmp_path: Path, compression: str) -> None:
    umoci = require_tool("umoci")
    out = tmp_path / "out"
    files = _build_out(out, compression)
    _buildah(tmp_path, out)
    layout = validate_layout(tmp_path / "built", "t", packer=False)
    got = all_files(layout)
    assert got["etc/base-release"] == b"base linux/amd64\n"
    for f in files:
        assert got[f"models/{image_rel(f.path)}"] == (out / f.path).read_bytes(), f.path
    run_cfg = layout.config["config"]
    assert f"V={HOSTILE_ENV}" in run_cfg["Env"]
    assert "PYTHONPATH=/models" in run_cfg["Env"] and not any("PACKER_MODEL_DIR" in e for e in run_cfg["Env"])
    assert run_cfg["Cmd"] == ["python3", "/models/packer_loader.py", "--selftest"]
    assert run_cfg["WorkingDir"] == "/models"
    run([umoci, "unpack", "--image", f"{tmp_path / 'built'}:t", str(tmp_path / "bundle")])
    loader = (tmp_path / "bundle/rootfs/models/packer_loader.py").stat()
    assert stat.S_IMODE(loader.st_mode) == 0o755 and loader.st_uid == 0  # runnable as a command


def test_buildah_reads_hostile_values_as_the_test_reader_does(tmp_path: Path) -> None:
    h = "$HOME ${X:-y} 'q' \"d\" \\ #é日本😀 a=b"
    cfg = ImageConfig(compression="none", prefix=f"/m/{h}", workdir=f"/w/{h}", user="1000:0",
                      env=(("V", h), ("T", "a\tb")), entrypoint=("/bin/sh", "-c", f"echo '{h}'\nexit 0"),
                      cmd=(h, ""))
    out = tmp_path / "out"
    files, manifest = make_out(out)
    build_image(out, cfg=cfg, name=f"n{h}", version=h, source={"kind": "local", "uri": h, "revision": "r"},
                artifact_files=files, artifact_manifest=manifest)
    got = validate_layout(_buildah(tmp_path, out), "t", packer=False).config["config"]
    base = {"Env": ["PATH=/usr/bin", "BASE=1"], "Cmd": ["/bin/true"], "User": "1000"}
    want = reader.run_config((out / "Dockerfile").read_text(encoding="utf-8"), base)
    assert dict(e.partition("=")[::2] for e in got["Env"]) == want["Env"]
    assert want["Env"]["V"] == h and want["Env"]["PYTHONPATH"] == f"/m/{h}"
    assert {k: v for k, v in got["Labels"].items() if k.startswith("org.opencontainers")} == want["Labels"]
    for key in ("WorkingDir", "User", "Entrypoint", "Cmd"):
        assert got.get(key) == want.get(key), key
