"""Chunk digests: proof at the size of a read, aligned to the ranks' splits.

A build writes ``weights/packer-chunks.json`` (:data:`CHUNKS_REL`; in the model directory
``packer-chunks.json``): for each weight file the sha256 of every chunk of its bytes. The manifest
pins that file like any other (its ``files`` entry, size and sha256; the weights section names it
under ``chunks``), and :func:`packer.runtime.signature.model_layout` lists it as a file of the
model directory, so ``model.sig`` signs its digest: under ``PACKER_REQUIRE_SIGNATURE`` the table
is proven by the signature, and each chunk by the table.

Where the chunks lie (:data:`CHUNK_FORMAT`, ``packer-chunks/v2``): each file is cut at its
``cuts`` (sorted offsets: where its data section starts, where each tensor starts and ends, and
where each tensor's rows split among the ranks of tensor parallelism at the degrees of
:data:`TP_DEGREES`, by :func:`split`, the runtime's own arithmetic), and each piece between two
cuts is cut again into chunks of ``chunk_size`` bytes from its start (the last one shorter). So
every span a rank reads (:mod:`.tp`) starts and ends on a chunk's edge: a verified rank hashes
and fetches its share, not a neighbour's bytes. A ``packer-chunks/v1`` table (older builds) has
no cuts: chunk ``i`` is bytes ``[i * chunk, (i + 1) * chunk)``; it loads the same way.

The table's format and its reading live here; its use, the proof of a chunk, lives in
:mod:`.proof` (one prover for every reader: a flipped byte is refused by the reader whose span
holds it, naming the file, the chunk (index and byte range) and the rank). A build without the
table keeps whole-file verification.

Standard library only: the runtime ships without the build side, which imports this module.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from .env import ArtifactMismatchError
from .reading import check_rel, loads_json

CHUNKS_NAME = "packer-chunks.json"  # the table's name in the model directory
CHUNKS_REL = "weights/" + CHUNKS_NAME  # and in OUT, beside the weight files it covers
CHUNK_FORMAT = "packer-chunks/v2"  # what a build writes: chunks cut at the ranks' splits
CHUNK_FORMAT_V1 = "packer-chunks/v1"  # older builds: the fixed grid, still read
# the tensor-parallel degrees whose row splits are cut: one node's NVLink domain is 8 GPUs (HGX
# H100/H200, MI300X), tensor parallelism rarely crosses nodes, and head counts and FFN widths are
# multiples of 8, so TP 2 and 4 split where TP 8 does (7 cuts a tensor; TP 16 would double them)
TP_DEGREES = (2, 4, 8)
MIN_CHUNK, MAX_CHUNK = 4096, 1 << 30  # a page; far above any useful chunk
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX = re.compile(r"[0-9a-f]*")


class FileChunks(NamedTuple):  # a NamedTuple: ~0.13 ms to define at import, a frozen dataclass ~0.8 ms
    """The chunk digests of one weight file.

    Attributes:
        chunk: the largest chunk (bytes): each piece between two cuts is cut into chunks of
            this size from its start, the last one shorter.
        size: the file's size (bytes).
        sha256: the whole file's sha256 (hex), as the manifest pins it.
        hexes: each chunk's sha256 as 64 lowercase hex digits, joined (one string: the table
            parses in one match per file, not one per chunk).
        cuts: where each piece starts (``0`` first, then the table's cuts, sorted); ``(0,)``: the
            fixed grid of a ``packer-chunks/v1`` table.
        firsts: the index of each piece's first chunk (same length as ``cuts``).
    """

    chunk: int
    size: int
    sha256: str
    hexes: str
    cuts: tuple[int, ...] = (0,)
    firsts: tuple[int, ...] = (0,)

    @property
    def total(self) -> int:
        """How many chunks the file has."""
        return len(self.hexes) // 64

    def digest(self, i: int) -> str:
        """Chunk ``i``'s sha256 (hex)."""
        return self.hexes[64 * i: 64 * i + 64]

    @property
    def digests(self) -> tuple[str, ...]:
        """Every chunk's sha256 (hex), in order."""
        return tuple(self.digest(i) for i in range(self.total))

    def bounds(self, i: int) -> tuple[int, int]:
        """``(start, end)`` of chunk ``i`` in the file (bytes)."""
        p = bisect_right(self.firsts, i) - 1  # the piece holding it
        a = self.cuts[p] + (i - self.firsts[p]) * self.chunk
        return a, min(a + self.chunk, self.cuts[p + 1] if p + 1 < len(self.cuts) else self.size)

    def holding(self, at: int) -> int:
        """The index of the chunk holding byte ``at`` of the file."""
        p = bisect_right(self.cuts, at) - 1
        return self.firsts[p] + (at - self.cuts[p]) // self.chunk

    def cover(self, start: int, end: int) -> range:
        """The chunks holding bytes ``start:end`` of the file (empty for an empty span)."""
        if end <= start:
            return range(0)
        return range(self.holding(start), self.holding(end - 1) + 1)


def pieces(size: int, chunk: int, cuts: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """``(starts, firsts, count)`` of a file of ``size`` bytes cut at ``cuts`` (sorted, inside
    ``(0, size)``) and in chunks of ``chunk`` bytes: each piece's start, its first chunk's index,
    and the number of chunks (an empty file: none)."""
    starts = (0, *cuts)
    firsts, n = [], 0
    for a, b in zip(starts, (*cuts, size), strict=True):
        firsts.append(n)
        n += chunk_count(b - a, chunk)
    return starts, tuple(firsts), n


def chunk_ends(size: int, chunk: int, cuts: Sequence[int]) -> list[int]:
    """Every chunk's end in the file, in order (the build hashes its chunks to these)."""
    ends: list[int] = []
    for a, b in zip((0, *cuts), (*cuts, size), strict=True):
        ends.extend(range(a + chunk, b, chunk))
        if b > a:
            ends.append(b)
    return ends


def split(size: int, world: int, rank: int) -> tuple[int, int]:
    """``(length, offset)`` of ``rank``'s part of ``size`` as DTensor's ``Shard`` splits it: parts
    of ``ceil(size / world)``, the last ones shorter or empty (the tensor-parallel path's one
    arithmetic, :mod:`.tp`; the chunk cuts follow it)."""
    part = -(-size // world)
    start = min(rank * part, size)
    return min(size, start + part) - start, start


def tp_cuts(data_start: int, tensors: Iterable[tuple[int, int, Sequence[int]]], size: int,
            degrees: Sequence[int] = TP_DEGREES) -> tuple[int, ...]:
    """The cuts of a safetensors file of ``size`` bytes: its data section's start, and for each
    tensor ``(begin, end, shape)`` (offsets in the data section) its start, its end and, for each
    of ``degrees``, where its rows split among the ranks (:func:`split`). Sorted, inside ``(0, size)``."""
    cuts = {data_start}
    for begin, end, shape in tensors:
        a, b = data_start + begin, data_start + end
        cuts.update((a, b))
        rows = shape[0] if shape else 0
        if rows < 2 or (b - a) % rows:
            continue  # a scalar, one row, or bytes that are no whole rows (no split to align to)
        row = (b - a) // rows
        for world in degrees:
            cuts.update(a + split(rows, world, r)[1] * row for r in range(1, world))
    return tuple(sorted(c for c in cuts if 0 < c < size))


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


def _cuts(where: str, rel: str, entry: dict[str, Any], v2: bool, size: int, chunk: int,
          hexes: str) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """A record's cuts checked (v2: a sorted list of offsets inside the file, no more than it has
    chunks, counted before anything is built from them): ``(starts, firsts, chunk count)``."""
    cuts = entry.get("cuts", []) if v2 else []
    if not v2 and "cuts" in entry:
        raise _fail(where, f"files[{rel!r}]: a {CHUNK_FORMAT_V1} table has no cuts")
    if not isinstance(cuts, list) or len(cuts) > len(hexes) // 64:  # each cut starts a chunk
        raise _fail(where, f"files[{rel!r}]: cuts is not a list of at most one offset per chunk digest")
    last = 0
    for c in cuts:
        if type(c) is not int or not last < c < size:
            raise _fail(where, f"files[{rel!r}]: cut {str(c)[:24]} is not an offset after {last} inside its "
                               f"{size} bytes (cuts are sorted, each once)")
        last = c
    return pieces(size, chunk, cuts)


def _file_chunks(where: str, rel: str, entry: Any, chunk: int, pinned: Mapping[str, Any], v2: bool) -> FileChunks:
    """One file's record of the table, checked against its shape and the manifest's pin."""
    if not isinstance(entry, dict) or not isinstance(entry.get("chunks"), str):
        raise _fail(where, f"files[{rel!r}] is not a record with its chunks' digests")
    size, digest, hexes = entry.get("size"), entry.get("sha256"), entry["chunks"]
    if type(size) is not int or size < 0 or not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        raise _fail(where, f"files[{rel!r}]: size {size!r} or sha256 {str(digest)[:70]!r} malformed")
    starts, firsts, count = _cuts(where, rel, entry, v2, size, chunk, hexes)
    if len(hexes) != 64 * count or not _HEX.fullmatch(hexes):
        raise _fail(where, f"files[{rel!r}]: expected {count} chunk digests of 64 lowercase "
                           f"hex digits, joined, for {size} bytes in chunks of {chunk} cut at {len(starts) - 1} "
                           "offsets")
    want = pinned.get(rel)
    if not isinstance(want, dict) or (want.get("size"), want.get("sha256")) != (size, digest):
        raise _fail(where, f"files[{rel!r}]: size {size} and sha256 {digest[:16]}... are not what the "
                           "manifest pins for it (a table of another build?)")
    return FileChunks(chunk, size, digest, hexes, starts, firsts)


def parse_table(data: bytes, where: str, pinned: Mapping[str, Any]) -> dict[str, FileChunks]:
    """The chunk table in ``data`` (the bytes of ``packer-chunks.json``), by file path in OUT.

    Args:
        data: the table's bytes, already checked against the manifest's sha256 for it.
        where: the table's name for messages.
        pinned: the manifest's ``files`` map: each file the table covers must be pinned there
            with the size and sha256 the table records.

    Returns:
        ``{path in OUT: FileChunks}`` (a ``packer-chunks/v1`` table's files without cuts).

    Raises:
        ArtifactMismatchError: not a table of either format, or a record that does not match
            its shape or the manifest.
    """
    doc = loads_json(data, where)
    chunk, files, form = doc.get("chunk_size"), doc.get("files"), doc.get("format")
    if form not in (CHUNK_FORMAT, CHUNK_FORMAT_V1) or doc.get("algorithm") != "sha256":
        raise _fail(where, f"not a {CHUNK_FORMAT} (or {CHUNK_FORMAT_V1}) table of sha256 digests")
    if type(chunk) is not int or not MIN_CHUNK <= chunk <= MAX_CHUNK or chunk % MIN_CHUNK:
        raise _fail(where, f"chunk_size {chunk!r} is not a multiple of {MIN_CHUNK} up to {MAX_CHUNK}")
    if not isinstance(files, dict):
        raise _fail(where, "files is not a record")
    v2 = form == CHUNK_FORMAT
    return {check_rel(rel, where): _file_chunks(where, rel, entry, chunk, pinned, v2) for rel, entry in files.items()}


def table_doc(chunk: int, files: Mapping[str, tuple[int, str, tuple[str, ...], tuple[int, ...]]]) -> dict[str, Any]:
    """The table as JSON-able data: ``files`` maps a path in OUT to ``(size, sha256, chunk digests,
    cuts)``."""
    return {"format": CHUNK_FORMAT, "algorithm": "sha256", "chunk_size": chunk,
            "files": {rel: {"size": size, "sha256": sha, "cuts": list(cuts), "chunks": "".join(digests)}
                      for rel, (size, sha, digests, cuts) in sorted(files.items())}}


def rank_name() -> str:
    """``"rank R of N"`` in a torch.distributed process group, else "" (torch imported here)."""
    import torch.distributed as dist

    return f"rank {dist.get_rank()} of {dist.get_world_size()}" if dist.is_initialized() else ""
