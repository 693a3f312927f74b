"""The runtime's signature check (packer/runtime/signature.py): the model directory's layout,
``model_dir()`` verified by the real ``model_signing``, and ``PACKER_REQUIRE_SIGNATURE``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from packer.runtime.env import ArtifactMismatchError
from packer.runtime.hf import hf_model_dir
from packer.runtime.settings import RuntimeSettings
from packer.runtime.signature import (
    model_layout,
    open_signed,
    read_bundle,
    require_signature,
    signed_digests,
    statement_of,
)
from tests.loader_fixtures import make_loader, make_out
from tests.sign_fixtures import make_keypair, model_signing_verify


@pytest.fixture()
def signed_out(tmp_path: Path) -> tuple[Path, dict[str, Any], Path, Path]:
    """A sharded build with a nested bundle member, its model.sig and the key pair."""
    from packer.sign.keys import load_signing_key
    from packer.sign.model_sig import write_model_signature

    out = tmp_path / "out"
    manifest = make_out(out)
    key, pub = make_keypair(tmp_path / "keys")
    write_model_signature(out, manifest, load_signing_key(key), name="tiny")
    return out, manifest, key, pub


def test_layout_names_weights_by_file_and_members_by_path(signed_out: tuple[Path, dict[str, Any], Path, Path]) -> None:
    _, manifest, _, _ = signed_out
    layout = model_layout(manifest)
    assert list(layout) == sorted(layout)
    assert layout["model-00001-of-00002.safetensors"][0] == "weights/model-00001-of-00002.safetensors"
    assert layout["model.safetensors.index.json"][0] == "weights/model.safetensors.index.json"
    assert layout["tok/vocab.txt"] == ("", manifest["bundle"]["members"][1]["sha256"])
    clash = {**manifest, "bundle": {**manifest["bundle"], "members": [
        *manifest["bundle"]["members"], {"name": "model.sig", "size": 1, "sha256": "0" * 64},
        {"name": "model.safetensors.index.json", "size": 1, "sha256": "0" * 64}]}}
    assert model_layout(clash) == layout  # a weight file wins over a member; model.sig is never signed


def test_model_dir_of_nested_members_verifies_with_model_signing(signed_out: tuple[Path, dict[str, Any], Path, Path],
                                                                  tmp_path: Path) -> None:
    out, manifest, _, pub = signed_out
    ld = make_loader(out, manifest)
    ld.settings = RuntimeSettings(bundle_cache=str(tmp_path / "cache"))
    d = hf_model_dir(ld)
    assert (d / "tok").is_dir() and not (d / "tok").is_symlink() and (d / "tok" / "vocab.txt").is_symlink()
    assert sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()) == sorted(
        [*model_layout(manifest), "model.sig"])
    r = model_signing_verify(d, pub, allow_symlinks=True)
    assert (r.returncode, r.stdout.strip()) == (0, "Verification succeeded"), r.stderr
    r = model_signing_verify(d, pub)
    assert r.returncode == 1 and "because it is a symlink" in r.stderr  # the links need --allow_symlinks


def test_required_signature_forces_the_sha256_check(signed_out: tuple[Path, dict[str, Any], Path, Path],
                                                    tmp_path: Path) -> None:
    out, manifest, _, pub = signed_out
    settings = RuntimeSettings(require_signature=str(pub), bundle_cache=str(tmp_path / "cache"))
    from packer.runtime.loader import Loader, Timeline

    ld = Loader(manifest, out, timeline=Timeline(), settings=settings)
    assert set(ld.load_weights("cpu")) >= {"embed.weight", "big.weight"}
    assert "verify sha256" in [s["stage"] for s in ld.timeline.stages]  # although verify=False
    shard = out / "weights" / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ArtifactMismatchError, match=r"model-00002-of-00002.safetensors: sha256"):
        ld.load_weights("cpu")


def test_required_signature_refusals(signed_out: tuple[Path, dict[str, Any], Path, Path], tmp_path: Path) -> None:
    out, manifest, _, pub = signed_out
    require_signature(out, str(pub), manifest=manifest)
    with pytest.raises(ArtifactMismatchError, match=r"PACKER_REQUIRE_SIGNATURE=.*nope.pub: cannot read the public key"):
        require_signature(out, str(tmp_path / "nope.pub"), manifest=manifest)
    other = {**manifest, "files": {**manifest["files"], "weights/model.safetensors.index.json": {
        "size": 1, "sha256": "ab" * 32}}}
    with pytest.raises(ArtifactMismatchError, match=r"model.sig: signs model.safetensors.index.json with sha256 "
                                                    r"\w+\.\.\., this loader's manifest pins abababab"):
        require_signature(out, str(pub), manifest=other)
    (out / "model.sig").rename(out / "moved.sig")
    with pytest.raises(ArtifactMismatchError, match=r"model.sig: missing, and PACKER_REQUIRE_SIGNATURE asks for "
                                                    r"a build signed with packer build --sign-key \(see docs/"
                                                    r"troubleshooting.md#a-build-refused-under-packer_require_signature\)$"):
        require_signature(out, str(pub), manifest=manifest)


def test_statement_rules(signed_out: tuple[Path, dict[str, Any], Path, Path]) -> None:
    out, _, _, pub = signed_out
    data = (out / "model.sig").read_bytes()
    statement = open_signed(data, pub.read_bytes(), "model.sig")
    assert len(signed_digests(statement, "model.sig")) == 5
    changed = json.loads(json.dumps(statement))
    changed["predicate"]["resources"][0]["digest"] = "00" * 32
    with pytest.raises(ArtifactMismatchError, match="do not hash to the signed root digest"):
        signed_digests(changed, "model.sig")
    changed["predicate"]["resources"][0]["algorithm"] = "blake3"
    with pytest.raises(ArtifactMismatchError, match="signs blake3 digests; packer pins sha256"):
        signed_digests(changed, "model.sig")
    with pytest.raises(ArtifactMismatchError, match="predicate 'x'"):
        signed_digests({**statement, "predicateType": "x"}, "model.sig")
    for junk in (b"", b"{}", b'{"dsseEnvelope": {"payload": "!!"}}'):
        with pytest.raises(ArtifactMismatchError, match="model.sig: not a key-signed Sigstore bundle"):
            read_bundle(junk, "model.sig")
    bundle = json.loads(data)
    bundle["verificationMaterial"]["publicKey"]["hint"] = ""  # no hint: the signature itself must fail
    _, other = make_keypair(out / "k2")
    with pytest.raises(ArtifactMismatchError, match="model.sig: the signature does not verify with k2"):
        open_signed(json.dumps(bundle).encode(), other.read_bytes(), "model.sig", key_name="k2")
    bundle["dsseEnvelope"]["payloadType"] = "text/plain"
    with pytest.raises(ArtifactMismatchError, match="of 'text/plain'; expected"):
        read_bundle(json.dumps(bundle).encode(), "model.sig")
    for payload in (b"[1]", b"{", b'{"_type": "https://in-toto.io/Statement/v0.1"}'):
        with pytest.raises(ArtifactMismatchError, match="not an in-toto https://in-toto.io/Statement/v1 statement"):
            statement_of(payload, "model.sig")


def test_emitted_loader_without_cryptography_refuses_in_one_line(
        signed_out: tuple[Path, dict[str, Any], Path, Path], tmp_path: Path) -> None:
    out, _, _, pub = signed_out
    loader = str(out / "packer_loader.py")
    hide = (f"import runpy, sys; sys.modules['cryptography'] = None; sys.argv = [{loader!r}, '--selftest', "
            f"'--device', 'cpu']; runpy.run_path({loader!r}, run_name='__main__')")
    env = {"PATH": "/usr/bin:/bin", "PACKER_REQUIRE_SIGNATURE": str(pub), "PACKER_STARTUP_LOG": "off",
           "PACKER_BUNDLE_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("packer_loader: self-test failed: packer_loader needs cryptography: ")
