"""A warm state as its own image (packer/oci/warm_layer.py) and its signature (packer/warm/trust.py).

No engine runs here: the state is one :mod:`tests.test_warm_state` writes from generated cache
files, beside a real build with its image; the image is read by the real skopeo and umoci.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from packer.errors import VerifyError, WarmStateError
from packer.oci.warm_layer import WARM_ANNOTATION, add_warm_image, warm_tag
from packer.sign.keys import load_signing_key, signed_bundle
from packer.verifying import verify
from packer.warm.pins import collect, read_state, write_state
from packer.warm.trust import build_digest, check_signature
from tests.built import build_dir
from tests.hf_fixtures import llama
from tests.oci_validate import REF, all_files, require_tool, run, validate_layout
from tests.sign_fixtures import make_keypair
from tests.test_warm_state import KEY, _engine_caches

pytest.importorskip("transformers")
NAME = "vllm-cpu-x86_64"
TAG = "m:1"


def built(tmp: Path, *, key: Path | None = None, out: str = "out") -> Path:
    """A small build with its image (signed with ``key``), and a warm state beside it (signed too)."""
    if not (tmp / "hf").exists():
        llama(tmp / "hf")
    build_dir(tmp / "hf", tmp / out, **({"sign": {"key": str(key)}} if key else {}))
    signer = functools.partial(signed_bundle, load_signing_key(key)) if key else None
    caches = _engine_caches(tmp / out / ".." / f"caches-{out}")
    write_state(tmp / out / "warm" / NAME, name=NAME, key=KEY, files=collect(caches), signer=signer)
    return tmp / out


def test_the_state_is_one_more_layer_on_the_builds_image(tmp_path: Path) -> None:
    out = built(tmp_path)
    before = (out / "image" / "index.json").read_bytes()
    got = add_warm_image(out, out / "warm" / NAME, tag=TAG)
    assert got["tag"] == warm_tag(TAG, NAME) == "m:1-warm-vllm-cpu-x86_64"
    base = validate_layout(out / "image", TAG)
    warm = validate_layout(out / "image", got["tag"])
    assert warm.manifest["layers"][:-1] == base.manifest["layers"]  # the build's blobs, shared
    assert warm.config["rootfs"]["diff_ids"][:-1] == base.config["rootfs"]["diff_ids"]
    assert warm.manifest["annotations"][WARM_ANNOTATION] == NAME
    top = warm.layers[-1].contents
    state = out / "warm" / NAME
    assert top[f"models/warm/{NAME}/manifest.json"] == (state / "manifest.json").read_bytes()
    for rel in read_state(state)[0]["files"]:
        assert top[f"models/warm/{NAME}/files/{rel}"] == (state / "files" / rel).read_bytes()
    index = json.loads((out / "image" / "index.json").read_bytes())
    assert [d["annotations"][REF] for d in index["manifests"]][:1] == [TAG]
    assert {**index, "manifests": [d for d in index["manifests"] if WARM_ANNOTATION not in d["annotations"]]} \
        == json.loads(before)
    summary = verify(out)
    assert summary["warm_states"] == [NAME]


def test_skopeo_and_umoci_read_the_warm_image(tmp_path: Path) -> None:
    skopeo, umoci = require_tool("skopeo"), require_tool("umoci")
    out = built(tmp_path)
    tag = add_warm_image(out, out / "warm" / NAME, tag=TAG)["tag"]
    base = json.loads(run([skopeo, "inspect", f"oci:{out / 'image'}:{TAG}"]).stdout)
    info = json.loads(run([skopeo, "inspect", f"oci:{out / 'image'}:{tag}"]).stdout)
    assert info["Layers"][:-1] == base["Layers"] and len(info["Layers"]) == len(base["Layers"]) + 1
    run([umoci, "unpack", "--image", f"{out / 'image'}:{tag}", str(tmp_path / "bundle")])
    root = tmp_path / "bundle" / "rootfs" / "models"
    assert (root / "warm" / NAME / "manifest.json").read_bytes() == (out / "warm" / NAME / "manifest.json").read_bytes()
    assert (root / "packer_loader.py").is_file()  # the build's own files below it
    run([skopeo, "copy", "--quiet", "--preserve-digests", f"oci:{out / 'image'}:{tag}", f"oci:{tmp_path / 'c'}:x"])


def test_the_same_state_gives_the_same_bytes_and_warming_again_replaces_it(tmp_path: Path) -> None:
    a = built(tmp_path, out="a")
    b = built(tmp_path, out="b")
    for out in (a, b):
        add_warm_image(out, out / "warm" / NAME, tag=TAG)
    assert (a / "image" / "index.json").read_bytes() == (b / "image" / "index.json").read_bytes()
    first = add_warm_image(a, a / "warm" / NAME, tag=TAG)
    index = json.loads((a / "image" / "index.json").read_bytes())
    assert sum(WARM_ANNOTATION in d["annotations"] for d in index["manifests"]) == 1
    assert first["manifest_digest"] in {d["digest"] for d in index["manifests"]}


def test_adding_a_changed_state_again_removes_the_old_warm_images_blobs(tmp_path: Path) -> None:
    out = built(tmp_path)
    old = add_warm_image(out, out / "warm" / NAME, tag=TAG)
    write_state(out / "warm" / NAME, name=NAME, key={**KEY, "model_path": "/srv/model"},
                files=collect(_engine_caches(tmp_path / "again")))
    new = add_warm_image(out, out / "warm" / NAME, tag=TAG)
    blobs = out / "image" / "blobs" / "sha256"
    assert old["manifest_digest"] != new["manifest_digest"]
    assert not (blobs / old["manifest_digest"].removeprefix("sha256:")).exists()
    assert not (blobs / old["layer_digest"].removeprefix("sha256:")).exists()
    assert verify(out)["warm_states"] == [NAME]
    validate_layout(out / "image", TAG)  # the build's own image untouched


@pytest.mark.parametrize("tamper", ["layer", "tag", "state", "gone"])
def test_verify_refuses_a_warm_image_its_state_does_not_make(tmp_path: Path, tamper: str) -> None:
    out = built(tmp_path)
    got = add_warm_image(out, out / "warm" / NAME, tag=TAG)
    index_path = out / "image" / "index.json"
    if tamper == "layer":
        blob = out / "image" / "blobs" / "sha256" / got["layer_digest"].removeprefix("sha256:")
        data = bytearray(blob.read_bytes())
        data[-2000] ^= 1
        blob.write_bytes(bytes(data))
        said = "the warm layer blob differs"
    elif tamper == "tag":
        index = json.loads(index_path.read_bytes())
        index["manifests"][-1]["annotations"][REF] = "m:1-warm-other"
        index_path.write_bytes(json.dumps(index).encode())
        said = "is not the one .* makes"
    elif tamper == "state":
        info = out / "warm" / NAME / "files" / "vllm" / "modelinfos" / "llama.json"
        info.write_text('{"hash": "2"}')
        said = "llama.json: sha256 .* differs from the pin"
    else:
        import shutil

        shutil.rmtree(out / "warm" / NAME)
        said = f"names the state '{NAME}', which .* does not hold"
    with pytest.raises(VerifyError, match=said):
        verify(out)


def test_a_signed_state_is_covered_by_the_builds_key(tmp_path: Path) -> None:
    pytest.importorskip("model_signing")
    key, pub = make_keypair(tmp_path / "keys")
    out = built(tmp_path, key=key)
    add_warm_image(out, out / "warm" / NAME, tag=TAG)
    index = json.loads((out / "image" / "index.json").read_bytes())
    assert index["manifests"][-1]["artifactType"] == "application/vnd.dev.sigstore.bundle.v0.3+json"  # stays last
    assert verify(out, public_key=pub)["warm_states"] == [NAME]
    # the build a state is signed for is the same in OUT and in the image's model directory
    shipped = all_files(validate_layout(out / "image", TAG))["models/manifest.json"]
    assert build_digest(out) == hashlib.sha256(shipped).hexdigest() != _sha(out / "manifest.json")
    state = out / "warm" / NAME
    doc, digest = read_state(state)
    check_signature(state, digest, public_key=str(pub), build_sha256=build_digest(out))
    _, other = make_keypair(tmp_path / "other")
    with pytest.raises(WarmStateError, match="state.sig: signed by another key"):
        check_signature(state, digest, public_key=str(other), build_sha256=build_digest(out))
    with pytest.raises(WarmStateError, match="state.sig: signed for another build"):
        check_signature(state, digest, public_key=str(pub), build_sha256="0" * 64)
    # the manifest changed after signing (a file re-pinned by hand): the signature no longer covers it
    doc["key"] = {**doc["key"], "model_path": "/elsewhere"}
    (state / "manifest.json").write_bytes(json.dumps(doc, sort_keys=True).encode())
    with pytest.raises(VerifyError, match="state.sig: signs another manifest"):
        verify(out, public_key=pub)


def test_an_unsigned_state_is_refused_where_a_signature_is_required(tmp_path: Path) -> None:
    pytest.importorskip("model_signing")
    key, pub = make_keypair(tmp_path / "keys")
    out = built(tmp_path, key=key)
    (out / "warm" / NAME / "state.sig").unlink()
    verify(out)  # unsigned is allowed where nothing requires a signature
    with pytest.raises(VerifyError, match=r"state.sig: missing; the state is unsigned \(sign it with packer warm "
                                          r"--sign-key"):
        verify(out, public_key=pub)


def test_packer_warm_signs_with_the_key_it_is_given(tmp_path: Path) -> None:
    """``packer warm --sign-key`` reads the key before the engine runs: a bad key is one line."""
    out = built(tmp_path)
    bad = tmp_path / "bad.pem"
    bad.write_text("not a key")
    r = subprocess.run([sys.executable, "-m", "packer", "warm", str(out), "--sign-key", str(bad), "--", "--x"],
                       capture_output=True, text=True, timeout=120, check=False,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"error: {bad}: "), r.stderr


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
