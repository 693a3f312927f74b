"""Every build-side reader through packer.reading: a FIFO, /dev/zero, deep JSON, a folder named
twice and a key of the wrong kind each end in one line naming the file and the reason, exit 1.

Each case runs ``packer`` in a child with a hang guard (``timeout``): nothing ever writes to a
FIFO, so a blocking open would hang until the guard kills it; /dev/zero read to memory would
end in MemoryError; deep JSON in RecursionError.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from packer.building import build
from packer.recipe import demo_recipe, with_sign_key
from tests.sign_fixtures import make_keypair

DEEP = b"[" * 100_000 + b"]" * 100_000
GUARD = 120  # seconds: far above any case here, far below a hang


def packer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "packer", *args], capture_output=True, text=True,
                          timeout=GUARD, check=False)


def one_error_line(proc: subprocess.CompletedProcess[str], *reasons: str, code: int = 1) -> str:
    lines = [line for line in proc.stderr.strip().splitlines() if line]
    assert proc.returncode == code, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for reason in reasons:
        assert reason in lines[0], lines[0]
    return lines[0]


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/zero")


def _deep(path: Path) -> None:
    path.write_bytes(DEEP)


# what is put where the file belongs, and the words the one line must hold
HOSTILE: list[tuple[str, Callable[[Path], None], tuple[str, ...]]] = [
    ("fifo", _fifo, ("is a FIFO", "not a regular file")),
    ("dev-zero", _dev_zero, ("is a character device", "not a regular file")),
    ("deep-json", _deep, ("nested deeper than",)),
]


def _source(tmp_path: Path, marker: str) -> Path:
    """A source with a layout file: a diffusers pipeline's unet, or a sentence-transformers root."""
    src = tmp_path / "src"
    if marker == "model_index.json":
        (src / "unet").mkdir(parents=True)
        torch.save({"w": torch.ones(2)}, src / "unet" / "diffusion_pytorch_model.bin")
        (src / marker).write_text(json.dumps({"_class_name": "X", "unet": ["diffusers", "UNet2DModel"]}))
    else:
        src.mkdir()
        torch.save({"w": torch.ones(2)}, src / "pytorch_model.bin")
        (src / "config.json").write_text("{}")
        (src / marker).write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type": "x"}]))
    return src


def _recipe(tmp_path: Path, src: Path, layout: str) -> str:
    path = tmp_path / "r.toml"
    path.write_text(f'name = "x"\nversion = "1"\nsource = "{src}"\n[weights]\nlayout = "{layout}"\n')
    return str(path)


LAYOUTS = [("model_index.json", "diffusers"), ("modules.json", "sentence-transformers")]


@pytest.mark.parametrize(("marker", "layout"), LAYOUTS, ids=[m for m, _ in LAYOUTS])
@pytest.mark.parametrize(("kind", "make", "reasons"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_layout_file_is_refused(tmp_path: Path, marker: str, layout: str, kind: str,
                                          make: Callable[[Path], None], reasons: tuple[str, ...]) -> None:
    src = _source(tmp_path, marker)
    make(src / marker)
    proc = packer("build", _recipe(tmp_path, src, layout), "-o", str(tmp_path / "out"))
    one_error_line(proc, marker, *reasons)
    assert not (tmp_path / "out").exists()


DUPLICATES = [
    ("model_index.json", b'{"unet": ["diffusers", "UNet2DModel"], "unet": ["diffusers", "UNet2DModel"]}',
     "appears twice"),
    ("modules.json", json.dumps([{"path": ""}, {"path": "2_Dense"}, {"path": "2_Dense/"}]).encode(), "listed twice"),
    ("modules.json", json.dumps([{"path": ""}, {"path": ""}]).encode(), "listed twice"),
]


@pytest.mark.parametrize(("marker", "text", "reason"), DUPLICATES, ids=["index-key", "module-path", "module-root"])
def test_a_folder_listed_twice_is_refused(tmp_path: Path, marker: str, text: bytes, reason: str) -> None:
    src = _source(tmp_path, marker)
    (src / marker).write_bytes(text)
    if marker == "modules.json":
        (src / "2_Dense").mkdir()
        torch.save({"linear.weight": torch.ones(2, 2)}, src / "2_Dense" / "pytorch_model.bin")
    proc = packer("build", _recipe(tmp_path, src, "auto"), "-o", str(tmp_path / "out"))
    one_error_line(proc, marker, reason)


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A signed demo build and its public key (built once; each test works on a copy)."""
    where = tmp_path_factory.mktemp("signed")
    key, pub = make_keypair(where)
    build(with_sign_key(demo_recipe(), key), where / "out")
    return where / "out", pub


def _copy(signed: tuple[Path, Path], tmp_path: Path) -> Path:
    shutil.copytree(signed[0], tmp_path / "out", symlinks=True)
    return tmp_path / "out"


@pytest.mark.parametrize(("kind", "make", "reasons"), HOSTILE, ids=[h[0] for h in HOSTILE])
@pytest.mark.parametrize("with_key", [False, True], ids=["no-key", "public-key"])
def test_verify_refuses_a_hostile_provenance(tmp_path: Path, signed: tuple[Path, Path], kind: str,
                                             make: Callable[[Path], None], reasons: tuple[str, ...],
                                             with_key: bool) -> None:
    out = _copy(signed, tmp_path)
    make(out / "provenance.sigstore.json")
    key = ["--public-key", str(signed[1])] if with_key else []
    one_error_line(packer("verify", str(out), *key), "provenance.sigstore.json", *reasons)


def test_verify_refuses_a_deep_signed_payload(tmp_path: Path, signed: tuple[Path, Path]) -> None:
    import base64

    out = _copy(signed, tmp_path)
    prov = out / "provenance.sigstore.json"
    bundle = json.loads(prov.read_bytes())
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(DEEP).decode()
    prov.write_text(json.dumps(bundle))
    one_error_line(packer("verify", str(out)), "provenance.sigstore.json: the signed payload", "nested deeper than")


@pytest.mark.parametrize("kind", ["rsa", "ed25519", "secp256k1", "junk"])
def test_verify_names_the_keys_it_accepts(tmp_path: Path, signed: tuple[Path, Path], kind: str) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    keys = {"rsa": lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048),
            "ed25519": ed25519.Ed25519PrivateKey.generate, "secp256k1": lambda: ec.generate_private_key(ec.SECP256K1())}
    pub = tmp_path / f"{kind}.pub"
    if kind == "junk":
        pub.write_bytes(b"-----BEGIN PUBLIC KEY-----\nnot base64\n-----END PUBLIC KEY-----\n")
    else:
        pub.write_bytes(keys[kind]().public_key().public_bytes(serialization.Encoding.PEM,
                                                               serialization.PublicFormat.SubjectPublicKeyInfo))
    line = one_error_line(packer("verify", str(signed[0]), "--public-key", str(pub)), f"{kind}.pub")
    assert ("not a PEM public key" if kind == "junk" else "EC public keys on P-256, P-384 or P-521") in line


@pytest.mark.parametrize("where", ["bundle.tar.zst", "weights/extra", "image/blobs/sha256/extra"])
def test_profile_refuses_an_out_with_a_fifo(tmp_path: Path, signed: tuple[Path, Path], where: str) -> None:
    out = _copy(signed, tmp_path)
    (out / where).parent.mkdir(exist_ok=True)  # weights/: the weight files lie in their layer blobs
    _fifo(out / where)
    one_error_line(packer("profile", str(out)), where, "is a FIFO")


@pytest.mark.parametrize(("kind", "make", "reasons"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_push_refuses_a_hostile_index(tmp_path: Path, signed: tuple[Path, Path], kind: str,
                                      make: Callable[[Path], None], reasons: tuple[str, ...]) -> None:
    out = _copy(signed, tmp_path)
    make(out / "image" / "index.json")
    # verify (first) proves every listed name inside OUT: a link to /dev/zero leads outside
    first = ("leads outside",) if kind == "dev-zero" else reasons
    one_error_line(packer("push", str(out), "127.0.0.1:1/x:y"), "index.json", *first)
    from packer.errors import ImageError
    from packer.oci.push import push

    with pytest.raises(ImageError, match="|".join(reasons)):  # the copier alone refuses it too
        push(out, "127.0.0.1:1/x:y")


@pytest.mark.parametrize("name", ["../canary", "/etc/hostname", "weights/../../canary", "a\\\\b", "link-out"])
def test_verify_opens_no_name_outside_out(tmp_path: Path, signed: tuple[Path, Path], name: str) -> None:
    from packer.util.fsutil import canonical_json

    out = _copy(signed, tmp_path)
    (tmp_path / "canary").write_bytes(b"canary")
    if name == "link-out":
        (out / name).symlink_to(tmp_path / "canary")
    path = out / "manifest.json"
    manifest = json.loads(path.read_bytes())
    manifest["files"][name] = {"size": 6, "sha256": "0" * 64}
    path.write_bytes(canonical_json(manifest))
    line = one_error_line(packer("verify", str(out)), "manifest.json")
    assert "not a relative file name" in line or "leads outside" in line
