"""Chunk digests: proof at the size of a read.

A build writes ``weights/packer-chunks.json`` (:data:`CHUNKS_REL`; in the
model directory ``packer-chunks.json``): for each weight file the sha256 of every fixed-size
chunk of its bytes (the last one shorter). The manifest pins that file like any other (its
``files`` entry, size and sha256; the weights section names it under ``chunks``), and
:func:`packer.runtime.signature.model_layout` lists it as a file of the model directory, so
``model.sig`` signs its digest: under ``PACKER_REQUIRE_SIGNATURE`` the table is proven by the
signature, and each chunk by the table.

The table's format and its reading live here; its use, the proof of a chunk, lives in
:mod:`.proof` (one prover for every reader: a flipped byte is refused by the reader whose span
holds it, naming the file, the chunk (index and byte range) and the rank). A build without the
table keeps whole-file verification.

Standard library only: the runtime ships without the build side, which imports this module.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from .env import ArtifactMismatchError
from .reading import check_rel, loads_json

CHUNKS_NAME = "packer-chunks.json"  # the table's name in the model directory
CHUNKS_REL = "weights/" + CHUNKS_NAME  # and in OUT, beside the weight files it covers
CHUNK_FORMAT = "packer-chunks/v1"
MIN_CHUNK, MAX_CHUNK = 4096, 1 << 30  # a page; far above any useful chunk
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX = re.compile(r"[0-9a-f]*")


class FileChunks(NamedTuple):  # a NamedTuple: ~0.13 ms to define at import, a frozen dataclass ~0.8 ms
    """The chunk digests of one weight file.

    Attributes:
        chunk: the chunk size (bytes); chunk ``i`` is bytes ``[i * chunk, min((i + 1) * chunk, size))``.
        size: the file's size (bytes).
        sha256: the whole file's sha256 (hex), as the manifest pins it.
        hexes: each chunk's sha256 as 64 lowercase hex digits, ``ceil(size / chunk)`` of them
            joined (one string: the table parses in one match per file, not one per chunk).
    """

    chunk: int
    size: int
    sha256: str
    hexes: str

    def digest(self, i: int) -> str:
        """Chunk ``i``'s sha256 (hex)."""
        return self.hexes[64 * i: 64 * i + 64]

    @property
    def digests(self) -> tuple[str, ...]:
        """Every chunk's sha256 (hex), in order."""
        return tuple(self.digest(i) for i in range(len(self.hexes) // 64))

    def bounds(self, i: int) -> tuple[int, int]:
        """``(start, end)`` of chunk ``i`` in the file (bytes)."""
        return i * self.chunk, min((i + 1) * self.chunk, self.size)

    def cover(self, start: int, end: int) -> range:
        """The chunks holding bytes ``start:end`` of the file (empty for an empty span)."""
        if end <= start:
            return range(0)
        return range(start // self.chunk, (end - 1) // self.chunk + 1)


def table_in_tree(weights: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``[(path in the model directory, path in OUT)]`` of the build's chunk table (none without one).

    Raises:
        ArtifactMismatchError: a weights section naming another file than :data:`CHUNKS_REL`.
    """
    rel = weights.get("chunks")
    if rel is None:
        return []
    if rel != CHUNKS_REL:
        raise ArtifactMismatchError(f"the manifest's weights.chunks {str(rel)[:80]!r} is not {CHUNKS_REL}")
    return [(CHUNKS_NAME, CHUNKS_REL)]


def chunk_count(size: int, chunk: int) -> int:
    """How many chunks of ``chunk`` bytes a file of ``size`` bytes has (an empty file: none)."""
    return -(-size // chunk)


def _fail(where: str, why: str) -> ArtifactMismatchError:
    return ArtifactMismatchError(f"{where}: {why}")


def _file_chunks(where: str, rel: str, entry: Any, chunk: int, pinned: Mapping[str, Any]) -> FileChunks:
    """One file's record of the table, checked against its shape and the manifest's pin."""
    if not isinstance(entry, dict) or not isinstance(entry.get("chunks"), str):
        raise _fail(where, f"files[{rel!r}] is not a record with its chunks' digests")
    size, digest, hexes = entry.get("size"), entry.get("sha256"), entry["chunks"]
    if type(size) is not int or size < 0 or not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        raise _fail(where, f"files[{rel!r}]: size {size!r} or sha256 {str(digest)[:70]!r} malformed")
    if len(hexes) != 64 * chunk_count(size, chunk) or not _HEX.fullmatch(hexes):
        raise _fail(where, f"files[{rel!r}]: expected {chunk_count(size, chunk)} chunk digests of 64 lowercase "
                           f"hex digits, joined, for {size} bytes in chunks of {chunk}")
    want = pinned.get(rel)
    if not isinstance(want, dict) or (want.get("size"), want.get("sha256")) != (size, digest):
        raise _fail(where, f"files[{rel!r}]: size {size} and sha256 {digest[:16]}... are not what the "
                           "manifest pins for it (a table of another build?)")
    return FileChunks(chunk, size, digest, hexes)


def parse_table(data: bytes, where: str, pinned: Mapping[str, Any]) -> dict[str, FileChunks]:
    """The chunk table in ``data`` (the bytes of ``packer-chunks.json``), by file path in OUT.

    Args:
        data: the table's bytes, already checked against the manifest's sha256 for it.
        where: the table's name for messages.
        pinned: the manifest's ``files`` map: each file the table covers must be pinned there
            with the size and sha256 the table records.

    Returns:
        ``{path in OUT: FileChunks}``.

    Raises:
        ArtifactMismatchError: not a table of this format, or a record that does not match
            its shape or the manifest.
    """
    doc = loads_json(data, where)
    chunk, files = doc.get("chunk_size"), doc.get("files")
    if doc.get("format") != CHUNK_FORMAT or doc.get("algorithm") != "sha256":
        raise _fail(where, f"not a {CHUNK_FORMAT} table of sha256 digests")
    if type(chunk) is not int or not MIN_CHUNK <= chunk <= MAX_CHUNK or chunk % MIN_CHUNK:
        raise _fail(where, f"chunk_size {chunk!r} is not a multiple of {MIN_CHUNK} up to {MAX_CHUNK}")
    if not isinstance(files, dict):
        raise _fail(where, "files is not a record")
    return {check_rel(rel, where): _file_chunks(where, rel, entry, chunk, pinned) for rel, entry in files.items()}


def table_doc(chunk: int, files: Mapping[str, tuple[int, str, tuple[str, ...]]]) -> dict[str, Any]:
    """The table as JSON-able data: ``files`` maps a path in OUT to ``(size, sha256, chunk digests)``."""
    return {"format": CHUNK_FORMAT, "algorithm": "sha256", "chunk_size": chunk,
            "files": {rel: {"size": size, "sha256": sha, "chunks": "".join(digests)}
                      for rel, (size, sha, digests) in sorted(files.items())}}


def rank_name() -> str:
    """``"rank R of N"`` in a torch.distributed process group, else "" (torch imported here)."""
    import torch.distributed as dist

    return f"rank {dist.get_rank()} of {dist.get_world_size()}" if dist.is_initialized() else ""
