"""What fresh anonymous memory costs to fault in, 4 KiB pages against transparent huge pages.

A private copy of the weights (``load_weights("cpu", copy=True)``) writes into memory the
process has never touched; the copy's reference (``readinto`` a preallocated buffer) does not
pay for that. This script measures the price alone: each sample is a fresh process (as a
server start is) that maps ``--size-gb`` of anonymous memory, optionally asks for huge pages
(``MADV_HUGEPAGE``), and times ``MADV_POPULATE_WRITE`` over it. Samples are taken right after
the previous process freed its memory and again after ``--gap`` idle seconds: on a virtual
machine whose balloon reports free pages to the host, memory idle for a couple of seconds is
handed back and must be faulted in by the host again.

    python benchmarks/fresh_memory.py [--size-gb 1.1] [--reps 5] [--gap 5]

Linux only (``MADV_POPULATE_WRITE`` needs kernel 5.14).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import mmap, sys, time
n, huge = int(sys.argv[1]), sys.argv[2] == "1"
mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
if huge:
    mm.madvise(mmap.MADV_HUGEPAGE)
t = time.perf_counter()
mm.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23), 0, n)
print(time.perf_counter() - t)
"""


def sample(nbytes: int, huge: bool) -> float:
    done = subprocess.run([sys.executable, "-c", CHILD, str(nbytes), "1" if huge else "0"],
                          capture_output=True, text=True, check=True)
    return float(done.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gap", type=float, default=5.0, help="idle seconds before an 'idle' sample")
    args = ap.parse_args()
    nbytes = int(args.size_gb * 1e9)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"{args.size_gb:g} GB per sample, {args.reps} rounds; THP: "
          f"{thp.read_text().strip() if thp.exists() else 'n/a'}\n")
    runs: dict[str, list[float]] = {}
    for _ in range(args.reps):  # interleaved: each case once per round
        for huge in (False, True):
            page = "2 MiB (MADV_HUGEPAGE)" if huge else "4 KiB"
            sample(nbytes, huge)  # frees memory just before the next sample
            runs.setdefault(f"{page}, just freed", []).append(sample(nbytes, huge))
            time.sleep(args.gap)
            runs.setdefault(f"{page}, idle {args.gap:g} s", []).append(sample(nbytes, huge))
    print("| pages, memory state | min s | median s | max s | GB/s (median) |")
    print("|---|---|---|---|---|")
    for name, xs in runs.items():
        med = statistics.median(xs)
        print(f"| {name} | {min(xs):.3f} | {med:.3f} | {max(xs):.3f} | {args.size_gb / med:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
