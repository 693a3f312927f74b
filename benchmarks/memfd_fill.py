"""How a streamed load could fill its weights' memory: fresh anonymous pages against a memfd.

A streamed load (issue 51) receives each weight byte into memory the process has never touched:
each 4 KiB page faults in as the bytes land (about 266 thousand faults per GB, ~0.4 CPU-s here).
A local load maps the file instead, whose pages the page cache already holds (fault-around maps
16 at a time). This script measures the other way to fill memory that a streamed load could
take: the bytes written with ``pwrite`` from one reused buffer into a ``memfd`` (shmem pages
allocated in the kernel, no fault per page), then mapped as the local load maps its file.

Each sample is a fresh process (as a server start is) that writes ``--size-gb`` from a 1 MiB
buffer already touched, in three ways, interleaved round by round:

* (a) **anonymous**: a private anonymous mapping, written through a memoryview (one copy, a
  fault per page): what ``recv_into`` the load's buffer costs beyond the receive itself;
* (b) **memfd, written**: ``pwrite`` into a memfd (one copy, pages allocated in the kernel);
* (c) **memfd, written and read**: (b), then the memfd mapped and every page read once
  (fault-around), what a consumer of the tensors pays later.

CPU seconds are the child's user + system time around the fill; ratios against (a) in the same
run.

    python benchmarks/memfd_fill.py [--size-gb 1.0] [--reps 5]

Linux only (``os.memfd_create``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = """
import json, mmap, os, resource, sys, time
n, mode = int(sys.argv[1]), sys.argv[2]
piece = 1 << 20
buf = bytearray(os.urandom(piece))
src = memoryview(buf)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt
c0, f0 = cpu()
t0 = time.perf_counter()
if mode == "anonymous":
    mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    dst = memoryview(mm)
    for at in range(0, n, piece):
        k = min(piece, n - at)
        dst[at: at + k] = src[:k]
else:
    fd = os.memfd_create("weights")
    os.ftruncate(fd, n)
    for at in range(0, n, piece):
        os.pwrite(fd, src[: min(piece, n - at)], at)
    if mode == "memfd+read":
        mm = mmap.mmap(fd, n, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        view, total = memoryview(mm), 0
        for at in range(0, n, 4096):
            total += view[at]
wall = time.perf_counter() - t0
c1, f1 = cpu()
print(json.dumps({"wall": wall, "cpu": c1 - c0, "faults": f1 - f0}))
"""

MODES = {"anonymous": "(a) anonymous, written", "memfd": "(b) memfd, written",
         "memfd+read": "(c) memfd, written and read"}


def sample(nbytes: int, mode: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", CHILD, str(nbytes), mode], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    nbytes = int(args.size_gb * 1e9)
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for _ in range(args.reps):  # interleaved: each way once per round
        for mode in MODES:
            runs[mode].append(sample(nbytes, mode))
    ref = statistics.median(r["cpu"] for r in runs["anonymous"])
    print(f"{args.size_gb:g} GB per sample, {args.reps} rounds, min / median / max\n")
    print("| way | CPU s | wall s | minor faults (median) | CPU / (a) |")
    print("|---|---|---|---|---|")
    for mode, name in MODES.items():
        cpu, wall = [r["cpu"] for r in runs[mode]], [r["wall"] for r in runs[mode]]
        faults = statistics.median(r["faults"] for r in runs[mode])
        print(f"| {name} | {min(cpu):.3f} / {statistics.median(cpu):.3f} / {max(cpu):.3f} | "
              f"{min(wall):.3f} / {statistics.median(wall):.3f} / {max(wall):.3f} | {faults:.0f} | "
              f"{statistics.median(cpu) / ref:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
