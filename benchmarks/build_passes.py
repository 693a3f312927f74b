"""What the build's digests cost at best: its passes over 1 GB pipelined perfectly, against its floor.

``packer build`` takes four sha256 digests of each weight byte, each for another reader: the
input's pin (provenance: which checkpoint was converted), the layer blob (its OCI digest and
diff_id), the safetensors file (the manifest, ``verify``, ``model.sig``'s file serialization)
and the file's chunks (the table a streamed or tensor-parallel rank proves its share by). This
script measures how fast any build making those digests could be on this machine: the ideal
data path, not packer's. One read of the zip checkpoint in 1 MiB blocks, each block handed to
one thread per digest (hashlib releases the GIL) and written to a file beside it (the blob's
one copy), nothing else: no parsing, no sandbox, no interpreter start, no image. Measured with
4, 3 and 2 of the digests (fewer digests: the pin first, then the chunks), and, each round, the
floor of ``benchmarks/build.py`` (a durable copy, ``cp`` then ``fsync``, and one sha256 pass)
and ``packer build`` itself as that script runs it (a model directory of the checkpoint, the
CLI in a fresh process).

    .venv/bin/python benchmarks/build_passes.py [--reps 3] [--gb 1.0] [--place DIR] [--touch-gb 6]

Prints min / median / max seconds (wall) and CPU seconds (user + system, this process's
threads) per contender, interleaved round by round, with each median against the floor's.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import hashlib
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build import model_dir, time_build, time_durable_cp, time_sha256_read, touch_memory  # noqa: E402
from convert import WORK, generate, settle, stats, warm  # noqa: E402

BLOCK = 2**20  # the build's hash read (packer.hashing.HASH_READ)
CHUNK = 2**20  # the chunk table's default chunk size
PREFIX = 512  # a tar header before the file in its layer blob
DIGESTS = ("pin", "blob", "file", "chunks")


def _chunks(out: list[bytes]) -> Callable[[memoryview], None]:
    def feed(view: memoryview) -> None:
        for i in range(0, len(view), CHUNK):
            out.append(hashlib.sha256(view[i:i + CHUNK]).digest())
    return feed


def pipeline(src: Path, dst: Path, digests: tuple[str, ...]) -> tuple[float, float]:
    """One read of ``src``, each block to a thread per digest and written to ``dst``: (wall, CPU) seconds."""
    hashes = {"pin": hashlib.sha256(), "blob": hashlib.sha256(b"\0" * PREFIX), "file": hashlib.sha256()}
    table: list[bytes] = []
    feeds = [hashes[d].update if d != "chunks" else _chunks(table) for d in digests]
    with contextlib.suppress(FileNotFoundError):
        dst.unlink()
    settle()
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fd, out = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    workers = [ThreadPoolExecutor(1) for _ in feeds]  # one thread per digest keeps each stream in order
    bufs = [bytearray(BLOCK) for _ in range(4)]
    pending: list[list[Future[None]]] = [[] for _ in bufs]
    try:
        at, turn = 0, 0
        while True:
            for f in pending[turn]:
                f.result()  # every digest is done with this buffer
            n = os.preadv(fd, [bufs[turn]], at)
            if n <= 0:
                break
            view = memoryview(bufs[turn])[:n]
            pending[turn] = [w.submit(feed, view) for w, feed in zip(workers, feeds, strict=True)]
            os.pwrite(out, view, PREFIX + at)
            at, turn = at + n, (turn + 1) % len(bufs)
    finally:
        for w in workers:
            w.shutdown()
        os.close(fd)
        os.close(out)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    dst.unlink()
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--place", type=Path, default=WORK, help="where the copies are written (default: the repo's disk)")
    ap.add_argument("--touch-gb", type=float, default=6.0,
                    help="memory written once and freed before the rounds (as benchmarks/build.py; 0: not)")
    args = ap.parse_args()
    if args.touch_gb:
        touch_memory(args.touch_gb)  # a VM's first touch of a freed page costs a host fault
    src = generate(args.gb, "zip")
    args.place.mkdir(parents=True, exist_ok=True)
    warm(src)
    ways = {f"{len(d)} digests ({', '.join(d)})": d for d in (DIGESTS, DIGESTS[1:], DIGESTS[1:3])}
    build = "packer build, whole process (benchmarks/build.py's)"
    walls: dict[str, list[float]] = {"durable copy (cp + fsync)": [], "one sha256 pass": [], build: [],
                                     **{k: [] for k in ways}}
    cpus: dict[str, list[float]] = {k: [] for k in ways}
    root = model_dir(src, args.place)
    compileall.compile_dir(Path(__file__).resolve().parents[1] / "packer", quiet=1)  # as build.py
    for _ in range(args.reps):  # interleaved: each contender once per round
        walls["durable copy (cp + fsync)"].append(time_durable_cp(src, args.place))
        walls["one sha256 pass"].append(time_sha256_read(src))
        walls[build].append(time_build(root)[0])
        for name, digests in ways.items():
            wall, cpu = pipeline(src, args.place / "passes.out", digests)
            walls[name].append(wall)
            cpus[name].append(cpu)
    floor = max(statistics.median(walls["durable copy (cp + fsync)"]), statistics.median(walls["one sha256 pass"]))
    print(f"{src.name}: {src.stat().st_size / 1e9:.2f} GB, {args.reps} rounds, {os.cpu_count()} CPUs, "
          f"written to {args.place}; min / median / max\n")
    print("| contender | wall s | CPU s | wall × floor |")
    print("|---|---|---|---|")
    for name, values in walls.items():
        shown = stats(cpus[name]) if name in cpus else ""
        print(f"| {name} | {stats(values)} | {shown} | {statistics.median(values) / floor:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
