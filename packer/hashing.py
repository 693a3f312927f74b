"""The build side's hashing of files and spans: a file's ``(size, sha256)``, a span's sha256,
a span's chunk digests in one read.

A file or a span is hashed by the runtime's one span hasher (:func:`packer.runtime.proof.hash_span`),
whoever proves it; only :func:`sha256_chunked` hashes reads itself, because it writes a chunk
table (the span's sha256 and each chunk's from one read, two threads), it proves nothing.

Above :mod:`packer.reading` (a file named by path is opened through it) and beside
:mod:`packer.place`; the streaming writers' hash threads (:class:`packer.util.fsutil.HashThread`)
hash bytes as they are written and stay in ``packer/util``.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from packer.reading import open_regular
from packer.runtime.chunks import chunk_ends
from packer.runtime.env import ArtifactMismatchError
from packer.runtime.proof import hash_span
from packer.runtime.reading import read_at
from packer.util.fsutil import FileEntry

# a hash read's buffer: small enough to stay in the core's own cache between the copy from the
# page cache and the hash (1 GB here: 0.72-0.76 s against 0.78-0.80 s with 8 MiB reads and
# 0.83-1.0 s over an mmap, whose page faults cost more than the copy: benchmarks/RESULTS.md)
HASH_READ = 2**20


def sha256_file(path: str | Path, stop: threading.Event | None = None) -> tuple[int, str]:
    """Return ``(size, sha256 hex)`` of a file: the span of its size when opened, hashed by the
    one span hasher (:func:`packer.runtime.proof.hash_span`) in reads of :data:`HASH_READ`.

    Raises:
        PackerError: not a regular file; OSError: unreadable, or it shrank while being read;
            InterruptedError: ``stop`` was set before the end.
    """
    with open_regular(path) as f:  # a FIFO is refused, never waited on
        fd = f.fileno()
        size = os.fstat(fd).st_size
        src: int | _Stoppable = fd if stop is None else _Stoppable(fd, stop, str(path))
        try:
            return size, hash_span(src, 0, size, str(path), buffer=HASH_READ)
        except ArtifactMismatchError as e:  # truncated while read: the file is not what was opened
            raise OSError(f"{e} (it shrank while being hashed)") from None


class _Stoppable:
    """A descriptor read as a source that stops between reads once ``stop`` is set (work done
    ahead of need, given up when the build or verification ends early)."""

    def __init__(self, fd: int, stop: threading.Event, where: str) -> None:
        self.fd, self.stop, self.where = fd, stop, where

    def read_at(self, view: memoryview, at: int) -> None:
        if self.stop.is_set():
            raise InterruptedError(f"{self.where}: hashing stopped")
        read_at(self.fd, view, at, self.where)


def sha256_file_or_none(path: str | Path, stop: threading.Event) -> tuple[int, str] | None:
    """:func:`sha256_file` for work done ahead of need: None when unreadable or stopped.

    The caller hashes again (or reports the problem) when it needs the digest.
    """
    try:
        return sha256_file(path, stop)
    except OSError:
        return None


def sha256_range(fd: int, start: int, end: int) -> str:
    """sha256 (hex) of bytes ``start:end`` of the open file ``fd`` (:func:`~packer.runtime.proof.hash_span`,
    reads of :data:`HASH_READ` with ``pread`` into a buffer of this call's own, so that threads
    hash ranges of one descriptor side by side).

    Raises:
        ValueError: not ``0 <= start <= end``; EOFError: the file ends before ``end``;
        OSError: unreadable.
    """
    if not 0 <= start <= end:
        raise ValueError(f"sha256_range: not a range of bytes: {start}:{end}")
    try:
        return hash_span(fd, start, end - start, "the file", buffer=HASH_READ)
    except ArtifactMismatchError:  # the file is shorter than the span: say where it ends
        raise EOFError(f"the file ends at byte {max(start, os.fstat(fd).st_size)}, before byte {end}") from None


class _Chunks:
    """sha256 of each chunk of a range fed in order, the chunks ending at ``ends`` (absolute)."""

    def __init__(self, ends: list[int]) -> None:
        self.ends, self.k, self.piece = ends, 0, hashlib.sha256()
        self.done: list[str] = []

    def feed(self, view: memoryview, at: int) -> None:
        pos = 0
        while pos < len(view):  # a chunk's end may fall inside the buffer (a chunk under its size)
            take = min(len(view) - pos, self.ends[self.k] - (at + pos))
            self.piece.update(view[pos:pos + take])
            pos += take
            if at + pos == self.ends[self.k]:
                self.done.append(self.piece.hexdigest())
                self.piece, self.k = hashlib.sha256(), self.k + 1


def sha256_chunked(fd: int, start: int, end: int, chunk: int,
                   cuts: tuple[int, ...] = ()) -> tuple[str, tuple[str, ...]]:
    """sha256 (hex) of bytes ``start:end`` of ``fd`` and of each of its chunks, from one read
    (``pread`` into buffers of this call's own, as :func:`sha256_range`).

    The range is cut at ``cuts`` (offsets from ``start``, sorted, inside the range: the chunk
    table's, :func:`packer.runtime.chunks.tp_cuts`) and each piece into ``chunk``-byte chunks
    from its start (:func:`packer.runtime.chunks.chunk_ends`). The chunks are hashed on a helper
    thread from the buffer just read while this one reads the next and hashes it whole (hashlib
    releases the GIL): two buffers, each reused only once the helper is done with it. Where cores
    are free the chunks cost no wall time; cuts change where a chunk ends, not the bytes hashed.

    Returns:
        ``(whole, chunks)``: the range's sha256 and each chunk's, in order.

    Raises:
        ValueError: not ``0 <= start <= end``, ``chunk < 1`` or cuts outside the range; EOFError:
            the file ends before ``end``; OSError: unreadable.
    """
    if not 0 <= start <= end or chunk < 1 or any(not 0 < c < end - start for c in cuts):
        raise ValueError(f"sha256_chunked: not a range of bytes in chunks: {start}:{end} by {chunk}")
    whole, pieces = hashlib.sha256(), _Chunks([start + e for e in chunk_ends(end - start, chunk, cuts)])
    bufs = [memoryview(bytearray(min(HASH_READ, end - start))) for _ in range(2)]
    with ThreadPoolExecutor(1, thread_name_prefix="packer-chunks") as helper:
        pending: Future[None] | None = None
        at, turn = start, 0
        while at < end:
            view = bufs[turn]
            n = os.preadv(fd, [view[:min(len(view), end - at)]], at)
            if n <= 0:
                raise EOFError(f"the file ends at byte {at}, before byte {end}")
            whole.update(view[:n])
            if pending is not None:
                pending.result()  # the other buffer is free again
            pending = helper.submit(pieces.feed, view[:n], at)
            at, turn = at + n, 1 - turn
        if pending is not None:
            pending.result()
    return whole.hexdigest(), tuple(pieces.done)


def file_entry(root: Path, path: Path) -> FileEntry:
    """Hash ``path`` and describe it relative to ``root``."""
    size, digest = sha256_file(path)
    return FileEntry(path.relative_to(root).as_posix(), size, digest)
