"""Proof of a build's bytes: the one prover of a chunk and the one hasher of a span.

Every reader proves what it uses here, whoever serves the bytes: the loader's local reads
(:class:`SpanCheck`, whole files with :func:`check_sha256`), the registry's reads
(:class:`~.remote.RemoteFile`), the tensor-parallel ranks (:mod:`.tp`), the tensors proven on use
(:mod:`.proven`), ``packer verify`` (:mod:`packer.chunks`) and the build side's hashing of a file
or a span (:mod:`packer.hashing`). :func:`prove_chunk` is the one
check of a chunk against the build's chunk table and its one message (file, chunk, span, rank);
:func:`hash_span` the one way a span of any source (an open file, a registry blob, bytes in
memory) is hashed. ``tests/test_one_view.py`` fails on a second of either.

Standard library only: the runtime ships without the build side, which imports this module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from .chunks import FileChunks
from .env import ArtifactMismatchError
from .reading import PositionalSource, read_at

HASH_BUFFER = 8 << 20  # one read of a span hashed from a file: large enough that a syscall costs nothing

Source = int | PositionalSource | bytes | bytearray | memoryview


def hash_span(src: Source | None, at: int, n: int, where: str, *,
              known: tuple[int, memoryview | bytes | bytearray] | None = None, buffer: int = HASH_BUFFER) -> str:
    """sha256 (hex) of the ``n`` bytes at offset ``at`` of ``src``.

    Args:
        src: an open file's descriptor, a :class:`~.reading.PositionalSource`, bytes in memory,
            or None when ``known`` holds the whole span.
        at: where the span starts in ``src``.
        n: the span's length.
        where: the source's name in messages.
        known: ``(offset in the span, bytes)`` already in hand (what a reader read and uses):
            they are hashed as they are, only the rest of the span is read.
        buffer: the largest read of ``src`` (the build side hashes in reads of 1 MiB, which stay
            in a core's cache between the copy and the hash).

    Raises:
        ArtifactMismatchError: the source ends inside the span; what a source raises.
    """
    k, have = known if known is not None else (n, b"")
    h = hashlib.sha256()
    _feed(h, src, at, 0, k, where, buffer)
    h.update(have)  # hashlib releases the GIL on large buffers
    _feed(h, src, at, k + len(have), n, where, buffer)
    return h.hexdigest()


def _feed(h: hashlib._Hash, src: Source | None, at: int, lo: int, hi: int, where: str, buffer: int) -> None:
    """Hash bytes ``[lo, hi)`` of the span at ``at`` of ``src`` into ``h``."""
    if hi <= lo:
        return
    if isinstance(src, (bytes, bytearray, memoryview)):
        h.update(memoryview(src)[at + lo: at + hi])
        return
    if src is None:
        raise ValueError(f"{where}: bytes [{lo}, {hi}) of the span are neither known nor readable")
    buf = memoryview(bytearray(min(buffer, hi - lo)))
    while lo < hi:
        piece = buf[: min(len(buf), hi - lo)]
        read_at(src, piece, at + lo, where)
        h.update(piece)
        lo += len(piece)


def prove_chunk(where: str, fc: FileChunks, i: int, got: str, *, rank: str = "", source: str = "",
                table: str = "the chunk table", why: str = "the file is corrupt or from another build") -> None:
    """Raise unless ``got`` is the sha256 the chunk table pins for chunk ``i`` of a file.

    Args:
        where: the file as the reader found it (a path, ``oci://...: weights/...``).
        fc: the file's chunk digests.
        i: the chunk's index.
        got: the sha256 (hex) of the chunk's bytes as read (:func:`hash_span`).
        rank: the reader's name (``"rank 1 of 2"``; "" for one process).
        source: where the bytes came from, when not ``where`` itself (`` from blob sha256:...``).
        table: the table's name (``packer verify`` names the file).
        why: what a difference means for this source.

    Raises:
        ArtifactMismatchError: ``<where>: chunk <i> (bytes [a, b) of <size>)<source> has sha256
            <got>..., <table> pins <want>...[ on <rank>]; <why>``, one line.
    """
    want = fc.digest(i)
    if got != want:
        a, b = fc.bounds(i)
        by = f" on {rank}" if rank else ""
        raise ArtifactMismatchError(f"{where}: chunk {i} (bytes [{a}, {b}) of {fc.size}){source} has sha256 "
                                    f"{got[:16]}..., {table} pins {want[:16]}...{by}; {why}")


def check_sha256(where: object, got: str, want: str, held: str = "") -> None:
    """Raise unless ``got == want``: a whole file's proof, for a build without a chunk table (and
    the small files); ``where`` is the file as found on this machine (``held``: where its bytes
    lie, when that is not a file of its own)."""
    if got != want:
        raise ArtifactMismatchError(f"{where}: sha256 {got[:16]}..., the manifest says "
                                    f"{want[:16]}...; the file is corrupt or from another build{held}")


def running_sha256(first: bytes) -> hashlib._Hash:
    """A whole file's sha256 fed as its bytes pass (the ring's hash thread), from ``first``."""
    return hashlib.sha256(first)


class SpanCheck:
    """Check the chunks covering the bytes a reader uses, as it reads them.

    Args:
        table: the build's chunk table (:func:`~.chunks.parse_table`).
        rank: the reader's name in messages (``"rank 1 of 2"``; "" for a single process).

    ``hashed`` counts the bytes hashed (whole chunks), ``chunks`` the chunks checked (one
    check per thread: the counts are not locked).
    """

    def __init__(self, table: Mapping[str, FileChunks], rank: str = "") -> None:
        self.table, self.rank = table, rank
        self.hashed = self.chunks = 0

    def covers(self, rel: str) -> bool:
        """Whether the table holds the file ``rel`` (else the caller verifies it whole)."""
        return rel in self.table

    def check_file(self, rel: str, fd: int | PositionalSource, base: int, where: str | None = None) -> None:
        """Verify every chunk of the file ``rel`` (a reader of all its bytes), read chunk by chunk.

        Raises:
            ArtifactMismatchError: as :meth:`check`, for the first chunk that differs.
        """
        fc = self.table[rel]
        for i in range(fc.total):
            a, b = fc.bounds(i)
            prove_chunk(where or rel, fc, i, hash_span(fd, base + a, b - a, where or rel), rank=self.rank)
            self.hashed, self.chunks = self.hashed + (b - a), self.chunks + 1

    def check(self, rel: str, fd: int | PositionalSource | None, base: int, start: int, data: memoryview | bytes,
              where: str | None = None) -> None:
        """Verify every chunk covering ``data``, the bytes at ``start`` of the file ``rel``.

        Args:
            rel: the file's path in OUT (a key of the table).
            fd: an open descriptor of the file or the layer blob that holds it, or a source
                (None when ``data`` covers whole chunks).
            base: where the file's first byte is in ``fd`` (its offset in the blob; 0 for a file).
            start: where ``data`` starts in the file (bytes).
            data: the bytes the reader uses; the rest of each covering chunk is read here.
            where: the file as found on this machine, for messages (default ``rel``).

        Raises:
            ArtifactMismatchError: a chunk whose sha256 is not the table's, naming the file,
                the chunk (index, byte range) and the rank; or the file ends early.
        """
        fc, view = self.table[rel], memoryview(data).cast("B")
        end = start + len(view)
        for i in fc.cover(start, end):
            a, b = fc.bounds(i)
            lo, hi = max(a, start), min(b, end)
            got = hash_span(fd, base + a, b - a, where or rel, known=(lo - a, view[lo - start: hi - start]))
            self.hashed, self.chunks = self.hashed + (b - a), self.chunks + 1
            prove_chunk(where or rel, fc, i, got, rank=self.rank)
