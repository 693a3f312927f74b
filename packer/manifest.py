"""manifest.json's schema: what was built from what, every file's size and sha256.

The manifest has two layers. The *artifact manifest* describes the weights, the bundle and the
loader; its canonical bytes are also stored inside the OCI image (the image cannot list
itself). The final ``OUT/manifest.json`` adds the ``image`` section and the ``image_files``
written by the image stage. Timings never enter it: they go to ``build-timings.json``.
:mod:`packer.verifying` proves an OUT still matches its manifest.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

from packer.errors import VerifyError
from packer.place import held_place
from packer.reading import MANIFEST, member, parse_json, read_bytes
from packer.util.formats import MANIFEST_NAME
from packer.util.fsutil import FileEntry
from packer.version import __version__

SCHEMA_VERSION = 2  # 2: a files entry may be held in a layer blob (blob, offset)
TIMINGS = "build-timings.json"  # outside what is hashed, so two builds can be identical



def tool_versions() -> dict[str, str | None]:
    """Versions of the tools that shape the output, read without importing them."""

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "torch": version("torch"),
            "safetensors": version("safetensors"), "zstandard": version("zstandard")}


def files_map(entries: Iterable[FileEntry]) -> dict[str, dict[str, Any]]:
    """``{path: {size, sha256}}`` sorted by path; duplicate paths are a bug."""
    out: dict[str, dict[str, Any]] = {}
    for e in sorted(entries, key=lambda e: e.path):
        if e.path in out:
            raise ValueError(f"two stages wrote {e.path}")
        out[e.path] = e.as_json()
    return out


def artifact_manifest(*, recipe: dict[str, Any], source: dict[str, Any], inputs: Iterable[FileEntry],
                      files: Iterable[FileEntry], sections: dict[str, Any]) -> dict[str, Any]:
    """Assemble the artifact manifest (everything but the image)."""
    return {
        "schema": SCHEMA_VERSION,
        "packer_version": __version__,
        "recipe": recipe,
        "source": {**source, "files": files_map(inputs)},
        "files": files_map(files),
        "tools": tool_versions(),
        **sections,
    }


def load_manifest(out: Path) -> dict[str, Any]:
    """Read ``OUT/manifest.json``.

    Raises:
        VerifyError: missing, unreadable or not a packer manifest.
    """
    return read_manifest(out)[1]


def read_manifest(out: Path) -> tuple[bytes, dict[str, Any]]:
    """``(bytes, parsed)`` of ``OUT/manifest.json`` (regular, bounded, nesting within bounds).

    Raises:
        VerifyError: missing, unreadable or not a packer manifest.
    """
    path = out / MANIFEST_NAME
    if not os.path.lexists(path):
        raise VerifyError(f"{path}: missing; is {out} a packer build output?")
    raw = read_bytes(path, MANIFEST, error=VerifyError, where=f"{path}: unreadable")
    data = parse_json(raw, MANIFEST, where=f"{path}: unreadable", error=VerifyError)
    if not isinstance(data, dict) or data.get("schema") != SCHEMA_VERSION or not isinstance(data.get("files"), dict):
        raise VerifyError(f"{path}: not a packer manifest of schema {SCHEMA_VERSION}")
    for key in ("files", "image_files"):  # every record is read as {size, sha256} from here on
        table = data.get(key) or {}
        bad = [rel for rel, e in table.items() if not _is_record(e)] if isinstance(table, dict) else [key]
        if bad:
            raise VerifyError(f"{path}: {key} entry {bad[0]!r} is not a record of size and sha256")
    return raw, data


def _is_record(entry: Any) -> bool:
    """A file's record: an integer ``size`` and a 64-hex-digit ``sha256`` (other keys allowed)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("size"), int):
        return False
    digest = entry.get("sha256")
    return isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)


def held_in_blob(path: Path, *, levels: int = 4) -> tuple[Path, int, int] | None:
    """Where a build output's weight file lies when the build keeps it in its layer blob.

    ``path`` names the file as the manifest lists it (``OUT/weights/model.safetensors``), which
    does not exist on disk in a default build: the file's one copy is the ``size`` bytes at
    ``offset`` of ``OUT/image/blobs/sha256/<digest>``. The nearest of ``path``'s ``levels``
    parent directories holding a ``manifest.json`` is taken as OUT.

    Returns:
        ``(blob, offset, size)``, or None: no packer build output above ``path`` (a
        ``manifest.json`` that is not packer's counts as none), or its manifest does not place
        ``path`` in a blob.

    Raises:
        VerifyError: the manifest's entry for ``path`` is malformed
            (:func:`packer.place.held_place`, the build's view), or its blob leads outside OUT.
    """
    path = Path(path).absolute()
    for out in list(path.parents)[:levels]:
        if not (out / MANIFEST_NAME).is_file():
            continue
        try:
            _, manifest = read_manifest(out)
        except VerifyError:  # another tool's manifest.json, or none we can read: not a build output
            return None
        rel, where = path.relative_to(out).as_posix(), out / MANIFEST_NAME
        if rel not in manifest["files"]:  # nothing of this build's (a path with "..": never one of its names)
            return None
        place = held_place(out, manifest, rel, where=where)  # the view's answer, as the loader's
        if place is None:
            return None
        member(out, place.blob, where=where, error=VerifyError)  # no link in OUT leads it outside
        return place.path(out)
    return None
