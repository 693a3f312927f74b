"""The stage timer the build uses: seconds, bytes and throughput per stage."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StageTime:
    """One timed stage; ``nbytes`` is filled in by the stage's caller when it knows it."""

    name: str
    seconds: float = 0.0
    nbytes: int = 0

    @property
    def gbps(self) -> float | None:
        return self.nbytes / self.seconds / 1e9 if self.nbytes and self.seconds > 0 else None

    def as_json(self) -> dict[str, Any]:
        return {"stage": self.name, "seconds": round(self.seconds, 4), "bytes": self.nbytes,
                "gb_per_s": None if self.gbps is None else round(self.gbps, 3)}


@dataclass
class StageTimer:
    """Collects :class:`StageTime` entries in the order stages ran."""

    stages: list[StageTime] = field(default_factory=list)
    _start: float = field(default_factory=time.perf_counter)

    @contextmanager
    def stage(self, name: str) -> Iterator[StageTime]:
        entry = StageTime(name)
        t0 = time.perf_counter()
        try:
            yield entry
        finally:
            entry.seconds = time.perf_counter() - t0
            self.stages.append(entry)

    @property
    def total(self) -> float:
        return time.perf_counter() - self._start

    def as_json(self) -> list[dict[str, Any]]:
        return [s.as_json() for s in self.stages]

    def table(self, total: float | None = None) -> str:
        """A fixed-width table of the stages, their bytes and throughput, and the total."""
        rows = [("stage", "seconds", "bytes", "GB/s")]
        for s in self.stages:
            rows.append((s.name, f"{s.seconds:.3f}", _human(s.nbytes) if s.nbytes else "",
                         f"{s.gbps:.2f}" if s.gbps else ""))
        rows.append(("total", f"{self.total if total is None else total:.3f}", "", ""))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        cells = ([r[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True))] for r in rows)
        return "\n".join("  ".join(row) for row in cells)


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)
