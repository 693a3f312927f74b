"""The demo build's image as engines mount it: a plain model directory, and its ModelPack view.

A real ``packer build`` (a real bundle, so config and tokenizer files become plain files), read
back with umoci, transformers, the safetensors library and the spec's vendored JSON schema.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from packer.building import build
from packer.errors import VerifyError
from packer.oci import verify_image
from packer.oci.modelpack import ARTIFACT_TYPE, FILE_METADATA, FILEPATH, modelpack_tag
from packer.recipe import demo_recipe
from packer.runtime.bundle_reader import Bundle
from tests.built import weight_bytes
from tests.oci_validate import all_files, require_tool, run, validate_layout

SCHEMA = Path(__file__).parent / "schemas" / "modelpack" / "config-schema.json"
# docs/spec.md of the vendored commit: the layer media types implementations should support
SPEC_LAYER_TYPES = {f"application/vnd.cncf.model.{kind}.v1.{fmt}"
                    for kind in ("weight", "weight.config", "doc", "code", "dataset")
                    for fmt in ("raw", "tar", "tar+gzip", "tar+zstd")}
REF = "org.opencontainers.image.ref.name"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mp") / "out"
    build(demo_recipe(), out)
    return out


def _blob(image: Path, digest: str) -> bytes:
    return (image / "blobs" / "sha256" / digest[7:]).read_bytes()


def _view(out: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    index = json.loads((out / "image" / "index.json").read_bytes())
    (desc,) = [d for d in index["manifests"] if d.get("artifactType") == ARTIFACT_TYPE]
    manifest = json.loads(_blob(out / "image", desc["digest"]))
    return desc, manifest, json.loads(_blob(out / "image", manifest["config"]["digest"]))


def test_modelpack_view_validates_and_shares_the_weight_blobs(demo: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    image = validate_layout(demo / "image", "packer-demo:0.1.0")
    desc, manifest, config = _view(demo)
    assert desc["annotations"][REF] == modelpack_tag("packer-demo:0.1.0") == "packer-demo:0.1.0-modelpack"
    assert "platform" not in desc and desc["artifactType"] == manifest["artifactType"] == ARTIFACT_TYPE
    jsonschema.Draft202012Validator(json.loads(SCHEMA.read_bytes())).validate(config)
    assert manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert manifest["config"]["mediaType"] == "application/vnd.cncf.model.config.v1+json"
    assert {la["mediaType"] for la in manifest["layers"]} <= SPEC_LAYER_TYPES
    weights = [la for la in manifest["layers"] if la["mediaType"] == "application/vnd.cncf.model.weight.v1.tar"]
    image_weights = [la.descriptor for la in image.layers if la.descriptor["mediaType"].endswith(".layer.v1.tar")]
    assert [(w["digest"], w["size"]) for w in weights] == [(w["digest"], w["size"]) for w in image_weights]
    files = all_files(image)
    for la, diff_id in zip(manifest["layers"], config["modelfs"]["diffIds"], strict=True):
        path = la["annotations"][FILEPATH]
        meta = json.loads(la["annotations"][FILE_METADATA])
        assert path.startswith("models/") and meta["name"] == Path(path).name
        assert meta["size"] == len(files[path]) and meta["mode"] == 0o644 and meta["typeflag"] == ord("0")
        if la in weights:  # uncompressed: the tar's digest is its diff_id
            assert diff_id == la["digest"]
    paths = sorted(la["annotations"][FILEPATH] for la in manifest["layers"])
    assert paths == ["models/config.json", "models/generation_config.json", "models/model.safetensors",
                     "models/packer-chunks.json",  # the signed chunk table: a reader proves each chunk it reads
                     "models/special_tokens_map.json", "models/tokenizer.json", "models/tokenizer_config.json"]
    assert config["descriptor"]["name"] == "packer-demo" and config["config"]["format"] == "safetensors"
    assert all(d.startswith("sha256:") for d in config["modelfs"]["diffIds"])


def test_verify_checks_the_view(demo: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(demo), str(copy)], check=True)
    _, manifest, _ = _view(copy)
    small = next(la for la in manifest["layers"] if la["annotations"][FILEPATH] == "models/config.json")
    blob = copy / "image/blobs/sha256" / small["digest"][7:]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 1
    blob.write_bytes(bytes(data))
    with pytest.raises(VerifyError, match=small["digest"][7:]):
        verify_image(copy)


def test_the_image_is_a_model_directory_engines_read(demo: Path, tmp_path: Path) -> None:
    umoci = require_tool("umoci")
    flags = [] if os.geteuid() == 0 else ["--rootless"]
    run([umoci, "unpack", *flags, "--image", f"{demo / 'image'}:packer-demo:0.1.0", str(tmp_path / "b")])
    models = tmp_path / "b" / "rootfs" / "models"
    assert (models / "model.safetensors").read_bytes() == weight_bytes(demo)  # OUT holds it in its layer blob
    assert not (models / "weights").exists()  # one copy of each weight file
    assert os.access(models / "packer_loader.py", os.X_OK)
    from safetensors.torch import load, load_file
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(models).model_type == "llama"
    assert AutoTokenizer.from_pretrained(models)("hello world")["input_ids"]
    want = load(weight_bytes(demo))
    got = load_file(models / "model.safetensors")
    assert sorted(got) == sorted(want) and all(got[k].equal(want[k]) for k in want)
    # the loader beside them finds the weights at the top of the model directory
    env = {**os.environ, "PACKER_BUNDLE_CACHE": str(tmp_path / "cache"), "PACKER_STARTUP_LOG": "off"}
    proc = subprocess.run([sys.executable, str(models / "packer_loader.py"), "--selftest", "--verify"],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "self-test passed" in proc.stderr
    bundle = Bundle.open(demo / "bundle.tar.zst")
    assert bundle.names() and all((models / n).read_bytes() == bundle.read(n) for n in bundle.names())
