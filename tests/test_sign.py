"""Signed builds end to end: model.sig checked by the real ``model_signing verify key`` on the
plain model directory and on ``model_dir()``, ``packer verify --public-key``, and each kind of
tampering (a flipped weight byte, a changed config, an added file, a wrong key) refused by both."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from packer.building import build
from packer.errors import RecipeError, SignError, VerifyError
from packer.recipe import demo_recipe, recipe_from_dict, with_sign_key
from packer.runtime.signature import model_layout, open_signed
from packer.util.fsutil import canonical_json
from packer.verifying import verify
from tests.built import open_build, weight_location
from tests.oci_validate import REF, require_tool, run, validate_layout, validate_referrer
from tests.sign_fixtures import image_model_dir, loader_model_dir, make_keypair, model_signing_verify
from tests.test_build import tree


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    where = tmp_path_factory.mktemp("keys")
    key, pub = make_keypair(where)
    _, other = make_keypair(where, "other")
    return {"key": key, "pub": pub, "other": other}


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory, keys: dict[str, Path]) -> Path:
    out = tmp_path_factory.mktemp("signed") / "out"
    build(with_sign_key(demo_recipe(), keys["key"]), out)
    return out


def _copy(out: Path, dest: Path) -> Path:
    subprocess.run(["cp", "-a", str(out), str(dest)], check=True)
    return dest


def _hash_mismatch(stderr: str, name: str) -> bool:
    """Whether model_signing's one line reports ``name``'s digest as changed (it escapes the quotes)."""
    return re.search(r"Verification failed with error: Signature mismatch: .*Hash mismatch for \\?'"
                     + re.escape(name) + r"\\?'", stderr) is not None


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_model_signing_verifies_the_image_model_directory_and_model_dir(signed: Path, keys: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    plain = image_model_dir(signed, tmp_path / "models")
    assert {"bundle.tar.zst", "manifest.json", "packer_loader.py", "model.sig"} <= {p.name for p in plain.iterdir()}
    r = model_signing_verify(plain, keys["pub"])  # packer's own files there are in the signature's ignore_paths
    assert (r.returncode, r.stdout.strip()) == (0, "Verification succeeded"), r.stderr
    made = loader_model_dir(signed, tmp_path / "cache")
    assert made.returncode == 0, made.stderr
    linked = Path(made.stdout.strip())
    assert (linked / "model.sig").resolve() == signed / "model.sig"
    r = model_signing_verify(linked, keys["pub"], allow_symlinks=True)
    assert (r.returncode, r.stdout.strip()) == (0, "Verification succeeded"), r.stderr
    assert verify(signed, public_key=keys["pub"])["signature_verified"]
    manifest = json.loads((signed / "manifest.json").read_bytes())
    on_disk = {p.relative_to(plain).as_posix() for p in plain.rglob("*") if p.is_file()}
    assert set(model_layout(manifest)) < on_disk and manifest["signature"]["files"] == len(model_layout(manifest))
    assert "sign" not in manifest["recipe"]  # the key's path is not what was built


@pytest.mark.slow
def test_a_flipped_weight_byte_fails_everywhere(signed: Path, keys: dict[str, Path], tmp_path: Path) -> None:
    plain = image_model_dir(signed, tmp_path / "models")
    _flip(plain / "model.safetensors", 20_000)
    r = model_signing_verify(plain, keys["pub"])
    print(r.stderr)
    assert r.returncode == 1 and _hash_mismatch(r.stderr, "model.safetensors")
    copy = _copy(signed, tmp_path / "copy")
    held, offset, _ = weight_location(copy, "weights/model.safetensors")  # its one copy: in its layer blob
    _flip(held, offset + 20_000)
    # and the chunk table names the chunk that holds the byte (cut at the tensors and the ranks' splits)
    fc = open_build(signed).chunk_table()["weights/model.safetensors"]
    chunk = fc.holding(20_000)
    lo, hi = fc.bounds(chunk)
    assert lo <= 20_000 < hi
    named = (r"weights/model.safetensors: sha256 \w+… differs.*; .*\(weights/model.safetensors at offset \d+\): "
             rf"chunk {chunk} \(bytes \[{lo}, {hi}\) of")
    with pytest.raises(VerifyError, match=named) as e:
        verify(copy, public_key=keys["pub"])
    print(e.value)
    linked = Path(loader_model_dir(copy, tmp_path / "cache").stdout.strip())
    r = model_signing_verify(linked, keys["pub"], allow_symlinks=True)
    assert r.returncode == 1 and _hash_mismatch(r.stderr, "model.safetensors")
    env = {"PACKER_REQUIRE_SIGNATURE": str(keys["pub"]), "PACKER_BUNDLE_CACHE": str(tmp_path / "c2"),
           "PACKER_STARTUP_LOG": "off", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, str(copy / "packer_loader.py"), "--selftest", "--device", "cpu"],
                       capture_output=True, text=True, env=env, timeout=300)
    print(r.stderr)  # the signature pins digests, so the loader checks every chunk of what it loads
    assert r.returncode == 1 and r.stderr.splitlines()[-1].startswith(
        f"packer_loader: self-test failed: {copy.resolve() / 'weights' / 'model.safetensors'}: chunk {chunk} "
        f"(bytes [{lo}, {hi}) ")


def _attacker_build(tmp_path: Path, signed: Path, attacker_key: Path, edit: str) -> Path:
    """A self-consistent build of the demo with another config.json, signed by another key:
    what a forger who lacks the key can make."""
    from packer.demo import write_demo

    src = tmp_path / "src"
    src.mkdir()
    write_demo(src)
    config = json.loads((src / "config.json").read_text())
    config[edit] = 1
    (src / "config.json").write_text(json.dumps(config))
    recipe = recipe_from_dict({"name": "packer-demo", "version": "0.1.0", "source": str(src)})
    out = tmp_path / "forged"
    build(with_sign_key(recipe, attacker_key), out)
    return out


@pytest.mark.slow
def test_a_changed_config_file_fails_everywhere(signed: Path, keys: dict[str, Path], tmp_path: Path) -> None:
    plain = image_model_dir(signed, tmp_path / "models")
    (plain / "config.json").write_text((plain / "config.json").read_text().replace("}", ', "x": 1}', 1))
    r = model_signing_verify(plain, keys["pub"])
    assert r.returncode == 1 and _hash_mismatch(r.stderr, "config.json")
    attacker, _ = make_keypair(tmp_path, "attacker")
    forged = _attacker_build(tmp_path, signed, attacker, "forged")
    verify(forged)  # self-consistent: without the key nothing tells it from the real build
    with pytest.raises(VerifyError, match=r"model.sig: model_signing refuses it with .*signing.pub: Key mismatch"):
        verify(forged, public_key=keys["pub"])
    shutil.copyfile(signed / "model.sig", forged / "model.sig")  # the genuine signature beside forged files
    with pytest.raises(VerifyError, match=r"forged/model.sig: sha256 \w+… differs from the manifest's"):
        verify(forged, public_key=keys["pub"])
    from packer.sign.check import check_signatures

    with pytest.raises(VerifyError, match=r"model.sig: signs config.json with sha256 \w+\.\.\., the manifest pins"):
        check_signatures(forged, json.loads((forged / "manifest.json").read_bytes()))
    linked = Path(loader_model_dir(forged, tmp_path / "cache").stdout.strip())
    r = model_signing_verify(linked, keys["pub"], allow_symlinks=True)
    assert r.returncode == 1 and _hash_mismatch(r.stderr, "config.json")
    r = loader_model_dir(forged, tmp_path / "cache2", PACKER_REQUIRE_SIGNATURE=str(keys["pub"]))
    print(r.stderr)
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "model.sig: signs config.json with sha256" in r.stderr and "this loader's manifest pins" in r.stderr


def test_an_added_file_fails_everywhere(signed: Path, keys: dict[str, Path], tmp_path: Path) -> None:
    plain = image_model_dir(signed, tmp_path / "models")
    (plain / "extra.py").write_text("print('hi')\n")
    r = model_signing_verify(plain, keys["pub"])
    print(r.stderr)
    assert r.returncode == 1 and "Extra files found in model 'models': extra.py" in r.stderr
    copy = _copy(signed, tmp_path / "copy")
    (copy / "extra.py").write_text("print('hi')\n")
    with pytest.raises(VerifyError, match=r"extra.py: not listed in the manifest"):
        verify(copy, public_key=keys["pub"])


def test_a_wrong_key_fails_everywhere(signed: Path, keys: dict[str, Path], tmp_path: Path) -> None:
    plain = image_model_dir(signed, tmp_path / "models")
    r = model_signing_verify(plain, keys["other"])
    print(r.stderr)
    assert r.returncode == 1 and "Key mismatch" in r.stderr
    with pytest.raises(VerifyError, match=r"model.sig: model_signing refuses it with .*other.pub: Key mismatch") as e:
        verify(signed, public_key=keys["other"])
    print(e.value)
    r = loader_model_dir(signed, tmp_path / "cache", PACKER_REQUIRE_SIGNATURE=str(keys["other"]))
    print(r.stderr)
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "model.sig: signed by another key than" in r.stderr and "other.pub" in r.stderr


def _edit_payload(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Change the statement inside a bundle, keeping its signature and key hint."""
    bundle = json.loads(path.read_bytes())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    edit(statement)
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    path.write_text(json.dumps(bundle))


def test_a_statement_changed_after_signing_does_not_verify(signed: Path, keys: dict[str, Path],
                                                           tmp_path: Path) -> None:
    plain = image_model_dir(signed, tmp_path / "models")
    _edit_payload(plain / "model.sig", lambda s: s["predicate"]["serialization"].update(ignore_paths=["x"]))
    r = model_signing_verify(plain, keys["pub"])
    assert r.returncode == 1 and "Verification failed with error" in r.stderr
    copy = _copy(signed, tmp_path / "copy")
    shutil.copyfile(plain / "model.sig", copy / "model.sig")
    from packer.sign.check import check_signatures

    manifest = json.loads((copy / "manifest.json").read_bytes())
    with pytest.raises(VerifyError, match=r"model.sig: the signature does not verify with .*signing.pub"):
        check_signatures(copy, manifest, public_key=keys["pub"])  # verify() would blame the manifest's digest first
    r = loader_model_dir(copy, tmp_path / "cache", PACKER_REQUIRE_SIGNATURE=str(keys["pub"]))
    assert r.returncode == 1 and "model.sig: the signature does not verify with" in r.stderr
    shutil.copyfile(signed / "model.sig", copy / "model.sig")
    _edit_payload(copy / "provenance.sigstore.json", lambda s: s["subject"][0]["digest"].update(sha256="0" * 64))
    with pytest.raises(VerifyError, match=r"provenance.sigstore.json: names Dockerfile with sha256 0000"):
        verify(copy)
    with pytest.raises(VerifyError, match=r"provenance.sigstore.json: the signature does not verify with"):
        verify(copy, public_key=keys["pub"])


def test_provenance_subjects_are_the_manifests_and_the_images_digests(signed: Path, keys: dict[str, Path]) -> None:
    raw = (signed / "manifest.json").read_bytes()
    manifest = json.loads(raw)
    statement = open_signed((signed / "provenance.sigstore.json").read_bytes(), keys["pub"].read_bytes(), "prov")
    assert statement["predicateType"] == "https://slsa.dev/provenance/v1"
    subjects = {s["name"]: s["digest"]["sha256"] for s in statement["subject"]}
    want = {rel: e["sha256"] for rel, e in {**manifest["files"], **manifest["image_files"]}.items()
            if rel != "image/index.json"}  # it lists the provenance's own referrer
    want["manifest.json"] = hashlib.sha256(raw).hexdigest()
    want[manifest["image"]["tag"]] = manifest["image"]["manifest_digest"].removeprefix("sha256:")
    assert subjects == want and len(statement["subject"]) == len(want)
    assert "model.sig" in subjects
    index = json.loads((signed / "image" / "index.json").read_bytes())
    assert "sha256:" + subjects["packer-demo:0.1.0"] == index["manifests"][0]["digest"]
    build_def = statement["predicate"]["buildDefinition"]
    deps = {d["name"]: d for d in build_def["resolvedDependencies"]}
    assert deps["recipe"]["digest"]["sha256"] == hashlib.sha256(canonical_json(manifest["recipe"])).hexdigest()
    for rel, entry in manifest["source"]["files"].items():
        assert deps[rel]["digest"] == {"sha256": entry["sha256"]}
    assert deps["source"]["uri"] == "demo" and build_def["externalParameters"]["recipe"] == manifest["recipe"]
    versions = statement["predicate"]["runDetails"]["builder"]["version"]
    assert versions["model-packer"] == manifest["packer_version"] and versions["torch"] == manifest["tools"]["torch"]


def test_the_provenance_is_a_referrer_of_the_image_manifest(signed: Path, tmp_path: Path) -> None:
    layout = validate_layout(signed / "image")  # packer's conventions, the image by its tag
    index = layout.index["manifests"]
    image = next(d for d in index if d.get("annotations", {}).get(REF) == "packer-demo:0.1.0")
    desc, referrer, data = validate_referrer(signed / "image", image)
    assert data == (signed / "provenance.sigstore.json").read_bytes() and desc == index[-1] and len(index) == 3
    assert referrer["annotations"] == {"dev.sigstore.bundle.content": "dsse-envelope",
                                       "dev.sigstore.bundle.predicateType": "https://slsa.dev/provenance/v1",
                                       "org.opencontainers.image.created": layout.manifest["annotations"][
                                           "org.opencontainers.image.created"]}
    manifest = json.loads((signed / "manifest.json").read_bytes())
    pinned = {**layout.index, "manifests": index[:-1]}  # the manifest pins the index the image stage wrote
    assert "sha256:" + hashlib.sha256(canonical_json(pinned)).hexdigest() == manifest["image"]["index_digest"]
    skopeo = require_tool("skopeo")  # consumers that pick the image by tag see the same image
    raw = run([skopeo, "inspect", "--raw", f"oci:{signed / 'image'}:packer-demo:0.1.0"]).stdout.encode()
    assert "sha256:" + hashlib.sha256(raw).hexdigest() == image["digest"]
    umoci = require_tool("umoci")
    listed = run([umoci, "ls", "--layout", str(signed / "image")]).stdout.split()
    assert sorted(listed) == ["packer-demo:0.1.0", "packer-demo:0.1.0-modelpack"]
    copy = _copy(signed, tmp_path / "copy")  # a referrer of other bytes than OUT's provenance
    blob = copy / "image" / "blobs" / "sha256" / referrer["layers"][0]["digest"][7:]
    blob.chmod(0o644)
    _flip(blob, 10)
    with pytest.raises(VerifyError, match=r"blobs/sha256/[0-9a-f]{64}: missing or not the provenance referrer's blob"):
        verify(copy)
    copy = _copy(signed, tmp_path / "dropped")
    (copy / "image" / "index.json").write_bytes(canonical_json(pinned))
    with pytest.raises(VerifyError, match=r"index.json: does not end with the provenance referrer"):
        verify(copy)


def test_signed_builds_are_byte_identical(signed: Path, keys: dict[str, Path], tmp_path: Path) -> None:
    build(with_sign_key(demo_recipe(), keys["key"]), tmp_path / "again")
    assert tree(tmp_path / "again") == tree(signed)  # deterministic ECDSA: the same model.sig too


def test_model_sig_is_made_from_digests_alone(keys: dict[str, Path], tmp_path: Path) -> None:
    from packer.sign.keys import load_signing_key
    from packer.sign.model_sig import write_model_signature
    from tests.loader_fixtures import make_out

    manifest = make_out(tmp_path / "built")
    for f in (tmp_path / "built" / "weights").iterdir():
        f.unlink()  # nothing to read: the statement comes from the manifest's digests
    stage = write_model_signature(tmp_path, manifest, load_signing_key(keys["key"]), name="tiny")
    statement = open_signed((tmp_path / "model.sig").read_bytes(), keys["pub"].read_bytes(), "model.sig")
    resources = {r["name"]: r["digest"] for r in statement["predicate"]["resources"]}
    assert resources == {
        "config.json": manifest["bundle"]["members"][0]["sha256"],
        "tok/vocab.txt": manifest["bundle"]["members"][1]["sha256"],
        **{Path(rel).name: manifest["files"][rel]["sha256"]
           for rel in [*manifest["weights"]["files"], manifest["weights"]["index"]]}}
    assert stage.section["files"] == 5 and stage.files[0].path == "model.sig"


def test_bad_keys_fail_before_any_stage(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    with pytest.raises(SignError, match=r"missing.pem: cannot read the signing key \(No such file"):
        build(with_sign_key(demo_recipe(), tmp_path / "missing.pem"), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (tmp_path / "rsa.pem").write_bytes(rsa_key.private_bytes(serialization.Encoding.PEM,
                                                             serialization.PrivateFormat.PKCS8,
                                                             serialization.NoEncryption()))
    with pytest.raises(SignError, match=r"rsa.pem: a RSAPrivateKey key; model_signing verifies EC keys on P-256"):
        build(with_sign_key(demo_recipe(), tmp_path / "rsa.pem"), tmp_path / "out")
    (tmp_path / "junk.pem").write_text("not a key\n")
    with pytest.raises(SignError, match=r"junk.pem: not a usable PEM private key"):
        build(with_sign_key(demo_recipe(), tmp_path / "junk.pem"), tmp_path / "out")
    _, _ = make_keypair(tmp_path, "k1", curve=ec.SECP256K1())
    with pytest.raises(SignError, match=r"k1.pem: a secp256k1 key"):
        build(with_sign_key(demo_recipe(), tmp_path / "k1.pem"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_encrypted_key_takes_its_password_from_the_environment(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from packer.sign.keys import load_signing_key

    key, _ = make_keypair(tmp_path, "locked", password=b"s3cret")
    with pytest.raises(SignError, match=r"locked.pem: .*password.*PACKER_SIGN_KEY_PASSWORD"):
        load_signing_key(key)
    monkeypatch.setenv("PACKER_SIGN_KEY_PASSWORD", "wrong")
    with pytest.raises(SignError, match=r"locked.pem: not a usable PEM private key"):
        load_signing_key(key)
    monkeypatch.setenv("PACKER_SIGN_KEY_PASSWORD", "s3cret")
    assert len(load_signing_key(key).hint) == 64


def test_recipe_sign_section(tmp_path: Path) -> None:
    raw = {"name": "m", "version": "1", "source": "demo", "sign": {"key": "keys/k.pem"}}
    recipe = recipe_from_dict(raw, base_dir=tmp_path)
    assert recipe.sign_key() == tmp_path / "keys" / "k.pem" and "sign" not in recipe.normalised()
    assert with_sign_key(recipe, "/abs/k.pem").sign_key() == Path("/abs/k.pem")
    assert recipe_from_dict({**raw, "sign": {}}).sign_key() is None
    with pytest.raises(RecipeError, match=r"^sign.keyfile: unknown key \(allowed: key\); did you mean 'key'\?$"):
        recipe_from_dict({**raw, "sign": {"keyfile": "k.pem"}})
    with pytest.raises(RecipeError, match=r"^sign.key: expected a non-empty string, got 3$"):
        recipe_from_dict({**raw, "sign": {"key": 3}})


def test_verify_with_a_key_refuses_an_unsigned_build(tmp_path: Path, keys: dict[str, Path]) -> None:
    build(demo_recipe(), tmp_path / "plain")
    with pytest.raises(VerifyError, match=r"manifest.json: the build is not signed \(built without --sign-key\)"):
        verify(tmp_path / "plain", public_key=keys["pub"])


@pytest.mark.slow
def test_cli_signs_and_verifies_and_names_the_missing_extra(tmp_path: Path, keys: dict[str, Path]) -> None:
    packer = [sys.executable, "-m", "packer"]
    r = subprocess.run([*packer, "build", "-o", str(tmp_path / "out"), "--sign-key", str(keys["key"])],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    # the stage table adds up: loading the key (the signing libraries' import) is a stage too
    rows = dict(line.split()[:2] for line in r.stdout.splitlines()
                if len(line.split()) >= 2 and line.split()[1].replace(".", "").isdigit())
    total = float(rows.pop("total"))
    assert "key" in rows and sum(map(float, rows.values())) >= 0.9 * total - 0.2, r.stdout
    r = subprocess.run([*packer, "verify", str(tmp_path / "out"), "--public-key", str(keys["pub"])],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "model.sig and the provenance verify with" in r.stdout, r.stderr
    r = subprocess.run([*packer, "verify", str(tmp_path / "out"), "--public-key", str(keys["other"])],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Key mismatch" in r.stderr
    hide = "import sys; sys.modules['model_signing'] = None; from packer.__main__ import run; run()"
    r = subprocess.run([sys.executable, "-c", hide, "build", "-o", str(tmp_path / "b"), "--sign-key", str(keys["key"])],
                       capture_output=True, text=True, timeout=300)
    print(r.stderr)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and not (tmp_path / "b").exists()
    assert r.stderr.startswith("error: signing needs the sign extra: ")
    assert r.stderr.rstrip().endswith("(pip install 'model-packer[sign]')")
