"""What the image runs and says about itself: run config, platform, base.name, created."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from packer.build_stages import StageOutput
from packer.errors import ImageError, VerifyError
from packer.oci import build_image, verify_image
from packer.oci.runconfig import base_name, created_epoch, run_config
from packer.recipe import ImageConfig
from packer.util.fsutil import canonical_json
from tests.oci_validate import make_base, make_out, validate_layout

SOURCE = {"kind": "local", "uri": "/srv/models/demo", "revision": "abc123"}
SELFTEST = ["python3", "/models/packer_loader.py", "--selftest"]


def build(out: Path, cfg: ImageConfig, source: dict[str, Any] = SOURCE) -> StageOutput:
    files, manifest = make_out(out)
    return build_image(out, cfg=cfg, name="demo", version="1.0", source=source,
                       artifact_files=files, artifact_manifest=manifest)


def test_run_config_defaults_and_recipe_overrides() -> None:
    base = {"Env": ["PATH=/usr/bin", "PYTHONPATH=/opt/lib", "PACKER_MODEL_DIR=/old"],
            "Entrypoint": ["/entry.sh"], "Cmd": ["python3"], "User": "1000"}
    run = run_config(ImageConfig(prefix="/models"), base, prefix="/models", runnable=True)
    assert run == {"Env": ["PATH=/usr/bin", "PYTHONPATH=/models:/opt/lib"], "Entrypoint": ["/entry.sh"],
                   "Cmd": SELFTEST, "User": "1000", "WorkingDir": "/models"}
    cfg = ImageConfig(entrypoint=("python3", "-m", "server"), user="1001:0", workdir="/srv",
                      env=(("HF_HUB_OFFLINE", "1"), ("PYTHONPATH", "/x")))
    run = run_config(cfg, base, prefix="/models", runnable=True)
    assert "Cmd" not in run  # a new entrypoint drops the command, as in a Dockerfile
    assert run["Entrypoint"] == ["python3", "-m", "server"] and run["User"] == "1001:0"
    assert run["Env"] == ["PATH=/usr/bin", "HF_HUB_OFFLINE=1", "PYTHONPATH=/x"] and run["WorkingDir"] == "/srv"
    assert run_config(ImageConfig(cmd=()), {}, prefix="/m", runnable=True)["Cmd"] == []
    model_only = run_config(ImageConfig(), {}, prefix="/models", runnable=False)
    assert "Cmd" not in model_only and model_only["Env"] == ["PYTHONPATH=/models"]


def test_model_only_image_has_no_command(tmp_path: Path) -> None:
    build(tmp_path, ImageConfig())
    layout = validate_layout(tmp_path / "image")
    assert "Cmd" not in layout.config["config"] and "Entrypoint" not in layout.config["config"]
    assert layout.index["manifests"][0]["platform"] == {"os": "linux", "architecture": "amd64"}


def test_single_manifest_base_of_another_architecture_is_refused(tmp_path: Path) -> None:
    make_base(tmp_path / "base", tag="v1", arch="arm64")
    ref = f"oci:{tmp_path / 'base'}:v1"
    with pytest.raises(ImageError, match="the base image is for linux/arm64, but image.platform is linux/amd64"):
        build(tmp_path / "a", ImageConfig(base=ref))
    build(tmp_path / "b", ImageConfig(base=ref, platform="linux/arm64"))
    layout = validate_layout(tmp_path / "b" / "image")
    assert layout.index["manifests"][0]["platform"] == {"os": "linux", "architecture": "arm64"}
    assert (layout.config["os"], layout.config["architecture"]) == ("linux", "arm64")


def test_verify_catches_an_index_that_disagrees_with_the_config(tmp_path: Path) -> None:
    build(tmp_path, ImageConfig())
    path = tmp_path / "image" / "index.json"
    index = json.loads(path.read_bytes())
    index["manifests"][0]["platform"]["architecture"] = "arm64"
    path.write_bytes(canonical_json(index))
    with pytest.raises(VerifyError, match="the index says architecture 'arm64', the image config 'amd64'"):
        verify_image(tmp_path)


def test_base_name_is_a_registry_reference_never_a_path(tmp_path: Path) -> None:
    full = "docker.io/library/debian:12"
    make_base(tmp_path / "named", tag=full)
    out = tmp_path / "o1"
    build(out, ImageConfig(base=f"oci:{tmp_path / 'named'}"))
    ann = validate_layout(out / "image").manifest["annotations"]
    assert ann["org.opencontainers.image.base.name"] == full
    assert str(tmp_path) not in json.dumps(ann)
    make_base(tmp_path / "plain", tag="v1")
    pinned = "registry.example.com:5000/base/python@sha256:" + "a" * 64
    build(tmp_path / "o2", ImageConfig(base=f"oci:{tmp_path / 'plain'}:v1", base_name=pinned))
    ann = validate_layout(tmp_path / "o2" / "image").manifest["annotations"]
    assert ann["org.opencontainers.image.base.name"] == pinned
    assert base_name(ImageConfig(), "v1") is None and base_name(ImageConfig(), "/srv/x:y") is None


def test_created_from_source_date_epoch_else_commit_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    assert created_epoch({}) == 0 and created_epoch({"commit_time": 1_700_000_000}) == 1_700_000_000
    build(tmp_path / "c", ImageConfig(), {**SOURCE, "commit_time": 1_700_000_000})
    layout = validate_layout(tmp_path / "c" / "image")
    assert layout.config["created"] == "2023-11-14T22:13:20Z"
    assert {m.mtime for la in layout.layers for m in la.members} == {1_700_000_000}
    verify_image(tmp_path / "c")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "86400")
    assert created_epoch({"commit_time": 1_700_000_000}) == 86400
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "soon")
    with pytest.raises(ImageError, match="SOURCE_DATE_EPOCH"):
        created_epoch({})


def test_the_dockerfile_says_what_the_config_says(tmp_path: Path) -> None:
    cfg = replace(ImageConfig(), user="1000:0", env=(("HF_HUB_OFFLINE", "1"),), cmd=("python3", "serve.py"))
    build(tmp_path, cfg)
    text = (tmp_path / "Dockerfile").read_text()
    assert "ENV HF_HUB_OFFLINE=1\n" in text and "USER 1000:0" in text and "WORKDIR /models" in text
    assert 'CMD ["python3", "serve.py"]' in text and "docker.io/nvidia/cuda:" in text
