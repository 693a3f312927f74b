"""The CUDA pipeline's scheduling: chunk plan, staging ring, reader threads, the dispatcher.

Reader threads fill a bounded ring of staging slots with ``os.preadv`` (which releases the
GIL) while the engine copies the slot before; a slot is refilled only after the event of its
last copy completed. :class:`RingStats` lets tests check the buffer budget and that rule.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from .engines import CopyEngine, host_view
from .env import MAX_RING_BYTES
from .reading import PositionalSource, pieces, read_at
from .settings import DEFAULT_CHUNK, MIB
from .shards import Shard
from .timeline import Timeline

if TYPE_CHECKING:

    import hashlib

    import torch


class Segment(NamedTuple):
    """``nbytes`` at file ``offset`` of shard number ``shard``, bound for ``dst`` (a uint8 view)."""

    shard: int
    offset: int
    nbytes: int
    dst: torch.Tensor


class Read(NamedTuple):
    """``len(view)`` bytes at ``offset`` of ``fd`` (an open file, or a remote source), read into
    ``view``; ``where`` names the file in messages."""

    fd: int | PositionalSource
    offset: int
    view: memoryview
    where: str = ""


class Chunk:
    """One read into a slot: ``nbytes`` at ``offset`` of shard ``shard``, then its copies."""

    __slots__ = ("shard", "offset", "nbytes", "copies")

    def __init__(self, shard: int, offset: int) -> None:
        self.shard, self.offset, self.nbytes = shard, offset, 0
        self.copies: list[tuple[int, torch.Tensor]] = []  # (offset in slot, destination uint8 view)


def plan_chunks(segments: list[Segment], chunk: int) -> list[Chunk]:
    """Cut segments into chunks.

    Contiguous segments of one shard share a chunk; a chunk never exceeds ``chunk`` bytes.
    """
    out: list[Chunk] = []
    for shard, offset, nbytes, dst in segments:
        done = 0
        while done < nbytes:
            cur = out[-1] if out else None
            if (cur is None or cur.shard != shard or cur.offset + cur.nbytes != offset + done
                    or cur.nbytes >= chunk):
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
    """A staging buffer of the ring, the event of its last copy, and whether it is hashed."""

    def __init__(self, index: int, host: torch.Tensor) -> None:
        super().__init__()
        self.index, self.host, self.view = index, host, host_view(host)
        self.event: Any = None
        self.hashed = threading.Event()
        self.hashed.set()


class StagingRing:
    """One engine kind's staging slots, pinned once and kept for the process.

    A load takes the ring under its lock (concurrent loads take turns); it is re-pinned only
    when a load needs more slots or larger ones than it has, or when its slots are larger than
    that load's budget allows. :func:`release_ring` frees it.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.slots: list[Slot] = []
        self.size = 0
        self.kind = ""  # "registered", "torch-pinned" or "cpu": how the memory was had
        self._frees: list[Callable[[], None]] = []

    def take(self, engine: CopyEngine, slots: int, size: int, budget: int,
             timeline: Timeline | None) -> tuple[list[Slot], float]:
        """``slots`` slots of ``size`` to ``budget`` bytes (lock held); the seconds spent pinning."""
        secs = 0.0
        if len(self.slots) < slots or not size <= self.size <= budget:
            self.free()
            start = time.perf_counter()
            for i in range(slots):
                host, free, self.kind = engine.host_buffer(size)
                self._frees.append(free)
                self.slots.append(Slot(i, host))
            self.size = size
            end = time.perf_counter()
            secs = end - start
            if timeline is not None:
                timeline.add(f"pin ring ({self.kind})", start, end, slots * size)
        for s in self.slots:
            s.event = None
        return self.slots[:slots], secs

    def free(self) -> int:
        """Free every slot (lock held); the bytes freed."""
        freed = len(self.slots) * self.size
        frees, self._frees, self.slots, self.size = self._frees, [], [], 0
        for f in frees:
            f()
        return freed


_RINGS: dict[str, StagingRing] = {}
_RINGS_LOCK = threading.Lock()


def staging_ring(kind: str) -> StagingRing:
    """The process's ring for engine kind ``kind`` (``"cuda"`` or ``"cpu"``)."""
    with _RINGS_LOCK:
        return _RINGS.setdefault(kind, StagingRing())


def release_ring() -> int:
    """Free the staging rings of this process (waits for a load in progress).

    Returns:
        the bytes freed (pinned memory for CUDA); a later load pins its ring again.
    """
    freed = 0
    with _RINGS_LOCK:
        rings = list(_RINGS.values())
    for ring in rings:
        with ring.lock:
            freed += ring.free()
    return freed


def ring_chunk(nbytes: int) -> int:
    """``nbytes`` rounded down to a power of two (at least 1), at most 64 MiB."""
    return 1 << (min(max(nbytes, 1), DEFAULT_CHUNK).bit_length() - 1)


class Hasher:
    """A thread that hashes filled slots in the order given; a slot is ``hashed`` after."""

    def __init__(self, hashers: dict[int, hashlib._Hash]) -> None:
        self.hashers = hashers
        self.error: BaseException | None = None
        self.first: float | None = None
        self.last = 0.0
        self.nbytes = 0
        self._q: queue.SimpleQueue[tuple[Slot, int, int] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="packer-hash", daemon=True)
        self._thread.start()

    def submit(self, slot: Slot, shard: int, nbytes: int) -> None:
        slot.hashed.clear()
        self._q.put((slot, shard, nbytes))

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            slot, shard, nbytes = item
            start = time.perf_counter()
            try:
                if self.error is None:
                    self.hashers[shard].update(slot.view[:nbytes])  # hashlib releases the GIL
            except BaseException as e:  # handed to the dispatcher
                self.error = e
            self.first = start if self.first is None else self.first
            self.last, self.nbytes = time.perf_counter(), self.nbytes + nbytes
            slot.hashed.set()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()


class Readers:
    """Threads that fill buffers with ``os.preadv`` (which releases the GIL)."""

    def __init__(self, threads: int, piece: int) -> None:
        threads = max(threads, 1)  # none would leave every read waiting for ever
        self.piece = piece
        self._q: queue.SimpleQueue[tuple[Latch, Read] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.first: float | None = None
        self.last = 0.0
        self.nbytes = 0
        self._threads = [threading.Thread(target=self._run, name=f"packer-read-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, latch: Latch, read: Read) -> None:
        """Read ``len(read.view)`` bytes into its view in pieces; ``latch`` counts them."""
        self.submit_many(latch, [read])

    def submit_many(self, latch: Latch, reads: list[Read]) -> None:
        """Queue several reads under one latch."""
        cut = [Read(r.fd, r.offset + a, r.view[a: a + n], r.where) for r in reads
               for a, n in pieces(r.fd, r.offset, len(r.view), self.piece)]
        latch.begin(len(cut))
        if not cut:
            latch.ready.set()
        for r in cut:
            self._q.put((latch, r))

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            slot, (fd, offset, view, where) = item
            start, error = time.perf_counter(), None
            try:
                read_at(fd, view, offset, where)
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
        self.host_bytes = 0  # staging memory this load used (slots x slot size)
        self.pin_seconds = 0.0  # time spent pinning it (0 when the ring was kept from before)
        self.host_kind = ""  # how the staging memory was had (see StagingRing.kind)
        self.max_busy = 0  # slots reading or copying at once
        self.chunks = 0
        self.early_refills = 0  # refills before the slot's copy (and hash) completed: must stay 0
        self.max_chunk = 0
        self.hash_seconds = 0.0  # the hash thread's busy span (verified loads)
        self.started = 0.0  # perf_counter when the ring was ready and the first read went out


def run_pipeline(shards: list[Shard], chunks: list[Chunk], engine: CopyEngine, *, slots: int,
                 chunk: int, readers: int, hashers: dict[int, hashlib._Hash] | None = None,
                 stats: RingStats | None = None, timeline: Timeline | None = None) -> Readers:
    """Move every chunk from disk through the ring into its destinations.

    Reads run ahead in reader threads while the engine copies the slot before; a slot goes
    back to reading only when the event of its last copy completed (and, with ``hashers``, its
    bytes were hashed on the hash thread, in file order: the chunks must then cover each
    shard's data). The ring is the process's (:class:`StagingRing`), pinned on first use.

    Raises:
        ValueError: ``chunk`` is not a power of two, or the ring exceeds 64 MiB chunks / 512 MiB.
    """
    if (chunk & (chunk - 1) or chunk > DEFAULT_CHUNK or slots * chunk > MAX_RING_BYTES
            or slots < 1 or chunk < 1):
        raise ValueError(f"ring of {slots} x {chunk} bytes: chunks must be powers of two up to "
                         "64 MiB and the ring at most 512 MiB (PACKER_RING_SLOTS, PACKER_CHUNK_MB)")
    stats = stats or RingStats()
    size = min(chunk, 1 << max(max((c.nbytes for c in chunks), default=1) - 1, 0).bit_length())
    pool = Readers(readers, piece=max(size // 4, MIB))
    ring = staging_ring(engine.name)
    hasher = Hasher(hashers) if hashers is not None else None
    try:
        with ring.lock:
            try:
                slot_list, stats.pin_seconds = ring.take(engine, slots, size, chunk, timeline)
                stats.host_bytes, stats.host_kind = slots * ring.size, ring.kind
                stats.started = time.perf_counter()
                _drive(shards, deque(chunks), engine, slot_list, pool, hasher, stats)
            except BaseException:
                with contextlib.suppress(Exception):
                    engine.finish()  # no copy may still read a slot when the ring is reused
                raise
            finally:
                pool.close()
                if hasher is not None:
                    hasher.close()  # no hash may still read a slot either
    finally:
        engine.release()
    if hasher is not None and hasher.first is not None:
        stats.hash_seconds = hasher.last - hasher.first
        if timeline is not None:
            timeline.add("sha256 (hash thread)", hasher.first, hasher.last, hasher.nbytes, lane=4)
    return pool


def _reusable(slot: Slot, engine: CopyEngine) -> bool:
    return (slot.event is None or engine.query(slot.event)) and slot.hashed.is_set()


def _drive(shards: list[Shard], todo: deque[Chunk], engine: CopyEngine, ring: list[Slot], pool: Readers,
           hasher: Hasher | None, stats: RingStats) -> None:
    free: deque[Slot] = deque(ring)
    busy: deque[tuple[Slot, Chunk]] = deque()
    while todo or busy:
        while todo and free:
            slot = free[0]
            if not _reusable(slot, engine):
                if busy:
                    break  # issue the copies that are ready first
                if slot.event is not None:
                    engine.wait(slot.event)
                slot.hashed.wait()
            if hasher is not None and hasher.error is not None:
                raise hasher.error
            if not _reusable(slot, engine):
                stats.early_refills += 1
            free.popleft()
            c = todo.popleft()
            s = shards[c.shard]
            pool.submit(slot, Read(s.fd, c.offset, slot.view[: c.nbytes], s.label))
            busy.append((slot, c))
            copying = sum(1 for s in free if not _reusable(s, engine))
            stats.max_busy = max(stats.max_busy, len(busy) + copying)
            stats.chunks += 1
            stats.max_chunk = max(stats.max_chunk, c.nbytes)
        slot, c = busy.popleft()
        slot.wait()
        if hasher is not None:
            hasher.submit(slot, c.shard, c.nbytes)
        slot.event = engine.copy([(dst, slot.host[a: a + dst.numel()]) for a, dst in c.copies])
        free.append(slot)
    engine.finish()
    for slot in ring:
        slot.hashed.wait()
    if hasher is not None and hasher.error is not None:
        raise hasher.error


def run_ring(shards: list[Shard], chunks: list[Chunk], engine: CopyEngine, *, slots: int, chunk: int,
             readers: int, hashers: dict[int, hashlib._Hash] | None, timeline: Timeline) -> RingStats:
    """:func:`run_pipeline`, then the read and host->device stages on ``timeline``.

    The host->device stage starts once the ring is ready: pinning is its own stage.
    """
    stats = RingStats()
    pool = run_pipeline(shards, chunks, engine, slots=slots, chunk=chunk, readers=readers,
                        hashers=hashers, stats=stats, timeline=timeline)
    end = time.perf_counter()
    moved = sum(c.nbytes for c in chunks)
    if pool.first is not None:
        timeline.add("read", pool.first, pool.last, pool.nbytes, lane=1)
    timeline.add("host->device" if engine.name == "cuda" else "host->device (cpu engine)",
                 stats.started, end, moved, lane=2)
    return stats
