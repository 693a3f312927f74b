"""What receiving a streamed load's bytes costs, three ways: into fresh memory, through a reused
buffer into a memfd, and spliced into a memfd without a copy in the process.

A streamed load (issue 51) receives each weight byte from a socket into memory it has never
touched and hashes it there: each 4 KiB page faults in and is zeroed as the bytes land. A local
load maps the page cache instead. On a machine where fresh memory is dear (benchmarks/RESULTS.md,
"The stream on another machine type") that is most of the stream's distance from a local load.
This script measures the ways around it on one loopback TCP connection that ``sendfile`` feeds
from a file in the page cache (no HTTP, no registry: the receive alone):

* (a) **fresh**: ``recv_into`` a private anonymous mapping in 1 MiB steps, each step hashed where
  it landed (what the loader does today);
* (b) **memfd**: ``recv_into`` one reused 1 MiB buffer, hashed there, ``pwrite`` into a memfd;
  then the memfd mapped and every page read once (what the tensors' consumer pays later). Works
  over TLS too;
* (c) **splice**: ``splice`` from the socket through a pipe into a memfd (the kernel moves the
  bytes; plain TCP only, not TLS), then the memfd mapped and hashed.

Each sample is a fresh process; the ways take turns round by round; CPU seconds are the
receiver's user + system time, ratios against (a) of the same run.

    python benchmarks/stream_receive.py [--size-gb 1] [--reps 3]

Linux only (``os.memfd_create``, ``os.splice``: Python 3.10+).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import fcntl, hashlib, json, mmap, os, resource, socket, sys, time
src, n, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
STEP = 1 << 20
ls = socket.socket()
ls.bind(("127.0.0.1", 0))
ls.listen()
pid = os.fork()
if pid == 0:  # the sender: the file from the page cache, no copy in this process
    c, _ = ls.accept()
    fd, off = os.open(src, os.O_RDONLY), 0
    while off < n:
        off += os.sendfile(c.fileno(), fd, off, n - off)
    c.close()
    os._exit(0)
s = socket.create_connection(ls.getsockname())
def usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt
t0, (c0, f0) = time.perf_counter(), usage()
h, at = hashlib.sha256(), 0
if how == "fresh":
    view = memoryview(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
    while at < n:
        k = s.recv_into(view[at:at + STEP])
        h.update(view[at:at + k])
        at += k
else:
    fd = os.memfd_create("packer-receive")
    os.ftruncate(fd, n)
    if how == "memfd":
        buf = memoryview(bytearray(STEP))
        while at < n:
            k = s.recv_into(buf)
            h.update(buf[:k])
            os.pwrite(fd, buf[:k], at)
            at += k
    else:
        r, w = os.pipe()
        fcntl.fcntl(w, 1031, STEP)  # F_SETPIPE_SZ
        while at < n:
            k = os.splice(s.fileno(), w, STEP)
            while k:
                moved = os.splice(r, fd, k, offset_dst=at)
                k, at = k - moved, at + moved
    m = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ)
    view = memoryview(m)
    if how == "memfd":
        touched = sum(view[i] for i in range(0, n, 4096))  # the consumer's first touch of each page
    else:
        for i in range(0, n, STEP):
            h.update(view[i:i + STEP])
c1, f1 = usage()
os.waitpid(pid, 0)
print(json.dumps({"wall": time.perf_counter() - t0, "cpu": c1 - c0, "faults": f1 - f0}))
"""

WAYS = ("fresh", "memfd", "splice")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    n = int(args.size_gb * 2**30) // 2**20 * 2**20
    runs: dict[str, list[dict[str, float]]] = {w: [] for w in WAYS}
    with tempfile.TemporaryDirectory(prefix="packer-receive-") as tmp:
        src = os.path.join(tmp, "src.bin")
        with open(src, "wb") as f:
            for _ in range(n // 2**20):
                f.write(os.urandom(2**20))
        for _ in range(args.reps):
            for way in WAYS:
                out = subprocess.run([sys.executable, "-c", CHILD, src, str(n), way], capture_output=True,
                                     text=True, check=True).stdout
                runs[way].append(json.loads(out))
    base = statistics.median(r["cpu"] for r in runs["fresh"])
    print(f"{n / 1e9:.2f} GB over loopback TCP, {args.reps} rounds, min / median / max")
    print("| way | wall s | CPU s | minor faults (median) | CPU / (a) |")
    print("|---|---|---|---|---|")
    for way, label in zip(WAYS, ("(a) fresh memory", "(b) memfd via a reused buffer", "(c) splice into a memfd"),
                          strict=True):
        w = sorted(r["wall"] for r in runs[way])
        c = sorted(r["cpu"] for r in runs[way])
        f = statistics.median(r["faults"] for r in runs[way])
        print(f"| {label} | {w[0]:.3f} / {statistics.median(w):.3f} / {w[-1]:.3f} | "
              f"{c[0]:.3f} / {statistics.median(c):.3f} / {c[-1]:.3f} | {f:.0f} | {statistics.median(c) / base:.2f} |")


if __name__ == "__main__":
    main()
