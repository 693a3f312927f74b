"""packer push to a local registry (the distribution's docker-registry), digests compared."""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from packer.build import build
from packer.errors import ImageError
from packer.oci import build_image, push
from packer.recipe import ImageConfig, demo_recipe, with_sign_key
from tests.oci_validate import REF, make_out, require_tool, run, validate_layout, validate_referrer
from tests.sign_fixtures import make_keypair

REGISTRY = "/usr/bin/docker-registry"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    if not Path(REGISTRY).exists():
        pytest.skip(f"{REGISTRY} is not installed (apt-get install docker-registry)")
    port = _free_port()
    config = tmp_path / "registry.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {tmp_path / 'registry-data'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    proc = subprocess.Popen([REGISTRY, "serve", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode() if proc.stderr else ""
                    pytest.fail(f"docker-registry did not start: {err[-500:]}")
                time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_push_digest_matches_local(tmp_path: Path, registry: str) -> None:
    skopeo = require_tool("skopeo")
    out = tmp_path / "out"
    files, manifest = make_out(out)
    result = build_image(out, cfg=ImageConfig(), name="demo", version="1.0",
                         source={"kind": "demo", "uri": "demo", "revision": None},
                         artifact_files=files, artifact_manifest=manifest)
    pushed = push(out, f"{registry}/models/demo:1.0", tls_verify=False)
    local = validate_layout(out / "image").manifest_digest
    view = result.section["modelpack"]["manifest_digest"]
    assert pushed == {f"{registry}/models/demo:1.0": local, f"{registry}/models/demo:1.0-modelpack": view}
    assert local == result.section["manifest_digest"]
    # read back with a real client: the same manifest bytes under both tags, the weights stored once
    for tag, digest in (("1.0", local), ("1.0-modelpack", view)):
        raw = run([skopeo, "inspect", "--raw", "--tls-verify=false",
                   f"docker://{registry}/models/demo:{tag}"]).stdout.encode()
        assert "sha256:" + hashlib.sha256(raw).hexdigest() == digest
    back = tmp_path / "back"
    run([skopeo, "copy", "--quiet", "--src-tls-verify=false", "--preserve-digests",
         f"docker://{registry}/models/demo:1.0-modelpack", f"oci:{back}:mp"])
    (desc,) = json.loads((back / "index.json").read_bytes())["manifests"]
    assert desc["digest"] == view
    shared = {la["digest"] for la in result.section["layers"] if la["media_type"].endswith(".tar")}
    data = tmp_path / "registry-data/docker/registry/v2/blobs/sha256"
    assert shared and all((data / d[7:9] / d[7:] / "data").is_file() for d in shared)
    remote = json.loads(run([skopeo, "inspect", "--tls-verify=false",
                             f"docker://{registry}/models/demo:1.0"]).stdout)
    assert remote["Digest"] == local
    raw = run([skopeo, "inspect", "--raw", "--tls-verify=false",
               f"docker://{registry}/models/demo@{local}"]).stdout
    assert json.loads(raw)["layers"][0]["mediaType"] == "application/vnd.oci.image.layer.v1.tar"


def test_push_carries_the_provenance_referrer(tmp_path: Path, registry: str) -> None:
    skopeo = require_tool("skopeo")
    key, _ = make_keypair(tmp_path)
    out = tmp_path / "out"
    build(with_sign_key(demo_recipe(), key), out)
    image = validate_layout(out / "image")
    subject = next(d for d in image.index["manifests"] if d.get("annotations", {}).get(REF) == "packer-demo:0.1.0")
    desc, local, _ = validate_referrer(out / "image", subject)
    pushed = push(out, f"{registry}/models/demo:1.0", tls_verify=False)
    fallback = f"{registry}/models/demo:sha256-{image.manifest_digest[7:]}"  # the referrers tag schema
    assert list(pushed) == [f"{registry}/models/demo:1.0", f"{registry}/models/demo:1.0-modelpack", fallback]
    assert pushed[f"{registry}/models/demo:1.0"] == image.manifest_digest
    raw = run([skopeo, "inspect", "--raw", "--tls-verify=false", f"docker://{fallback}"]).stdout.encode()
    listing = json.loads(raw)
    assert "sha256:" + hashlib.sha256(raw).hexdigest() == pushed[fallback]
    assert listing["mediaType"] == "application/vnd.oci.image.index.v1+json" and listing["manifests"] == [
        {k: v for k, v in desc.items() if k != "artifactType"}]  # skopeo 1.9 cannot keep it (see push.py)
    raw = run([skopeo, "inspect", "--raw", "--tls-verify=false",
               f"docker://{registry}/models/demo@{desc['digest']}"]).stdout.encode()
    assert "sha256:" + hashlib.sha256(raw).hexdigest() == desc["digest"] and json.loads(raw) == local
    assert local["subject"]["digest"] == pushed[f"{registry}/models/demo:1.0"]
    back = tmp_path / "back"  # the bundle's bytes, read back through a real client
    run([skopeo, "copy", "--quiet", "--src-tls-verify=false", "--preserve-digests",
         f"docker://{registry}/models/demo@{desc['digest']}", f"oci:{back}:provenance"])
    layer = back / "blobs" / "sha256" / local["layers"][0]["digest"][7:]
    assert layer.read_bytes() == (out / "provenance.sigstore.json").read_bytes()


def test_push_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ImageError, match="cannot read the image index"):
        push(tmp_path, "127.0.0.1:1/x:y")
    out = tmp_path / "out"
    files, manifest = make_out(out)
    build_image(out, cfg=ImageConfig(), name="demo", version="1.0",
                source={"kind": "demo", "uri": "demo", "revision": None},
                artifact_files=files, artifact_manifest=manifest)
    monkeypatch.setenv("PATH", str(tmp_path))  # a readable image, but no skopeo on PATH
    with pytest.raises(ImageError, match="skopeo is not installed"):
        push(out, "127.0.0.1:1/x:y")
