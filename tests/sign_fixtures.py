"""Keys, the real ``model_signing`` command, and a plain model directory, for the signing tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

MODEL_SIGNING = Path(sys.executable).with_name("model_signing")


def make_keypair(where: Path, name: str = "signing", *, curve: Any = None,
                 password: bytes | None = None) -> tuple[Path, Path]:
    """A fresh EC key pair (P-256 unless ``curve``) as ``where/NAME.pem`` and ``where/NAME.pub``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(curve or ec.SECP256R1())
    where.mkdir(parents=True, exist_ok=True)
    crypt = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    (where / f"{name}.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8, crypt))
    (where / f"{name}.pub").write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return where / f"{name}.pem", where / f"{name}.pub"


def model_signing_verify(model: Path, public_key: Path, *, signature: Path | None = None,
                         allow_symlinks: bool = False) -> subprocess.CompletedProcess[str]:
    """``model_signing verify key MODEL --signature MODEL/model.sig --public_key PUB`` (the real command)."""
    cmd = [str(MODEL_SIGNING), "verify", "key", str(model), "--signature", str(signature or model / "model.sig"),
           "--public_key", str(public_key), *(["--allow_symlinks"] if allow_symlinks else [])]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def plain_model_dir(out: Path, dest: Path) -> Path:
    """The build's model directory as plain files (what the image ships beside the loader):
    the bundle's members, the weight files and index by name, and ``model.sig``."""
    import json

    from packer.bundle import unbundle
    from packer.runtime.signature import model_layout

    manifest = json.loads((out / "manifest.json").read_bytes())
    unbundle(out / "bundle.tar.zst", dest / ".bundle")
    for name, (origin, _) in model_layout(manifest).items():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / origin if origin else dest / ".bundle" / name, dest / name)
    shutil.rmtree(dest / ".bundle")
    shutil.copyfile(out / "model.sig", dest / "model.sig")
    return dest


def loader_model_dir(out: Path, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``python OUT/packer_loader.py --model-dir`` in a fresh process (bundle cache ``cache``)."""
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PACKER_BUNDLE_CACHE": str(cache),
            "PACKER_STARTUP_LOG": "off", **env}
    return subprocess.run([sys.executable, str(out / "packer_loader.py"), "--model-dir"], capture_output=True,
                          text=True, env=full, timeout=300)
