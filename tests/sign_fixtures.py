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


def image_model_dir(out: Path, dest: Path, ref: str | None = None) -> Path:
    """The image's model directory (``/models``) as a node mounts it: ``umoci unpack`` of the
    build's image layout (its first tag, or ``ref``), the directory moved to ``dest``."""
    import json

    from tests.oci_validate import require_tool, run

    umoci = require_tool("umoci")
    manifest = json.loads((out / "manifest.json").read_bytes())
    index = json.loads((out / "image" / "index.json").read_bytes())
    ref = ref or index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"]
    bundle = dest.parent / f".{dest.name}.bundle"
    run([umoci, "unpack", *([] if os.geteuid() == 0 else ["--rootless"]), "--image", f"{out / 'image'}:{ref}",
         str(bundle)])
    shutil.move(bundle / "rootfs" / manifest["image"]["prefix"].strip("/"), dest)
    shutil.rmtree(bundle)
    return dest


def loader_model_dir(out: Path, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``python OUT/packer_loader.py --model-dir`` in a fresh process (bundle cache ``cache``)."""
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PACKER_BUNDLE_CACHE": str(cache),
            "PACKER_STARTUP_LOG": "off", **env}
    return subprocess.run([sys.executable, str(out / "packer_loader.py"), "--model-dir"], capture_output=True,
                          text=True, env=full, timeout=300)
