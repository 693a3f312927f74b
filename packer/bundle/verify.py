"""``packer verify`` for the bundle: the archive reads back safely and matches the manifest."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from packer.errors import VerifyError
from packer.runtime import bundle_reader as reader


def verify_bundle(out: Path, section: dict[str, Any]) -> None:
    """``packer verify``: the archive reads back safely and every member matches the manifest.

    Args:
        out: the build output directory.
        section: the manifest's ``bundle`` section.

    Raises:
        VerifyError: naming the archive and the first member that differs.
    """
    path = Path(out) / section["file"]
    try:
        bundle = reader.Bundle.open(path)
    except (reader.BundleFormatError, OSError) as e:
        raise VerifyError(f"{section['file']}: does not read back as a bundle: {e}") from e
    if bundle.sha256 != section["sha256"]:
        raise VerifyError(f"{section['file']}: sha256 {bundle.sha256} != manifest {section['sha256']}")
    expected = {m["name"]: m for m in section["members"]}
    if bundle.names() != sorted(expected):
        missing = sorted(set(expected) ^ set(bundle.names()))
        raise VerifyError(f"{section['file']}: members differ from the manifest (first: {missing[0]!r})")
    for name in bundle.names():
        data = bundle.read(name)
        if len(data) != expected[name]["size"] or hashlib.sha256(data).hexdigest() != expected[name]["sha256"]:
            raise VerifyError(f"{section['file']}: member {name!r} does not match the manifest")
