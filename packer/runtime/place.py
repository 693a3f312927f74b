"""Where a build's file's bytes are: the one reading of a manifest ``files`` entry.

A files entry pins a file by ``size`` and ``sha256``. A weight file the build holds in its
image layer blob, as its one copy, also says where: ``blob`` (``image/blobs/sha256/<hex>``,
relative to OUT) and ``offset`` (a page offset in that blob; the tar framing comes before).
:func:`parse_place` is the one rule set for such an entry and :class:`FilePlace` what it
makes, once per file; the build's view (:meth:`~.view.BuildView.place`, which the loader and the
model directory (``dirtree``) ask) and, through :mod:`packer.place`, the build, ``packer verify``
and ``packer inspect`` take the file's place from it and never read ``blob`` or ``offset`` themselves
(tests/test_file_place.py holds them to it).

Standard library only: the runtime ships without the build side, which imports this module.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple, TypeGuard

from .env import ArtifactMismatchError
from .reading import check_rel

BLOBS = "image/blobs/sha256"  # an OCI layout's blobs, relative to OUT: each named by its sha256
PAGE = 4096  # a held file starts at a page of its blob, so it can be mapped in place
MAX_END = 2**53  # offset + size: JSON's exact integers, far above any file
_HEX64 = re.compile(r"[0-9a-f]{64}")


class FilePlace(NamedTuple):  # a NamedTuple: ~0.13 ms to define at import, a frozen dataclass ~0.8 ms
    """One file of a build and where its bytes are, as the manifest's files entry says.

    Attributes:
        rel: the file's path in the manifest (relative to OUT: ``weights/model.safetensors``).
        size, sha256: what the manifest pins (bytes; lowercase hex).
        blob: the layer blob holding the file's one copy (``image/blobs/sha256/<hex>``,
            relative to OUT), or None for a file of its own.
        offset: where the file's bytes start in ``blob`` (a page offset); 0 without one.

    Chunk digests (proof at the size of a read) are not a field of the files entry: they live
    in the build's chunk table (``packer-chunks.json``, :mod:`.chunks`), a file of the model
    directory of its own so that ``model.sig`` signs it (a field here would be pinned by the
    unsigned manifest alone); :class:`~.chunks.FileChunks` is their value per file, read by
    :func:`~.chunks.parse_table` against these entries' size and sha256.
    """

    rel: str
    size: int
    sha256: str
    blob: str | None = None
    offset: int = 0

    @property
    def in_blob(self) -> bool:
        """Whether the file's bytes are inside a layer blob (no file of its own)."""
        return self.blob is not None

    @property
    def blob_digest(self) -> str | None:
        """``sha256:<hex>`` of the blob holding the file, or None."""
        return None if self.blob is None else "sha256:" + self.blob.rpartition("/")[2]

    def path(self, out: str | Path) -> tuple[Path, int, int]:
        """``(file, offset, size)``: the file's bytes under the build directory ``out``."""
        return Path(out) / (self.blob or self.rel), self.offset, self.size

    def as_json(self) -> dict[str, Any]:
        """The manifest's files entry for this file (its path is the key)."""
        where = {"blob": self.blob, "offset": self.offset} if self.blob is not None else {}
        return {"size": self.size, "sha256": self.sha256, **where}


class PlaceError(ValueError):
    """A files entry no reader takes: ``files[<rel>]: <reason>`` (the caller adds the manifest)."""


def blob_rel(hexd: str) -> str:
    """The path, relative to OUT, of the layer blob whose sha256 is ``hexd``."""
    return f"{BLOBS}/{hexd}"


def blob_hex(rel: str) -> str | None:
    """The sha256 of the blob at ``rel`` (relative to OUT) when it is one, else None."""
    folder, _, hexd = rel.rpartition("/")
    return hexd if folder == BLOBS and _HEX64.fullmatch(hexd) else None


def _shown(value: object) -> str:
    text = repr(value)  # control characters escaped
    return text if len(text) <= 80 else text[:80] + "..."


def _count(value: object) -> TypeGuard[int]:
    return type(value) is int and 0 <= value <= MAX_END  # bool is an int subclass: refused


def _reason(rel: object, entry: object) -> str | None:
    """Why ``entry`` is no files entry of ``rel``, or None."""
    try:
        check_rel(rel, "files")  # the runtime's one rule for a name from a document
    except ArtifactMismatchError:
        return "not a plain relative path"
    if not isinstance(entry, dict):
        return f"{_shown(entry)} is not a record of size and sha256"
    size, digest = entry.get("size"), entry.get("sha256")
    if not _count(size):
        return f"size {_shown(size)} is not a non-negative integer"
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        return f"sha256 {_shown(digest)} is not 64 lowercase hex digits"
    if "blob" not in entry:
        return None if "offset" not in entry else "an offset without a blob"
    blob, offset = entry["blob"], entry.get("offset")
    if not isinstance(blob, str) or blob_hex(blob) is None:
        return f"blob {_shown(blob)} is not {BLOBS}/<64 lowercase hex digits>"
    if not _count(offset) or offset % PAGE:
        return f"offset {_shown(offset)} in {blob} is not a page offset (a multiple of {PAGE})"
    if offset + size > MAX_END:
        return f"offset {offset} + size {size} is past {MAX_END} bytes"
    return None


def parse_place(rel: object, entry: object) -> FilePlace:
    """The place of the file ``rel`` that the manifest's files entry ``entry`` gives.

    ``rel`` a plain relative path; ``size`` and (with a blob) ``offset`` integers (never
    booleans or strings) from 0, their sum at most :data:`MAX_END`; ``sha256`` 64 lowercase hex
    digits; ``blob``, when the key is there, exactly ``image/blobs/sha256/<64 lowercase hex>``
    with a page ``offset``; no ``offset`` without a ``blob``.

    Raises:
        PlaceError: ``files[<rel>]: <reason>``, one line.
    """
    reason = _reason(rel, entry)
    if reason is not None or not isinstance(rel, str) or not isinstance(entry, dict):
        raise PlaceError(f"files[{_shown(rel)}]: {reason}")
    if "blob" not in entry:
        return FilePlace(rel, entry["size"], entry["sha256"])
    return FilePlace(rel, entry["size"], entry["sha256"], entry["blob"], entry["offset"])


def place_of(rel: object, entry: object, where: str) -> FilePlace:
    """:func:`parse_place`, refused as the runtime refuses a manifest.

    Raises:
        ArtifactMismatchError: ``<where>: files[<rel>]: <reason>``.
    """
    try:
        return parse_place(rel, entry)
    except PlaceError as e:
        raise ArtifactMismatchError(f"{where}: {e}") from None
