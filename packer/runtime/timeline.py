"""Start-up stage timing: ``[startup]`` lines, one JSON log line, a Chrome trace file.

Every verb of the loader records its stages (bytes and throughput where they apply) on a
:class:`Timeline`; ``PACKER_STARTUP_LOG`` picks the printed form (``text``, ``json``, ``off``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from .settings import setting

if TYPE_CHECKING:
    from types import ModuleType


class Timeline:
    """Start-up stages with bytes and throughput; prints ``[startup] name: 1.02s`` lines."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.stages: list[dict[str, Any]] = []
        self._printed = 0
        self._lock = threading.Lock()

    def add(self, name: str, start: float, end: float, nbytes: int = 0, lane: int = 0, **facts: int) -> None:
        """Record a stage that ran from ``start`` to ``end`` (``time.perf_counter`` values);
        ``facts`` are more counts kept in its record (``tensors``, ``hugepages``)."""
        secs = max(end - start, 0.0)
        rec = {"stage": name, "start_s": round(start - self.t0, 6), "seconds": round(secs, 6),
               "bytes": nbytes, "gbps": round(nbytes / secs / 1e9, 3) if nbytes and secs else None,
               "lane": lane, **facts}
        with self._lock:
            self.stages.append(rec)

    @contextlib.contextmanager
    def stage(self, name: str, nbytes: int = 0) -> Iterator[dict[str, int]]:
        """Time a block; the block may set ``box["bytes"]`` and more counts (see :meth:`add`)."""
        box = {"bytes": nbytes}
        start = time.perf_counter()
        try:
            yield box
        finally:
            self.add(name, start, time.perf_counter(), box.pop("bytes"), **box)

    def flush(self, stream: IO[str] | None = None) -> None:
        """Print the stages recorded since the last flush and the total (``PACKER_STARTUP_LOG``).

        The total runs from the process's first recorded stage to the end of the newest one, so a
        process that flushes after each verb prints growing totals and its last is the whole
        start-up; ``this call`` (JSON ``call_s``) is the span of the stages printed now.
        """
        mode = setting("startup_log")  # read at each print: the timeline is the process's
        with self._lock:
            new, self._printed = self.stages[self._printed:], len(self.stages)
            first = min(s["start_s"] for s in self.stages) if self.stages else 0.0
        if not new or mode == "off":
            return
        end = max(s["start_s"] + s["seconds"] for s in new)
        total, call = end - first, end - min(s["start_s"] for s in new)
        out = stream or sys.stderr
        if mode == "json":
            out.write(json.dumps({"startup": new, "total_s": round(total, 6), "call_s": round(call, 6)}) + "\n")
        else:
            for s in new:
                out.write(f"[startup] {s['stage']}: {_fmt_stage(s)}\n")
            out.write(f"[startup] total: {total:.2f}s since the first stage (this call: {call:.2f}s)\n")
        out.flush()

    def chrome_trace(self, path: str | Path) -> None:
        """Write the stages as a Chrome trace-event file (Perfetto, chrome://tracing)."""
        events = [{"name": s["stage"], "ph": "X", "pid": os.getpid(), "tid": s["lane"],
                   "ts": round(s["start_s"] * 1e6, 3), "dur": round(s["seconds"] * 1e6, 3),
                   "args": {"bytes": s["bytes"], "gbps": s["gbps"]}} for s in self.stages]
        lanes = {0: "loader", 1: "reader threads", 2: "copy engine", 3: "prefetch", 4: "hash thread"}
        events += [{"name": "thread_name", "ph": "M", "pid": os.getpid(), "tid": tid,
                    "args": {"name": name}} for tid, name in lanes.items()]
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
    if s.get("tensors"):
        text += f", {s['tensors']} tensors"
    return text


TIMELINE = Timeline()


def import_torch(timeline: Timeline | None = None) -> ModuleType:
    """Import torch, timing the import when this call is the one that pays for it: the
    runtime's one way to torch (it is imported lazily everywhere)."""
    cached = sys.modules.get("torch")
    if cached is not None:
        return cached
    start = time.perf_counter()
    import torch

    (timeline or TIMELINE).add("import torch", start, time.perf_counter())
    return torch
