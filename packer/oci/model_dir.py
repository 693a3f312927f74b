"""The bundle's members as plain files of the image's model directory.

The image's prefix is a model directory that engines read with nothing run first, so config,
generation config and tokenizer files must be plain files there, not only members of
``bundle.tar.zst``. They are small (the bundle reader caps them), so they are read once into
memory from the bundle OUT already holds, each checked against the artifact manifest.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from packer.errors import ImageError
from packer.oci.plan import ImagePlan
from packer.runtime import bundle_reader as reader


def read_members(out_dir: Path, plan: ImagePlan) -> dict[str, bytes]:
    """The bytes of every bundle member the plan places, by image path.

    Args:
        out_dir: the output directory holding the bundle.
        plan: the image plan (files with ``member`` set come from the bundle).

    Returns:
        ``{image path: bytes}``, each equal to the size and sha256 the plan carries.

    Raises:
        ImageError: the bundle does not read back, or a member differs from the manifest.
    """
    wanted = [f for layer in plan.layers for f in layer.files if f.member is not None]
    if not wanted:
        return {}
    path = out_dir / wanted[0].rel_path
    try:
        bundle = reader.Bundle.open(path)
        got = {f.dest: bundle.read(f.member or "") for f in wanted}
    except (reader.BundleFormatError, OSError, KeyError) as e:
        raise ImageError(f"{path}: cannot read the model files from the bundle: {e}") from e
    for f in wanted:
        data = got[f.dest]
        if len(data) != f.size or hashlib.sha256(data).hexdigest() != f.sha256:
            raise ImageError(f"{path}: member {f.member!r} differs from the artifact manifest")
    return got
