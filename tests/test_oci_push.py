"""packer push to a local registry (the distribution's docker-registry), digests compared."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from packer.building import build
from packer.errors import ImageError
from packer.oci import build_image, push
from packer.recipe import ImageConfig, demo_recipe, with_sign_key
from packer.util.fsutil import canonical_json
from tests.built import weight_location
from tests.oci_validate import REF, make_out, require_tool, run, validate_layout, validate_referrer
from tests.registry_fixtures import docker_registry, htpasswd_line
from tests.sign_fixtures import make_keypair


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    with docker_registry(tmp_path) as address:
        yield address


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


@pytest.fixture(scope="module")
def signed_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A signed demo build (with its provenance referrer), built once; tests push copies of it."""
    where = tmp_path_factory.mktemp("signed")
    key, _ = make_keypair(where)
    build(with_sign_key(demo_recipe(), key), where / "out")
    return where / "out"


def _packer(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "packer", *args], capture_output=True, text=True, timeout=300,
                          check=False, env={**os.environ, **(env or {})})


def _one_line(proc: subprocess.CompletedProcess[str], code: int, reason: str) -> None:
    lines = [line for line in proc.stderr.strip().splitlines() if line]
    assert proc.returncode == code, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and reason in lines[0], proc.stderr


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else b"") for p in sorted(root.rglob("*"))}


HOSTILE_DIGESTS = ["sha256:../../../canary", "sha256:../../../../" + "x" * 50, "sha256:" + "A" * 64,
                   "sha256:" + "a" * 63 + "/", "sha512:../canary", "md5:0123", "sha256:", 12345, None]


def _hostile_copy(signed_out: Path, tmp_path: Path, field: str, digest: object) -> Path:
    """A copy of the signed build whose referrer names ``digest`` in ``field`` of its index entry
    (``index``) or of its manifest (``config``, ``layer``); a changed manifest is stored under its
    own digest and the index points at it, as an attacker would write it."""
    out = tmp_path / "out"
    shutil.copytree(signed_out, out)
    index_path = out / "image" / "index.json"
    index = json.loads(index_path.read_bytes())
    entry = index["manifests"][-1]  # the referrer
    if field == "index":
        entry["digest"] = digest
    else:
        blob = out / "image" / "blobs" / "sha256" / entry["digest"][7:]
        manifest = json.loads(blob.read_bytes())
        (manifest["config"] if field == "config" else manifest["layers"][0])["digest"] = digest
        raw = json.dumps(manifest).encode()
        (blob.parent / hashlib.sha256(raw).hexdigest()).write_bytes(raw)
        entry.update(digest="sha256:" + hashlib.sha256(raw).hexdigest(), size=len(raw))
    index_path.write_bytes(canonical_json(index))  # as packer writes it: verify gets to the referrer
    return out


@pytest.mark.parametrize("digest", HOSTILE_DIGESTS, ids=[str(d)[:24] for d in HOSTILE_DIGESTS])
@pytest.mark.parametrize("field", ["index", "config", "layer"])
def test_push_refuses_a_hostile_referrer_digest(tmp_path: Path, signed_out: Path, monkeypatch: pytest.MonkeyPatch,
                                                field: str, digest: object) -> None:
    from packer.oci.push import push as copy_image

    out = _hostile_copy(signed_out, tmp_path, field, digest)
    (tmp_path / "canary").write_bytes(b"canary")
    (tmp_path / "tmp").mkdir()  # the temporary layout goes here: a write outside it shows in the tree
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    before = _tree(tmp_path)
    # packer push verifies OUT first: the referrer's digests are checked there
    _one_line(_packer("push", str(out), "127.0.0.1:1/x:y", env={"TMPDIR": str(tmp_path / "tmp")}), 1, "digest")
    # the copier alone, without the verification before it, checks every digest before the first copy
    with pytest.raises(ImageError, match="digest"):
        copy_image(out, "127.0.0.1:1/x:y")
    assert _tree(tmp_path) == before


NOT_REFS = ["-x", "--all", "a b/c:1", "reg.io/x:1\nRUN x", "reg.io/x:1 ", "dir:/tmp/x", "docker-daemon:x:1",
            "docker-daemon:reg.io/x:1", "oci:/tmp/x:t", "oci-archive:/tmp/x.tar", "containers-storage:x",
            "x:1", "docker://-x", "", "reg.io/UPPER:1", "reg.io/x:bad tag", "reg.io//x", "reg.io/x@sha256:z"]
REFS = ["127.0.0.1:5000/models/demo:1.0", "localhost/x", "registry.example.com/team/model:1.0",
        "docker://reg.io/a/b@sha256:" + "0" * 64, "[::1]:5000/x:y", "reg.io/a_b/c-d.e:v1.0_rc-1"]


@pytest.mark.parametrize("ref", NOT_REFS, ids=[repr(r)[:28] for r in NOT_REFS])
def test_push_refuses_what_is_no_registry_reference(tmp_path: Path, signed_out: Path, ref: str) -> None:
    trip = tmp_path / "bin"
    trip.mkdir()
    (trip / "skopeo").write_text(f"#!/bin/sh\ntouch {tmp_path / 'skopeo-ran'}\n")
    (trip / "skopeo").chmod(0o755)
    proc = _packer("push", str(signed_out), "--", ref, env={"PATH": f"{trip}:{os.environ['PATH']}"})
    _one_line(proc, 2, "is not a registry reference")
    assert not (tmp_path / "skopeo-ran").exists()


@pytest.mark.parametrize("ref", REFS)
def test_registry_references_are_taken(ref: str) -> None:
    from packer.oci.registry_ref import check_ref

    assert check_ref(ref) == ref.removeprefix("docker://")


def test_packer_push_verifies_before_it_copies(tmp_path: Path, signed_out: Path, registry: str) -> None:
    skopeo = require_tool("skopeo")
    out = tmp_path / "out"
    shutil.copytree(signed_out, out)
    path, offset, size = weight_location(out, "weights/model.safetensors")  # its one copy: in its layer blob
    tampered = bytearray(path.read_bytes())
    tampered[offset + size - 1] ^= 1
    path.write_bytes(bytes(tampered))
    _one_line(_packer("push", str(out), f"{registry}/models/demo:1.0", "--no-tls-verify"), 1, "differs")
    listed = subprocess.run([skopeo, "list-tags", "--tls-verify=false", f"docker://{registry}/models/demo"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert listed.returncode != 0 or "1.0" not in listed.stdout  # nothing was pushed
    proc = _packer("push", str(signed_out), f"{registry}/models/demo:1.0", "--no-tls-verify", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["referrers"]


def test_a_plain_http_registry_is_told_to_use_no_tls_verify(tmp_path: Path, signed_out: Path, registry: str) -> None:
    require_tool("skopeo")
    proc = _packer("push", str(signed_out), f"{registry}/models/demo:1.0")  # TLS verified: the default
    _one_line(proc, 1, "the registry answers in plain HTTP: for a local or test registry pass --no-tls-verify")
    assert _packer("push", str(signed_out), f"{registry}/models/demo:1.0", "--no-tls-verify").returncode == 0


@pytest.mark.parametrize("auth", ["default Debian config", "htpasswd"])
def test_a_registry_asking_for_credentials_is_named_as_the_cause(tmp_path: Path, signed_out: Path, auth: str) -> None:
    """Debian's docker-registry as installed answers a push with a bare 400 (its config names an
    htpasswd directory); a registry with a real htpasswd file answers 401. Each gets its cause."""
    require_tool("skopeo")
    kwargs = ({"htpasswd_path": tmp_path / "etc-docker-registry"} if auth != "htpasswd"
              else {"htpasswd": htpasswd_line("user", "secret")})
    if auth != "htpasswd":
        (tmp_path / "etc-docker-registry").mkdir()
    with docker_registry(tmp_path / "registry", **kwargs) as address:  # type: ignore[arg-type]
        proc = _packer("push", str(signed_out), f"{address}/models/demo:1.0", "--no-tls-verify")
    cause = ("remove the auth section" if auth != "htpasswd" else "the registry asks for credentials: log in")
    _one_line(proc, 1, cause)
    assert proc.stderr.rstrip().endswith("(see docs/troubleshooting.md#a-push-refused-with-400-or-401)")
