"""packer's runtime loader: gets a build's weights onto the device at the speed of the hardware.

This file is emitted into every build as ``packer_loader.py`` with the build's manifest
embedded (``packer.stub``); inside the package it is importable as ``packer.runtime.loader``
and driven through :class:`Loader` with an explicit manifest. It needs the standard library
and torch (imported lazily), plus zstandard for the bundle.

* CPU: tensors are views of a private copy-on-write mapping of each shard (no read at load).
* CUDA: headers by ``pread``; one device buffer per shard (or the module's own parameters);
  a bounded ring of pinned staging slots filled by reader threads (``os.preadv`` releases the
  GIL) while one CUDA stream copies the previous slot; one event per slot, a slot is refilled
  only after its copy completed. The copy engine is pluggable: tests run the very same
  scheduling against a CPU engine (a copy thread in place of the stream).

Run ``python packer_loader.py --selftest [--device cpu|cuda] [--verify]`` to check a build.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import queue
import struct
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# >>> packer:embedded (replaced by packer.stub when the loader is emitted)
_EMBEDDED_JSON: str | None = None
_BUNDLE_READER_SOURCE: str | None = None
# <<< packer:embedded

MIB = 2**20
DEFAULT_SLOTS = 4
DEFAULT_CHUNK = 64 * MIB
MAX_RING_BYTES = 512 * MIB
MAX_HEADER = 100 * MIB
_ENV = {"CUDA_MODULE_LOADING": "LAZY", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
_DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1), "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1), "I64": ("int64", 8), "I32": ("int32", 4),
    "I16": ("int16", 2), "I8": ("int8", 1), "U64": ("uint64", 8), "U32": ("uint32", 4),
    "U16": ("uint16", 2), "U8": ("uint8", 1), "BOOL": ("bool", 1),
}  # fmt: skip


class ArtifactMismatchError(RuntimeError):
    """The artifacts on disk do not match the manifest embedded in this loader."""


def _apply_env() -> None:
    """Set the CUDA start-up variables unless the user did; warn when it is already too late."""
    unset = [k for k in _ENV if k not in os.environ]
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if unset and cuda is not None and cuda.is_initialized():
        warnings.warn(f"packer_loader: CUDA was initialised before the loader was imported; "
                      f"{', '.join(unset)} cannot take effect (import the loader first)",
                      RuntimeWarning, stacklevel=3)  # fmt: skip
    for key in unset:
        os.environ[key] = _ENV[key]


_apply_env()


# ---------------------------------------------------------------------------------------
# stage timing


class Timeline:
    """Start-up stages with bytes and throughput; prints ``[startup] name: 1.02s`` lines."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.stages: list[dict[str, Any]] = []
        self._printed = 0
        self._lock = threading.Lock()

    def add(self, name: str, start: float, end: float, nbytes: int = 0, lane: int = 0) -> None:
        """Record a stage that ran from ``start`` to ``end`` (``time.perf_counter`` values)."""
        secs = max(end - start, 0.0)
        rec = {"stage": name, "start_s": round(start - self.t0, 6), "seconds": round(secs, 6),
               "bytes": nbytes, "gbps": round(nbytes / secs / 1e9, 3) if nbytes and secs else None,
               "lane": lane}  # fmt: skip
        with self._lock:
            self.stages.append(rec)

    @contextlib.contextmanager
    def stage(self, name: str, nbytes: int = 0) -> Iterator[dict[str, int]]:
        """Time a block; the block may set ``box["bytes"]``."""
        box = {"bytes": nbytes}
        start = time.perf_counter()
        try:
            yield box
        finally:
            self.add(name, start, time.perf_counter(), box["bytes"])

    def flush(self, stream: Any = None) -> None:
        """Print the stages recorded since the last flush and a total (``PACKER_STARTUP_LOG``)."""
        mode = os.environ.get("PACKER_STARTUP_LOG", "text").lower()
        with self._lock:
            new, self._printed = self.stages[self._printed:], len(self.stages)
        if not new or mode in ("off", "0", "none", "false"):
            return
        total = max(s["start_s"] + s["seconds"] for s in new) - min(s["start_s"] for s in new)
        out = stream or sys.stderr
        if mode == "json":
            out.write(json.dumps({"startup": new, "total_s": round(total, 6)}) + "\n")
        else:
            for s in [*new, {"stage": "total", "seconds": total, "bytes": 0}]:
                out.write(f"[startup] {s['stage']}: {_fmt_stage(s)}\n")
        out.flush()

    def chrome_trace(self, path: str | Path) -> None:
        """Write the stages as a Chrome trace-event file (Perfetto, chrome://tracing)."""
        events = [{"name": s["stage"], "ph": "X", "pid": os.getpid(), "tid": s["lane"],
                   "ts": round(s["start_s"] * 1e6, 3), "dur": round(s["seconds"] * 1e6, 3),
                   "args": {"bytes": s["bytes"], "gbps": s["gbps"]}} for s in self.stages]  # fmt: skip
        lanes = {0: "loader", 1: "reader threads", 2: "copy engine", 3: "prefetch"}
        events += [{"name": "thread_name", "ph": "M", "pid": os.getpid(), "tid": tid,
                    "args": {"name": name}} for tid, name in lanes.items()]  # fmt: skip
        data = json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, indent=1)
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(data + "\n")
        os.replace(tmp, path)


def _fmt_stage(s: dict[str, Any]) -> str:
    text = f"{s['seconds']:.2f}s"
    if s.get("bytes"):
        n = s["bytes"]
        text += f", {n / 1e9:.2f} GB" if n >= 1e8 else f", {n / 1e6:.2f} MB" if n >= 1e5 else f", {n} B"
        if s.get("gbps"):
            text += f", {s['gbps']:.2f} GB/s"
    return text


TIMELINE = Timeline()


def _torch(timeline: Timeline | None = None) -> Any:
    """Import torch, timing the import when this call is the one that pays for it."""
    if "torch" in sys.modules:
        return sys.modules["torch"]
    start = time.perf_counter()
    import torch

    (timeline or TIMELINE).add("import torch", start, time.perf_counter())
    return torch


def _dtype(code: str, where: str) -> tuple[Any, int]:
    if code not in _DTYPES:
        raise ArtifactMismatchError(f"{where}: dtype {code!r} is not supported by this loader")
    name, size = _DTYPES[code]
    dt = getattr(sys.modules["torch"], name, None)
    if dt is None:
        raise ArtifactMismatchError(f"{where}: dtype {code} needs a newer torch ({name})")
    return dt, size


# ---------------------------------------------------------------------------------------
# artifacts: files, headers and checks against the embedded manifest


class Shard:
    """One safetensors file, its header checked against the manifest, its fd open."""

    def __init__(self, rel: str, path: Path, fd: int, size: int, head: bytes,
                 tensors: list[tuple[str, str, list[int], int, int]]) -> None:  # fmt: skip
        self.rel, self.path, self.fd, self.size, self.head = rel, path, fd, size, head
        self.data_start = len(head)
        self.tensors = tensors  # (name, dtype code, shape, begin, end), sorted by begin

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _pread_exact(fd: int, n: int, offset: int, rel: str) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise ArtifactMismatchError(f"{rel}: truncated at byte {offset + len(data)}")
    return data


def open_shard(rel: str, path: Path, meta: dict[str, Any], table: dict[str, Any]) -> Shard:
    """Open ``path`` and check its size and safetensors header against the manifest.

    Raises:
        ArtifactMismatchError: missing file, wrong size, or a header that differs.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ArtifactMismatchError(f"{rel}: missing (looked for {path}); set PACKER_ARTIFACTS "
                                    "or PACKER_WEIGHTS_DIR to where the build put it") from None
    try:
        size = os.fstat(fd).st_size
        if size != meta["size"]:
            raise ArtifactMismatchError(f"{rel}: {size} bytes, the manifest says {meta['size']}; "
                                        "these weights are not from this build")  # fmt: skip
        n = struct.unpack("<Q", _pread_exact(fd, 8, 0, rel))[0]
        if n > min(size - 8, MAX_HEADER):
            raise ArtifactMismatchError(f"{rel}: header length {n} is impossible for {size} bytes")
        raw = _pread_exact(fd, n, 8, rel)
        tensors = _check_header(rel, raw, size - 8 - n, table)
        return Shard(rel, path, fd, size, struct.pack("<Q", n) + raw, tensors)
    except BaseException:
        os.close(fd)
        raise


def _check_header(rel: str, raw: bytes, data_len: int,
                  table: dict[str, Any]) -> list[tuple[str, str, list[int], int, int]]:  # fmt: skip
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ArtifactMismatchError(f"{rel}: safetensors header is not JSON ({e})") from None
    header.pop("__metadata__", None)
    want = {k: v for k, v in table.items() if v["file"] == rel}
    if set(header) != set(want):
        extra, gone = sorted(set(header) - set(want)), sorted(set(want) - set(header))
        raise ArtifactMismatchError(f"{rel}: header tensors differ from the manifest "
                                    f"(unexpected {extra[:3]}, missing {gone[:3]})")  # fmt: skip
    out = []
    for name, rec in want.items():
        got = header[name]
        for key in ("dtype", "shape", "data_offsets"):
            if list(got.get(key, [])) != list(rec[key]) if key != "dtype" else got.get(key) != rec[key]:
                raise ArtifactMismatchError(f"{rel}: tensor {name!r} {key} is {got.get(key)}, "
                                            f"the manifest says {rec[key]}")  # fmt: skip
        begin, end = rec["data_offsets"]
        if not 0 <= begin <= end <= data_len:
            raise ArtifactMismatchError(f"{rel}: tensor {name!r} lies outside the data section")
        out.append((name, rec["dtype"], list(rec["shape"]), begin, end))
    out.sort(key=lambda t: (t[3], t[0]))
    return out


def sha256_fd(fd: int, size: int, bufsize: int = 8 * MIB) -> str:
    """sha256 of the first ``size`` bytes of an open file, read with preadv."""
    h, buf, off = hashlib.sha256(), bytearray(bufsize), 0
    view = memoryview(buf)
    while off < size:
        n = os.preadv(fd, [view[: min(bufsize, size - off)]], off)
        if n <= 0:
            raise ArtifactMismatchError(f"short read at byte {off}")
        h.update(view[:n])
        off += n
    return h.hexdigest()


def _check_sha(rel: str, got: str, want: str) -> None:
    if got != want:
        raise ArtifactMismatchError(f"{rel}: sha256 {got[:16]}..., the manifest says "
                                    f"{want[:16]}...; the file is corrupt or from another build")  # fmt: skip


# ---------------------------------------------------------------------------------------
# the pipeline: reader threads fill a ring of staging slots, an engine copies them out


def _host_view(t: Any) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (pinned or not)."""
    import ctypes

    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


class CpuEngine:
    """The CPU stand-in for the CUDA engine: a copy thread is the stream, Events the events."""

    name = "cpu"

    def __init__(self, copy_delay: float = 0.0) -> None:
        self.torch = sys.modules["torch"]
        self.copy_delay = copy_delay  # tests slow the "stream" down to exercise waiting
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="packer-copy", daemon=True)
        self._thread.start()

    def host_buffer(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8)

    def device_buffer(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8)

    def copy(self, pairs: list[tuple[Any, Any]]) -> threading.Event:
        done = threading.Event()
        self._q.put((pairs, done))
        return done

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            pairs, done = item
            try:
                if self.copy_delay:
                    time.sleep(self.copy_delay)
                for dst, src in pairs:
                    dst.copy_(src)
            except BaseException as e:  # reported by wait()/finish()
                self._error = e
            done.set()

    def query(self, event: threading.Event) -> bool:
        return event.is_set()

    def wait(self, event: threading.Event) -> None:
        event.wait()
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error

    def release(self) -> None:
        pass


class CudaEngine:
    """Pinned staging slots and one dedicated CUDA stream; one event per slot copy."""

    name = "cuda"

    def __init__(self, device: Any) -> None:
        self.torch = sys.modules["torch"]
        self.device = device
        self.stream = self.torch.cuda.Stream(device=device)
        self._joined = False

    def host_buffer(self, nbytes: int) -> Any:
        buf = self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True)
        if not buf.is_pinned():  # non_blocking from pageable memory is silently synchronous
            raise RuntimeError("packer_loader: could not allocate pinned staging memory")
        return buf

    def device_buffer(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)

    def copy(self, pairs: list[tuple[Any, Any]]) -> Any:
        if not self._joined:  # destinations may still be in use by kernels queued before us
            self.stream.wait_stream(self.torch.cuda.current_stream(self.device))
            self._joined = True
        with self.torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event = self.torch.cuda.Event()
            event.record(self.stream)
        return event

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def wait(self, event: Any) -> None:
        event.synchronize()

    def finish(self) -> None:
        self.stream.synchronize()
        self.torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def release(self) -> None:
        empty = getattr(self.torch._C, "_host_emptyCache", None)
        if empty is not None:  # hand the pinned ring back instead of caching it for ever
            empty()


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


# ---------------------------------------------------------------------------------------
# tensors out of buffers


def tensor_view(torch: Any, buf: Any, begin: int, end: int, code: str, shape: list[int],
                where: str) -> Any:  # fmt: skip
    """A tensor of ``buf[begin:end]`` (a uint8 buffer); misaligned bytes get a same-device copy."""
    dt, size = _dtype(code, where)
    raw = buf[begin:end]
    if begin % size:
        raw = raw.clone()  # view(dtype) needs element alignment; the copy stays on the device
    return raw.view(dt).view(tuple(shape))


def _anonymous(torch: Any, nbytes: int) -> Any:
    """A private CPU buffer on transparent huge pages where the kernel allows them.

    Faulting fresh memory in 4 KiB pages costs more than the copy into it; 2 MiB pages make
    a private copy run at the speed of one read. The tensor keeps the mapping alive.
    """
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            mm.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mm, dtype=torch.uint8)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


class Loader:
    """A build's artifacts under ``root``, checked against ``manifest``; the loader's verbs.

    Args:
        manifest: the embedded manifest (files, weights tensor table, aliases, bundle).
        root: artifact root; weight files resolve under ``weights_dir`` when given.
        weights_dir: directory that holds the ``model*.safetensors`` files (mounted weights).
        timeline: where stage timings go (the process-wide one by default).
    """

    def __init__(self, manifest: dict[str, Any], root: str | Path, *,
                 weights_dir: str | Path | None = None,
                 timeline: Timeline | None = None) -> None:  # fmt: skip
        self.manifest = manifest
        self.root = Path(root)
        self.weights_dir = Path(weights_dir) if weights_dir else None
        self.timeline = timeline or TIMELINE
        self.last_stats: RingStats | None = None
        self.auto_flush = True  # print the stage table after each verb (the self-test prints once)
        self.slots = _env_int("PACKER_RING_SLOTS", DEFAULT_SLOTS)
        self.chunk = _env_int("PACKER_CHUNK_MB", DEFAULT_CHUNK // MIB) * MIB
        self.readers = _env_int("PACKER_READERS", min(8, os.cpu_count() or 1))

    def path(self, rel: str) -> Path:
        """Where the artifact ``rel`` (a manifest path) is on this machine."""
        if self.weights_dir is not None and rel.startswith("weights/"):
            return self.weights_dir / rel[len("weights/"):]
        return self.root / rel

    def open_shards(self, verify: bool = False) -> list[Shard]:
        """Open and check every weight file (size, header; sha256 when ``verify``)."""
        w = self.manifest["weights"]
        files = self.manifest["files"]
        shards: list[Shard] = []
        with self.timeline.stage("headers") as box:
            try:
                for rel in w["files"]:
                    shards.append(open_shard(rel, self.path(rel), files[rel], w["tensors"]))
                    box["bytes"] += shards[-1].data_start
                if w.get("index"):
                    self._check_plain(w["index"], verify)
            except BaseException:
                for s in shards:
                    s.close()
                raise
        return shards

    def _check_plain(self, rel: str, verify: bool) -> None:
        path, meta = self.path(rel), self.manifest["files"].get(rel) or self.manifest["bundle"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise ArtifactMismatchError(f"{rel}: missing (looked for {path})") from None
        if size != meta["size"]:
            raise ArtifactMismatchError(f"{rel}: {size} bytes, the manifest says {meta['size']}")
        if verify:
            fd = os.open(path, os.O_RDONLY)
            try:
                _check_sha(rel, sha256_fd(fd, size), meta["sha256"])
            finally:
                os.close(fd)

    def _verify_shards(self, shards: list[Shard]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with self.timeline.stage("verify sha256") as box, ThreadPoolExecutor(self.readers) as ex:
            # hashlib releases the GIL: shards hash in parallel
            digests = list(ex.map(lambda s: sha256_fd(s.fd, s.size), shards))
            for s, digest in zip(shards, digests, strict=True):
                _check_sha(s.rel, digest, self.manifest["files"][s.rel]["sha256"])
                box["bytes"] += s.size

    def load_weights(self, device: str = "cuda", *, dtype: Any = None, verify: bool = False,
                     pipeline: bool | None = None, copy: bool = False) -> dict[str, Any]:  # fmt: skip
        """Load every tensor; aliases of tied tensors are the same tensor object.

        Args:
            device: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``.
            dtype: cast floating-point tensors to this torch dtype (on the device).
            verify: also check every file's sha256 (a full read).
            pipeline: use the staging ring (default: only for CUDA); on CPU this runs the
                CUDA scheduling against the CPU engine.
            copy: CPU only: private materialised tensors read with parallel preadv instead
                of views of a mapping.

        Returns:
            ``{name: tensor}`` including the alias names.

        Raises:
            ArtifactMismatchError: a file is missing, has another size, header or sha256.
        """
        torch = _torch(self.timeline)
        dev = self._device(torch, device)
        use_ring = dev.type != "cpu" if pipeline is None else pipeline
        shards = self.open_shards(verify=verify)
        try:
            if dev.type == "cpu" and not use_ring:
                if verify:
                    self._verify_shards(shards)
                bufs = self._direct(torch, shards) if copy else self._mapped(torch, shards)
            else:
                bufs = self._ringed(torch, dev, shards, verify)
            out = self._tensors(torch, shards, bufs, dtype)
        finally:
            for s in shards:
                s.close()
        if self.auto_flush:
            self.timeline.flush()
        return out

    def _device(self, torch: Any, device: str) -> Any:
        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"packer_loader: device {device!r}: only 'cpu', 'cuda' and 'cuda:N'")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"packer_loader: device {device!r} asked for but CUDA is not available "
                               "(torch.cuda.is_available() is False); use device='cpu'")  # fmt: skip
        if dev.type == "cuda" and not torch.cuda.is_initialized():
            with self.timeline.stage("CUDA init"):
                torch.cuda.init()
                torch.empty(0, device=dev)
        return dev

    def _mapped(self, torch: Any, shards: list[Shard]) -> list[tuple[Any, int]]:
        """Views of a private copy-on-write mapping per shard; the tensors keep it alive."""
        out = []
        with self.timeline.stage("map"):
            for s in shards:
                mm = mmap.mmap(s.fd, s.size, access=mmap.ACCESS_COPY)
                out.append((torch.frombuffer(mm, dtype=torch.uint8), s.data_start))
        return out

    def _direct(self, torch: Any, shards: list[Shard]) -> list[tuple[Any, int]]:
        """Private CPU buffers filled by the reader threads straight from the files."""
        with self.timeline.stage("read") as box:
            out = [(_anonymous(torch, s.size - s.data_start), 0) for s in shards]
            self._read_into([(s.fd, s.data_start, _host_view(b)) for s, (b, _) in zip(shards, out, strict=True)])
            box["bytes"] = sum(s.size - s.data_start for s in shards)
        return out

    def _read_into(self, reads: list[tuple[int, int, memoryview]]) -> None:
        """Parallel preadv of ``(fd, offset, destination)`` straight into CPU memory."""
        pool, latch = Readers(self.readers, piece=8 * MIB), Latch()
        try:
            pool.submit_many(latch, [r for r in reads if len(r[2])])
            latch.wait()
        finally:
            pool.close()

    def _ringed(self, torch: Any, dev: Any, shards: list[Shard],
                verify: bool) -> list[tuple[Any, int]]:  # fmt: skip
        engine = CudaEngine(dev) if dev.type == "cuda" else CpuEngine()
        start = time.perf_counter()
        bufs = [engine.device_buffer(s.size - s.data_start) for s in shards]
        segs = [(i, s.data_start, s.size - s.data_start, bufs[i]) for i, s in enumerate(shards)]
        hashers = None
        if verify:
            hashers = {i: hashlib.sha256(s.head) for i, s in enumerate(shards)}
        self._run_ring(shards, plan_chunks(segs, self.chunk), engine, hashers, start)
        if hashers is not None:
            for i, s in enumerate(shards):
                _check_sha(s.rel, hashers[i].hexdigest(), self.manifest["files"][s.rel]["sha256"])
        return [(b, 0) for b in bufs]

    def _run_ring(self, shards: list[Shard], chunks: list[Chunk], engine: Any,
                  hashers: dict[int, Any] | None, start: float) -> None:  # fmt: skip
        stats = RingStats()
        pool = run_pipeline(shards, chunks, engine, slots=self.slots, chunk=self.chunk,
                            readers=self.readers, hashers=hashers, stats=stats)  # fmt: skip
        end = time.perf_counter()
        self.last_stats = stats
        moved = sum(c.nbytes for c in chunks)
        if pool.first is not None:
            self.timeline.add("read", pool.first, pool.last, pool.nbytes, lane=1)
        self.timeline.add("host->device" if engine.name == "cuda" else "host->device (cpu engine)",
                          start, end, moved, lane=2)  # fmt: skip

    def _tensors(self, torch: Any, shards: list[Shard], bufs: list[tuple[Any, int]],
                 dtype: Any) -> dict[str, Any]:  # fmt: skip
        out: dict[str, Any] = {}
        for s, (buf, base) in zip(shards, bufs, strict=True):
            for name, code, shape, begin, end in s.tensors:
                t = tensor_view(torch, buf, base + begin, base + end, code, shape,
                                f"{s.rel}: tensor {name!r}")  # fmt: skip
                if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                    t = t.to(dtype)
                out[name] = t
        for alias, kept in sorted(self.manifest["weights"].get("aliases", {}).items()):
            out[alias] = out[kept]
        return out

    def load_into(self, module: Any, *, device: str | None = None, strict: bool = True,
                  verify: bool = False, pipeline: bool | None = None) -> tuple[list[str], list[str]]:  # fmt: skip
        """Copy the weights straight into ``module``'s parameters and buffers.

        Args:
            module: a ``torch.nn.Module`` already on its target device.
            device: accepted for symmetry; must match where the module's tensors live.
            strict: raise when keys are missing or unexpected (as ``load_state_dict``).
            verify: also check every file's sha256.
            pipeline: force (or refuse) the staging ring; CUDA always uses it.

        Returns:
            ``(missing, unexpected)`` key lists.

        Raises:
            ArtifactMismatchError: artifacts that do not match; RuntimeError: key or shape
            mismatch between the weights and the module.
        """
        torch = _torch(self.timeline)
        targets, missing, unexpected = self._targets(module)
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_into: missing keys {missing[:8]}, unexpected keys "
                               f"{unexpected[:8]} (pass strict=False to load the rest)")  # fmt: skip
        devices = {t.device for ts in targets.values() for t in ts}
        if len(devices) > 1:
            raise RuntimeError(f"load_into: the module spans devices {sorted(map(str, devices))}")
        dev = devices.pop() if devices else torch.device(device or "cpu")
        if dev.type not in ("cpu", "cuda"):
            raise RuntimeError(f"load_into: the module's tensors are on {dev}; allocate them on "
                               "cpu or cuda first (e.g. module.to_empty(device='cuda'))")  # fmt: skip
        if device is not None and torch.device(device).type != dev.type:
            raise RuntimeError(f"load_into: the module lives on {dev}, not {device}; move it first")
        shards = self.open_shards(verify=verify)
        try:
            if verify:
                self._verify_shards(shards)
            with torch.no_grad():
                if dev.type == "cpu" and not pipeline:
                    self._into_cpu(torch, shards, targets)
                else:
                    self._into_ring(torch, dev, shards, targets)
        finally:
            for s in shards:
                s.close()
        if self.auto_flush:
            self.timeline.flush()
        return missing, unexpected

    def _targets(self, module: Any) -> tuple[dict[str, list[Any]], list[str], list[str]]:
        """Module tensors per stored tensor name (aliases folded), missing and unexpected keys."""
        w = self.manifest["weights"]
        table, aliases = w["tensors"], w.get("aliases", {})
        state = module.state_dict(keep_vars=True)
        names = set(table) | set(aliases)
        targets: dict[str, list[Any]] = {}
        for key, t in state.items():
            if key in names:
                want = table[aliases.get(key, key)]["shape"]
                if list(t.shape) != list(want):
                    raise RuntimeError(f"load_into: size mismatch for {key}: the weights have shape "
                                       f"{want}, the module {list(t.shape)}")  # fmt: skip
                targets.setdefault(aliases.get(key, key), []).append(t)
        return targets, sorted(set(state) - names), sorted(names - set(state))

    def _into_cpu(self, torch: Any, shards: list[Shard], targets: dict[str, list[Any]]) -> None:
        """preadv straight into the parameters; a mapped view only where dtypes differ."""
        reads, rest = [], []
        with self.timeline.stage("read into module") as box:
            for s in shards:
                for name, code, _, begin, end in s.tensors:
                    ts = targets.get(name, [])
                    if ts and ts[0].dtype == _dtype(code, name)[0] and ts[0].is_contiguous():
                        reads.append((s.fd, s.data_start + begin, _host_view(ts[0].detach())))
                        box["bytes"] += end - begin
                        rest += [(t, ts[0]) for t in ts[1:] if t.data_ptr() != ts[0].data_ptr()]
                    elif ts:
                        rest += [(t, name) for t in ts]
            self._read_into(reads)
            views = self._tensors(torch, shards, self._mapped(torch, shards), None) if rest else {}
            for t, src in rest:  # ties and dtype casts, from memory already read or mapped
                t.copy_(views[src] if isinstance(src, str) else src)

    def _into_ring(self, torch: Any, dev: Any, shards: list[Shard],
                   targets: dict[str, list[Any]]) -> None:  # fmt: skip
        """Stream straight into the parameters; a staging tensor only where dtypes differ."""
        engine = CudaEngine(dev) if dev.type == "cuda" else CpuEngine()
        start = time.perf_counter()
        segs: list[tuple[int, int, int, Any]] = []
        later: list[tuple[list[Any], Any, str, list[int], str]] = []
        for i, s in enumerate(shards):
            for name, code, shape, begin, end in s.tensors:
                ts = targets.get(name)
                if not ts or end == begin:
                    continue
                first = ts[0].detach()
                if first.dtype == _dtype(code, name)[0] and first.is_contiguous():
                    segs.append((i, s.data_start + begin, end - begin,
                                 first.view(-1).view(torch.uint8)))  # fmt: skip
                    rest = [t for t in ts[1:] if t.data_ptr() != first.data_ptr()]
                    if rest:
                        later.append((rest, first, "", [], name))
                else:
                    tmp = engine.device_buffer(end - begin)
                    segs.append((i, s.data_start + begin, end - begin, tmp))
                    later.append((ts, tmp, code, shape, name))
        self._run_ring(shards, plan_chunks(segs, self.chunk), engine, None, start)
        for ts, src, code, shape, name in later:
            if code:
                src = tensor_view(torch, src, 0, src.numel(), code, shape, name)
            for t in ts:
                t.copy_(src)  # device-side cast or tie: never through the host again

    def bundle_dir(self) -> Path:
        """Extract the bundle once (content-addressed cache) and return its directory.

        Raises:
            ArtifactMismatchError: no bundle in this build, or it does not match.
        """
        b = self.manifest.get("bundle")
        if not b:
            raise ArtifactMismatchError("this build has no bundle (no tokenizer/config files)")
        rel = b["file"]
        self._check_plain(rel, verify=False)
        reader = bundle_reader()
        with self.timeline.stage("bundle", b["size"]):
            try:
                out = reader.extract_cached(self.path(rel), os.environ.get("PACKER_BUNDLE_CACHE"),
                                            expected_sha256=b["sha256"])  # fmt: skip
            except (reader.BundleFormatError, OSError) as e:
                raise ArtifactMismatchError(f"{rel}: {e}") from None
        if self.auto_flush:
            self.timeline.flush()
        return Path(out)

    def prefetch(self, *, background: bool = True) -> threading.Thread | None:
        """Warm the page cache with the weight files (fadvise WILLNEED, then parallel reads).

        Returns:
            the background thread (``join()`` it to wait), or None when run in the foreground.
        """
        paths = [self.path(rel) for rel in self.manifest["weights"]["files"]]
        if not background:
            _prefetch(paths, self.readers, self.timeline)
            return None
        t = threading.Thread(target=_prefetch, args=(paths, self.readers, self.timeline),
                             name="packer-prefetch", daemon=True)  # fmt: skip
        t.start()
        return t

    def report(self, trace: str | Path | None = None) -> list[dict[str, Any]]:
        """The stage timings so far; with ``trace``, also a Chrome trace-event JSON file."""
        if trace is not None:
            self.timeline.chrome_trace(trace)
        return [dict(s) for s in self.timeline.stages]


def _prefetch(paths: list[Path], threads: int, timeline: Timeline) -> None:
    start, blocks, fds = time.perf_counter(), queue.SimpleQueue(), []  # type: ignore[var-annotated]
    total = 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue  # advisory: the load itself reports missing files
        fds.append(fd)
        size = os.fstat(fd).st_size
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
        for off in range(0, size, 16 * MIB):
            blocks.put((fd, off))
        total += size

    def work() -> None:
        scratch = bytearray(16 * MIB)
        while True:
            try:
                fd, off = blocks.get_nowait()
            except queue.Empty:
                return
            os.preadv(fd, [scratch], off)

    workers = [threading.Thread(target=work, daemon=True) for _ in range(max(threads, 1))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for fd in fds:
        os.close(fd)
    timeline.add("prefetch", start, time.perf_counter(), total, lane=3)


def bundle_reader() -> Any:
    """The bundle reader module: the copy inlined at emit time, else the package's."""
    if _BUNDLE_READER_SOURCE is None:
        import importlib

        return importlib.import_module("packer.runtime.bundle_reader")
    name = "packer_loader_bundle_reader"
    if name not in sys.modules:
        import types

        mod = types.ModuleType(name)
        mod.__file__ = __file__
        sys.modules[name] = mod  # dataclasses look their module up while the class is built
        exec(compile(_BUNDLE_READER_SOURCE, f"{__file__}:bundle_reader", "exec"), mod.__dict__)
    return sys.modules[name]


# ---------------------------------------------------------------------------------------
# warm-up and the CUDA graph pool


class Captured:
    """One captured shape: static inputs to fill, ``replay`` to run, static outputs to read."""

    def __init__(self, replay: Callable[[], Any], inputs: list[Any], output: Any) -> None:
        self.replay, self.inputs, self.output = replay, inputs, output


def _split(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], tuple[Any, ...]]:
    """Tensors in call order and a hashable signature (shapes, dtypes, devices, constants)."""
    torch = sys.modules["torch"]
    tensors: list[Any] = []
    sig: list[tuple[Any, ...]] = []
    for key, v in [*enumerate(args), *sorted(kwargs.items())]:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            sig.append((key, "T", tuple(v.shape), str(v.dtype), str(v.device)))
        else:
            sig.append((key, "V", type(v).__name__, v if v.__hash__ is not None else id(v)))
    return tensors, tuple(sig)


def _rebuild(args: tuple[Any, ...], kwargs: dict[str, Any],
             tensors: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:  # fmt: skip
    torch = sys.modules["torch"]
    it = iter(tensors)
    new_args = tuple(next(it) if isinstance(v, torch.Tensor) else v for v in args)
    new_kwargs = {k: next(it) if isinstance(v, torch.Tensor) else v
                  for k, v in sorted(kwargs.items())}  # fmt: skip
    return new_args, new_kwargs


def _clone_out(out: Any) -> Any:
    torch = sys.modules["torch"]
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_clone_out(o) for o in out)
    if isinstance(out, dict):
        return {k: _clone_out(v) for k, v in out.items()}
    return out


def cuda_capture(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 pool: Any) -> Captured:  # fmt: skip
    """Capture ``model(*args, **kwargs)`` into a CUDA graph sharing the memory ``pool``."""
    torch = sys.modules["torch"]
    tensors, _ = _split(args, kwargs)
    static = [t.clone() for t in tensors]
    sargs, skw = _rebuild(args, kwargs, static)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(3):  # capture needs the lazy initialisations done, off the main stream
            model(*sargs, **skw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
        out = model(*sargs, **skw)
    return Captured(graph.replay, static, out)


class GraphPool:
    """Calls ``model``: replays a captured graph when the input shapes match one, else runs it.

    Outputs of a replay are cloned, so a later call never overwrites what a caller holds.
    """

    def __init__(self, model: Any, capture: Callable[..., Captured] | None = None) -> None:
        self.model = model
        self.capture_fn = capture or cuda_capture
        self.graphs: dict[tuple[Any, ...], Captured] = {}
        self.replays = 0
        self.fallbacks = 0
        self.mempool: Any = None

    def capture(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Capture one shape; on failure keep running that shape eagerly (warn, no raise)."""
        _, sig = _split(args, kwargs)
        try:
            self.graphs[sig] = self.capture_fn(self.model, args, kwargs, self.mempool)
        except Exception as e:  # an op that cannot be captured: correctness first
            warnings.warn(f"packer_loader: CUDA graph capture failed for {sig}: {e}",
                          RuntimeWarning, stacklevel=2)  # fmt: skip
            return False
        return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        torch = sys.modules["torch"]
        tensors, sig = _split(args, kwargs)
        entry = self.graphs.get(sig)
        with torch.inference_mode():
            if entry is None:
                self.fallbacks += 1
                return self.model(*args, **kwargs)
            for dst, src in zip(entry.inputs, tensors, strict=True):
                dst.copy_(src)
            entry.replay()
            self.replays += 1
            return _clone_out(entry.output)


def _as_call(example: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example, dict):
        return (), dict(example)
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    return (example,), {}


def warmup(model: Any, example_inputs: list[Any], *, cudnn_benchmark: bool = True,
           cuda_graphs: bool = False, iters: int = 3,
           timeline: Timeline | None = None) -> GraphPool:  # fmt: skip
    """Run each example a few times (cuDNN autotune); optionally capture one graph per shape.

    Args:
        model: the module (or any callable) to warm up.
        example_inputs: examples; each a tensor, a tuple of positional args or a kwargs dict.
        cudnn_benchmark: turn on ``torch.backends.cudnn.benchmark`` first.
        cuda_graphs: capture one CUDA graph per example shape (CUDA inputs only).
        iters: eager runs per example.

    Returns:
        a callable that replays a captured graph for a known shape and runs the model
        normally for any other (under ``torch.inference_mode``).
    """
    timeline = timeline or TIMELINE
    torch = _torch(timeline)
    pool = GraphPool(model)
    calls = [_as_call(x) for x in example_inputs]
    with timeline.stage("warm-up"):
        if cudnn_benchmark:
            torch.backends.cudnn.benchmark = True
        with torch.inference_mode():
            for args, kwargs in calls:
                for _ in range(iters):
                    model(*args, **kwargs)
        if cuda_graphs and torch.cuda.is_available():
            pool.mempool = torch.cuda.graph_pool_handle()
            for args, kwargs in calls:
                tensors, _ = _split(args, kwargs)
                if tensors and all(t.is_cuda for t in tensors):
                    pool.capture(args, kwargs)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    timeline.flush()
    return pool


# ---------------------------------------------------------------------------------------
# module-level API (the emitted file's manifest and root) and the self-test

_LOADERS: dict[tuple[str, str], Loader] = {}


def manifest() -> dict[str, Any]:
    """The manifest embedded in this loader.

    Raises:
        RuntimeError: this is the package copy, which has none.
    """
    if _EMBEDDED_JSON is None:
        raise RuntimeError("packer.runtime.loader has no embedded manifest: use the "
                           "packer_loader.py a build emitted, or Loader(manifest, root)")  # fmt: skip
    data: dict[str, Any] = json.loads(_EMBEDDED_JSON)
    return data


def default_loader(root: str | Path | None = None) -> Loader:
    """The loader for ``root`` (else ``$PACKER_ARTIFACTS``, else this file's directory)."""
    base = root or os.environ.get("PACKER_ARTIFACTS") or Path(__file__).resolve().parent
    wdir = os.environ.get("PACKER_WEIGHTS_DIR", "")
    key = (str(base), wdir)
    if key not in _LOADERS:
        _LOADERS[key] = Loader(manifest(), base, weights_dir=wdir or None)
    return _LOADERS[key]


def warmup_inputs(device: str = "cuda") -> list[dict[str, Any]]:
    """Zero-filled example inputs from the recipe's ``[runtime] warmup`` shapes, one per entry."""
    torch = _torch()
    return [{w["name"]: torch.zeros(tuple(w["shape"]), dtype=getattr(torch, w.get("dtype", "int64")),
                                    device=device)}
            for w in manifest().get("runtime", {}).get("warmup", [])]  # fmt: skip


def load_weights(device: str = "cuda", *, dtype: Any = None, verify: bool = False,
                 root: str | Path | None = None, pipeline: bool | None = None,
                 copy: bool = False) -> dict[str, Any]:  # fmt: skip
    """Load this build's weights; see :meth:`Loader.load_weights`."""
    return default_loader(root).load_weights(device, dtype=dtype, verify=verify,
                                             pipeline=pipeline, copy=copy)  # fmt: skip


def load_into(module: Any, *, device: str | None = None, strict: bool = True,
              verify: bool = False, root: str | Path | None = None) -> tuple[list[str], list[str]]:  # fmt: skip
    """Copy this build's weights into ``module``; see :meth:`Loader.load_into`."""
    return default_loader(root).load_into(module, device=device, strict=strict, verify=verify)


def bundle_dir(*, root: str | Path | None = None) -> Path:
    """The extracted bundle directory; see :meth:`Loader.bundle_dir`."""
    return default_loader(root).bundle_dir()


def prefetch(*, background: bool = True, root: str | Path | None = None) -> threading.Thread | None:
    """Warm the page cache with this build's weights; see :meth:`Loader.prefetch`."""
    return default_loader(root).prefetch(background=background)


def report(trace: str | Path | None = None) -> list[dict[str, Any]]:
    """Stage timings of this process so far; ``trace`` also writes a Chrome trace file."""
    if trace is not None:
        TIMELINE.chrome_trace(trace)
    return [dict(s) for s in TIMELINE.stages]


def check_loaded(loader: Loader, tensors: dict[str, Any]) -> list[str]:
    """Compare every loaded tensor's bytes with the file; return the problems found."""
    torch = sys.modules["torch"]
    problems = []
    w = loader.manifest["weights"]
    for alias, kept in w.get("aliases", {}).items():
        if tensors.get(alias) is not tensors.get(kept):
            problems.append(f"alias {alias!r} is not the same tensor as {kept!r}")
    quiet = Loader(loader.manifest, loader.root, weights_dir=loader.weights_dir, timeline=Timeline())
    shards = quiet.open_shards()
    try:
        for s in shards:
            for name, code, shape, begin, end in s.tensors:
                t = tensors[name]
                if t.dtype != _dtype(code, name)[0] or list(t.shape) != shape:
                    problems.append(f"{s.rel}: tensor {name!r} has {t.dtype} {list(t.shape)}")
                    continue
                raw = bytearray(_pread_exact(s.fd, end - begin, s.data_start + begin, s.rel))
                got = t.detach().reshape(-1).view(torch.uint8).cpu()
                if end > begin and not torch.equal(got, torch.frombuffer(raw, dtype=torch.uint8)):
                    problems.append(f"{s.rel}: tensor {name!r} bytes differ from the file")
    finally:
        for s in shards:
            s.close()
    return problems


def selftest(loader: Loader, device: str, verify: bool) -> list[str]:
    """Load everything, compare it with the files (and the bundle); return the problems."""
    tensors = loader.load_weights(device, verify=verify)
    with loader.timeline.stage("check", sum(s["size"] for s in loader.manifest["files"].values())):
        problems = check_loaded(loader, tensors)
        if loader.manifest.get("bundle"):
            root = loader.bundle_dir()
            for m in loader.manifest["bundle"].get("members", []):
                p = root / m["name"]
                if not p.is_file() or p.stat().st_size != m["size"]:
                    problems.append(f"bundle member {m['name']!r} missing or of another size")
                elif verify and hashlib.sha256(p.read_bytes()).hexdigest() != m["sha256"]:
                    problems.append(f"bundle member {m['name']!r}: sha256 differs")
    return problems


def main(argv: list[str] | None = None) -> int:
    """``--selftest [--device cpu|cuda] [--verify] [--root DIR] [--trace FILE]``; exit 0 or 1."""
    import argparse

    ap = argparse.ArgumentParser(prog="packer_loader.py", description=__doc__.splitlines()[0])
    ap.add_argument("--selftest", action="store_true", help="load and check every artifact")
    ap.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: the recipe's)")
    ap.add_argument("--verify", action="store_true", help="also check sha256 of every file")
    ap.add_argument("--root", default=None, help="artifact directory (default: beside this file)")
    ap.add_argument("--trace", default=None, help="write a Chrome trace-event file")
    args = ap.parse_args(argv)
    if not args.selftest:
        ap.print_help(sys.stderr)
        return 2
    try:
        loader = default_loader(args.root)
        loader.auto_flush = False
        torch = _torch(loader.timeline)
        device = args.device or loader.manifest.get("runtime", {}).get("device", "cuda")
        if device == "cuda" and args.device is None and not torch.cuda.is_available():
            device = "cpu"
        problems = selftest(loader, device, args.verify)
    except Exception as e:  # any failure is a failed self-test, reported in one line
        TIMELINE.flush()
        sys.stderr.write(f"packer_loader: self-test failed: {e}\n")
        return 1
    TIMELINE.flush()
    if args.trace:
        TIMELINE.chrome_trace(args.trace)
    for p in problems:
        sys.stderr.write(f"packer_loader: {p}\n")
    if problems:
        sys.stderr.write(f"packer_loader: self-test failed: {len(problems)} problem(s)\n")
        return 1
    sys.stderr.write(f"packer_loader: self-test passed ({len(loader.manifest['weights']['tensors'])} "
                     f"tensors on {device})\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
