"""Reproducible OCI image layers, image layout, base append and Dockerfile.

Public entry points: :func:`build_image` (the build stage), :func:`plan_image` (for
``--dry-run``), :func:`verify_image` (for ``packer verify``) and :func:`push`.
"""

from packer.oci.image import build_image, plan_image
from packer.oci.push import push
from packer.oci.verify import verify_image

__all__ = ["build_image", "plan_image", "push", "verify_image"]
