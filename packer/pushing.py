"""``packer push``: OUT checked as ``packer verify`` checks it, then copied to a registry.

A build is pushed only as built: every file and blob against the manifest first
(:func:`packer.verifying.verify`), then :func:`packer.oci.push.push` copies the image, its
ModelPack view and its provenance referrer. The REF is checked before either.
"""

from __future__ import annotations

from pathlib import Path

from packer.oci.push import push as copy_image
from packer.oci.registry_ref import check_ref
from packer.verifying import verify


def push(out_dir: Path, ref: str, *, tls_verify: bool = True, timeout: float = 3600) -> dict[str, str]:
    """Verify ``out_dir``, then push its image to ``ref`` (see :func:`packer.oci.push.push`).

    Returns:
        ``{reference pushed: manifest digest}``, the image first.

    Raises:
        UsageError: ``ref`` is not a registry reference (exit code 2).
        VerifyError: ``out_dir`` does not match its manifest; nothing is copied.
        ImageError: see :func:`packer.oci.push.push`.
    """
    check_ref(ref)
    verify(Path(out_dir))
    return copy_image(out_dir, ref, tls_verify=tls_verify, timeout=timeout)
