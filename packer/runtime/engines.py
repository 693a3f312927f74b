"""Copy engines: where staged bytes go. CUDA (pinned slots, one stream) or a CPU stand-in.

Both engines offer the same small protocol (``host_buffer``, ``device_buffer``, ``copy``,
``query``, ``wait``, ``finish``, ``release``), so the ring's scheduling runs unchanged in tests
against the CPU engine, whose copy thread plays the part of the CUDA stream.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Any


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


def make_engine(dev: Any) -> Any:
    """The engine for the torch device ``dev``: CUDA for ``cuda``, the CPU stand-in otherwise."""
    return CudaEngine(dev) if dev.type == "cuda" else CpuEngine()
