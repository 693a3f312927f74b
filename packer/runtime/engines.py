"""Copy engines: where staged bytes go. CUDA (pinned slots, one stream) or a CPU stand-in.

Both engines satisfy :class:`CopyEngine` (``host_buffer``, ``device_buffer``, ``copy``,
``query``, ``wait``, ``finish``, ``release``), so the ring's scheduling runs unchanged in tests
against the CPU engine, whose copy thread plays the part of the CUDA stream.

Host buffers come with a ``free`` callable: the ring keeps them for the whole process and
frees them only on request. CUDA staging memory is an anonymous mapping registered with
``cudaHostRegister``, so freeing it unregisters exactly those pages; the process-wide pinned
cache of PyTorch (other libraries' blocks) is never emptied. Device buffers start at
``ALIGN``-byte boundaries.
"""

from __future__ import annotations

import contextlib
import mmap
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .timeline import import_torch

if TYPE_CHECKING:
    from types import ModuleType

    import torch


@runtime_checkable
class CopyEngine(Protocol):
    """Where the ring's staged bytes go: the CUDA engine, or a stand-in with the same scheduling.

    An engine hands out buffers and copies staging slots to their destinations in the order
    given, asynchronously; each :meth:`copy` returns an event that completes once its copies
    are done. The ring refills a slot only after :meth:`query` or :meth:`wait` saw its event.
    """

    name: str  # the staging ring's key ("cuda", "cpu"); "cuda" names the host->device stage

    def host_buffer(self, nbytes: int) -> tuple[torch.Tensor, Callable[[], None], str]:
        """``nbytes`` of staging memory (uint8 CPU tensor), its ``free`` callable, how it was had."""
        ...

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        """An ``ALIGN``-aligned uint8 tensor of ``nbytes`` on the target device."""
        ...

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Queue ``dst.copy_(src)`` for each ``(dst, src)``; the event of the last one."""
        ...

    def query(self, event: Any) -> bool:
        """Whether ``event``'s copies are done (never blocks)."""
        ...

    def wait(self, event: Any) -> None:
        """Block until ``event``'s copies are done; raise an error a copy met."""
        ...

    def finish(self) -> None:
        """Block until every queued copy is done (the device's current stream waits for them)."""
        ...

    def release(self) -> None:
        """Drop what this engine holds for one load (the ring's memory is not the engine's)."""
        ...


def host_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (pinned or not)."""
    import ctypes

    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


ALIGN = 256  # device tensors start at multiples of this (cudaMalloc gives 256 at least)
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


def _nothing() -> None:
    pass


def _aligned_empty(torch: ModuleType, nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``nbytes`` uint8 starting at an ``ALIGN``-byte address (CPU allocations give 64)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, device=device)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip: skip + nbytes]


def pinned_buffer(torch: ModuleType, nbytes: int) -> tuple[torch.Tensor, Callable[[], None], str]:
    """``nbytes`` of page-locked host memory, its ``free`` callable and how it was pinned.

    An anonymous mapping registered with ``cudaHostRegister`` (``"registered"``); where that
    binding is missing or refuses, a block of PyTorch's pinned allocator (``"torch-pinned"``,
    which stays in PyTorch's cache once freed). Neither empties anyone's pinned cache.

    Raises:
        RuntimeError: no pinned memory could be had (copies from pageable memory would be
            silently synchronous).
    """
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    cudart = getattr(torch.cuda, "cudart", None)
    try:
        rt = cudart() if cudart is not None else None
        err = rt.cudaHostRegister(buf.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE) if rt else -1
    except (AttributeError, RuntimeError, TypeError):
        rt, err = None, -1
    if rt is not None and int(err) == 0:  # page-locked: copies from it are truly asynchronous
        ptr = buf.data_ptr()

        def free() -> None:
            rt.cudaHostUnregister(ptr)  # the mapping goes with the last tensor that views it

        return buf, free, "registered"
    del buf
    with contextlib.suppress(BufferError):
        mm.close()
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if not buf.is_pinned():  # non_blocking from pageable memory is silently synchronous
        raise RuntimeError("packer_loader: could not allocate pinned staging memory")
    return buf, _nothing, "torch-pinned"


class CpuEngine:
    """The CPU stand-in for the CUDA engine: a copy thread is the stream, Events the events."""

    name = "cpu"

    def __init__(self, copy_delay: float = 0.0) -> None:
        self.torch = import_torch()  # imported here when the caller has not (it is lazy everywhere)
        self.copy_delay = copy_delay  # tests slow the "stream" down to exercise waiting
        self._q: queue.SimpleQueue[tuple[list[tuple[torch.Tensor, torch.Tensor]], threading.Event] | None] = (
            queue.SimpleQueue())
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="packer-copy", daemon=True)
        self._thread.start()

    def host_buffer(self, nbytes: int) -> tuple[torch.Tensor, Callable[[], None], str]:
        return self.torch.empty(nbytes, dtype=self.torch.uint8), _nothing, "cpu"

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return _aligned_empty(self.torch, nbytes)

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> threading.Event:
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
    """Pinned staging slots and one dedicated CUDA stream; one event per slot copy.

    ``stall_cycles`` (race hunting) makes the stream spin that many GPU clock cycles before
    each copy (``torch.cuda._sleep``): copies then lag far behind reads, so any refill that
    does not wait for its slot's event would show up as wrong bytes.
    """

    name = "cuda"

    def __init__(self, device: torch.device, *, stall_cycles: int = 0) -> None:
        self.torch = import_torch()
        self.device = device
        self.stall_cycles = stall_cycles
        self.stream = self.torch.cuda.Stream(device=device)
        self._joined = False

    def host_buffer(self, nbytes: int) -> tuple[torch.Tensor, Callable[[], None], str]:
        return pinned_buffer(self.torch, nbytes)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        buf = self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)
        if buf.data_ptr() % ALIGN:  # the caching allocator gives 512: never seen, kept honest
            buf = _aligned_empty(self.torch, nbytes, self.device)
        return buf

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event:
        if not self._joined:  # destinations may still be in use by kernels queued before us
            self.stream.wait_stream(self.torch.cuda.current_stream(self.device))
            self._joined = True
        with self.torch.cuda.stream(self.stream):
            if self.stall_cycles:
                self.torch.cuda._sleep(self.stall_cycles)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event = self.torch.cuda.Event()
            event.record(self.stream)
        return event

    def query(self, event: torch.cuda.Event) -> bool:
        return bool(event.query())

    def wait(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def finish(self) -> None:
        # an event, not stream.synchronize(): a graph warm-up on another thread may have CUDA's
        # sync-debug mode at "error" for a moment, and only stream/device syncs are checked
        done = self.torch.cuda.Event()
        done.record(self.stream)
        done.synchronize()
        self.torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def release(self) -> None:
        pass  # the pinned ring belongs to the process (ring.release_ring frees it)


def make_engine(dev: torch.device) -> CopyEngine:
    """The engine for the torch device ``dev``: CUDA for ``cuda``, the CPU stand-in otherwise."""
    return CudaEngine(dev) if dev.type == "cuda" else CpuEngine()
