"""The CUDA pipeline's scheduling: chunk plan, staging ring, reader threads, the dispatcher.

Reader threads fill a bounded ring of staging slots with ``os.preadv`` (which releases the
GIL) while the engine copies the slot before; a slot is refilled only after the event of its
last copy completed. :class:`RingStats` lets tests check the buffer budget and that rule.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections import deque
from typing import Any

from packer.runtime.engines import _host_view
from packer.runtime.env import DEFAULT_CHUNK, MAX_RING_BYTES, MIB, ArtifactMismatchError
from packer.runtime.shards import Shard
from packer.runtime.timeline import Timeline


class Chunk:
    """One read into a slot: ``nbytes`` at ``offset`` of shard ``shard``, then its copies."""

    __slots__ = ("shard", "offset", "nbytes", "copies")

    def __init__(self, shard: int, offset: int) -> None:
        self.shard, self.offset, self.nbytes = shard, offset, 0
        self.copies: list[tuple[int, Any]] = []  # (offset in slot, destination uint8 view)


def plan_chunks(segments: list[tuple[int, int, int, Any]], chunk: int) -> list[Chunk]:
    """Cut ``(shard, file offset, nbytes, uint8 destination)`` segments into chunks.

    Contiguous segments of one shard share a chunk; a chunk never exceeds ``chunk`` bytes.
    """
    out: list[Chunk] = []
    for shard, offset, nbytes, dst in segments:
        done = 0
        while done < nbytes:
            cur = out[-1] if out else None
            if (cur is None or cur.shard != shard or cur.offset + cur.nbytes != offset + done
                    or cur.nbytes >= chunk):  # fmt: skip
                cur = Chunk(shard, offset + done)
                out.append(cur)
            n = min(chunk - cur.nbytes, nbytes - done)
            cur.copies.append((cur.nbytes, dst[done: done + n]))
            cur.nbytes += n
            done += n
    return out


class Latch:
    """Counts the pieces of one or more reads; ``ready`` fires when the last one landed."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._left = 0
        self._lock = threading.Lock()

    def begin(self, pieces: int) -> None:
        self.ready.clear()
        self.error, self._left = None, pieces

    def piece_done(self, error: BaseException | None) -> None:
        with self._lock:
            self.error = self.error or error
            self._left -= 1
            if self._left == 0:
                self.ready.set()

    def wait(self) -> None:
        self.ready.wait()
        if self.error is not None:
            raise self.error


class Slot(Latch):
    """A staging buffer of the ring and the event of the last copy out of it."""

    def __init__(self, index: int, host: Any) -> None:
        super().__init__()
        self.index, self.host, self.view = index, host, _host_view(host)
        self.event: Any = None


class Readers:
    """Threads that fill buffers with ``os.preadv`` (which releases the GIL)."""

    def __init__(self, threads: int, piece: int) -> None:
        self.piece = piece
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.first: float | None = None
        self.last = 0.0
        self.nbytes = 0
        self._threads = [threading.Thread(target=self._run, name=f"packer-read-{i}", daemon=True)
                         for i in range(threads)]  # fmt: skip
        for t in self._threads:
            t.start()

    def submit(self, latch: Latch, fd: int, offset: int, view: memoryview) -> None:
        """Read ``len(view)`` bytes at ``offset`` into ``view`` in pieces; ``latch`` counts them."""
        self.submit_many(latch, [(fd, offset, view)])

    def submit_many(self, latch: Latch, reads: list[tuple[int, int, memoryview]]) -> None:
        """Queue several ``(fd, offset, view)`` reads under one latch."""
        pieces = [(fd, off + a, view[a: a + self.piece]) for fd, off, view in reads
                  for a in range(0, len(view), self.piece)]  # fmt: skip
        latch.begin(len(pieces))
        if not pieces:
            latch.ready.set()
        for fd, off, view in pieces:
            self._q.put((latch, fd, off, view))

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            slot, fd, offset, view = item
            start, error = time.perf_counter(), None
            try:
                got = 0
                while got < len(view):
                    n = os.preadv(fd, [view[got:]], offset + got)
                    if n <= 0:
                        raise ArtifactMismatchError(f"short read at byte {offset + got}")
                    got += n
            except BaseException as e:  # handed to the dispatcher through the slot
                error = e
            with self._lock:
                self.first = start if self.first is None else min(self.first, start)
                self.last = max(self.last, time.perf_counter())
                self.nbytes += len(view)
            slot.piece_done(error)

    def close(self) -> None:
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join()


class RingStats:
    """What the ring did; tests assert the buffer budget and the refill rule with it."""

    def __init__(self) -> None:
        self.host_bytes = 0  # staging memory allocated (never freed during a run)
        self.max_busy = 0  # slots reading or copying at once
        self.chunks = 0
        self.early_refills = 0  # refills before the slot's copy completed: must stay 0
        self.max_chunk = 0


def run_pipeline(shards: list[Shard], chunks: list[Chunk], engine: Any, *, slots: int,
                 chunk: int, readers: int, hashers: dict[int, Any] | None = None,
                 stats: RingStats | None = None) -> Readers:  # fmt: skip
    """Move every chunk from disk through the ring into its destinations.

    Reads run ahead in reader threads while the engine copies the slot before; a slot goes
    back to reading only when the event of its last copy completed. With ``hashers`` the
    chunks are hashed in file order as they pass (they must cover each shard's data).
    """
    if chunk > DEFAULT_CHUNK or slots * chunk > MAX_RING_BYTES or slots < 1:
        raise ValueError(f"ring of {slots} x {chunk} bytes exceeds 64 MiB chunks / 512 MiB total")
    size = min(chunk, 1 << max(max((c.nbytes for c in chunks), default=1) - 1, 0).bit_length())
    pool = Readers(readers, piece=max(size // 4, MIB))
    ring: list[Slot] = []
    try:
        _drive(shards, deque(chunks), engine, ring, slots, size, pool, hashers, stats or RingStats())
    except BaseException:
        with contextlib.suppress(Exception):
            engine.finish()  # no copy may still read a slot when the ring is freed
        raise
    finally:
        pool.close()
        ring.clear()
        engine.release()
    return pool


def _drive(shards: list[Shard], todo: deque[Chunk], engine: Any, ring: list[Slot], slots: int,
           size: int, pool: Readers, hashers: dict[int, Any] | None, stats: RingStats) -> None:  # fmt: skip
    free: deque[Slot] = deque()
    busy: deque[tuple[Slot, Chunk]] = deque()
    while todo or busy:
        while todo and (free or len(ring) < slots):
            if not free:
                ring.append(Slot(len(ring), engine.host_buffer(size)))
                stats.host_bytes += size
                free.append(ring[-1])
            slot = free[0]
            if slot.event is not None and not engine.query(slot.event):
                if busy:
                    break  # issue the copies that are ready first
                engine.wait(slot.event)
            if slot.event is not None and not engine.query(slot.event):
                stats.early_refills += 1
            free.popleft()
            c = todo.popleft()
            pool.submit(slot, shards[c.shard].fd, c.offset, slot.view[: c.nbytes])
            busy.append((slot, c))
            copying = sum(1 for s in free if s.event is not None and not engine.query(s.event))
            stats.max_busy = max(stats.max_busy, len(busy) + copying)
            stats.chunks += 1
            stats.max_chunk = max(stats.max_chunk, c.nbytes)
        slot, c = busy.popleft()
        slot.ready.wait()
        if slot.error is not None:
            raise slot.error
        if hashers is not None:
            hashers[c.shard].update(slot.view[: c.nbytes])
        slot.event = engine.copy([(dst, slot.host[a: a + dst.numel()]) for a, dst in c.copies])
        free.append(slot)
    engine.finish()


def run_ring(shards: list[Shard], chunks: list[Chunk], engine: Any, *, slots: int, chunk: int,
             readers: int, hashers: dict[int, Any] | None, start: float,
             timeline: Timeline) -> RingStats:  # fmt: skip
    """:func:`run_pipeline`, then the read and host->device stages on ``timeline``."""
    stats = RingStats()
    pool = run_pipeline(shards, chunks, engine, slots=slots, chunk=chunk,
                        readers=readers, hashers=hashers, stats=stats)  # fmt: skip
    end = time.perf_counter()
    moved = sum(c.nbytes for c in chunks)
    if pool.first is not None:
        timeline.add("read", pool.first, pool.last, pool.nbytes, lane=1)
    timeline.add("host->device" if engine.name == "cuda" else "host->device (cpu engine)",
                 start, end, moved, lane=2)  # fmt: skip
    return stats
