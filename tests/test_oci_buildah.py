"""buildah (vfs storage, chroot isolation, no daemon) builds the generated OUT/Dockerfile."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from packer.fsutil import FileEntry
from packer.oci import build_image
from packer.oci.plan import image_rel
from packer.recipe import ImageConfig
from tests.oci_validate import all_files, make_base, make_out, require_tool, run, validate_layout

# read back by buildah's own Dockerfile parser and lexer, not only by tests/dockerfile_reader.py
HOSTILE_ENV = "$HOME ${X:-y} 'q' \"d\" \\ #é日本😀"


def _build_out(out: Path, compression: str) -> list[FileEntry]:
    files, manifest = make_out(out)
    build_image(out, cfg=ImageConfig(compression=compression, env=(("V", HOSTILE_ENV),)), name="demo", version="1.0",
                source={"kind": "demo", "uri": "demo", "revision": None},
                artifact_files=files, artifact_manifest=manifest)
    return files


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
def test_buildah_builds_generated_dockerfile(tmp_path: Path, compression: str) -> None:
    buildah = require_tool("buildah")
    umoci = require_tool("umoci")
    out, base = tmp_path / "out", tmp_path / "base"
    files = _build_out(out, compression)
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
