"""``packer push``: copy ``OUT/image`` to a registry with skopeo (no daemon needed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from packer.errors import ImageError
from packer.oci.base import REF_NAME


def image_tag(out_dir: Path) -> str:
    """The tag (``org.opencontainers.image.ref.name``) of the one image in ``OUT/image``.

    Raises:
        ImageError: no readable layout, or it does not hold exactly one tagged image.
    """
    index_path = Path(out_dir) / "image" / "index.json"
    try:
        manifests = json.loads(index_path.read_bytes()).get("manifests") or []
    except (OSError, ValueError) as e:
        raise ImageError(f"{index_path}: cannot read the image index: {e}") from e
    tags = [(m.get("annotations") or {}).get(REF_NAME) for m in manifests]
    if len(tags) != 1 or not tags[0]:
        raise ImageError(f"{index_path}: expected one tagged image, found {len(tags)}")
    return str(tags[0])


def push(out_dir: Path, ref: str, *, tls_verify: bool = True, timeout: float = 3600) -> str:
    """Copy ``oci:OUT/image:TAG`` to ``docker://REF``.

    The manifest is pushed unchanged (``--preserve-digests``), so the registry's digest is
    the local manifest digest.

    Args:
        out_dir: the packer output directory.
        ref: registry reference, ``host[:port]/repo[:tag]`` (a ``docker://`` prefix is optional).
        tls_verify: verify the registry's TLS certificate (False for a local test registry).
        timeout: seconds before the copy is abandoned.

    Returns:
        The pushed manifest digest, ``sha256:…``.

    Raises:
        ImageError: skopeo is not installed, or the copy failed (with skopeo's message).
    """
    src = f"oci:{Path(out_dir).resolve() / 'image'}:{image_tag(out_dir)}"  # the input first
    skopeo = shutil.which("skopeo")
    if skopeo is None:
        raise ImageError("push: skopeo is not installed; install it (apt-get install skopeo) "
                         "or push OUT/image with another OCI tool")
    dest = ref if ref.startswith("docker://") else f"docker://{ref}"
    with tempfile.TemporaryDirectory(prefix="packer-push-") as tmp:
        digest_file = Path(tmp) / "digest"
        cmd = [skopeo, "copy", "--quiet", "--preserve-digests", "--digestfile", str(digest_file),
               f"--dest-tls-verify={'true' if tls_verify else 'false'}", src, dest]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as e:
            raise ImageError(f"push to {dest}: skopeo timed out after {timeout:.0f} s") from e
        if proc.returncode != 0:
            msg = (proc.stderr.strip().splitlines() or ["no message"])[-1]
            raise ImageError(f"push to {dest}: skopeo failed: {msg}")
        return digest_file.read_text().strip()
