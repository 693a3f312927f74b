"""Benchmark: a whole ``packer build`` of a ~1 GB checkpoint, stage by stage, against its floor.

Uses the llama-style zip checkpoint of ``benchmarks/convert.py`` (generated once under
benchmarks/_work/) as ``pytorch_model.bin`` of a model directory with a config file, and runs
``packer build`` on it as a release job would (the CLI in a fresh process, sandboxed weights
stage, image layers, the final verification), warm page cache, interleaved with the floor's
two parts measured in the same round: a durable copy of the checkpoint (``cp``, then ``fsync``
of the copy) and one sha256 pass over it, made two ways (over an mmap, and with
``hashlib.file_digest``'s reads); the floor is the slower of the copy and the faster pass. The build is
timed as it returns and durable (``fsync`` of every file of OUT after it returns: what the
floor's copy pays). The disk figures: OUT's size on disk (``du``, hard links once) against the
weight bytes. Each place in ``--places`` (a directory on a file system: the checkpoint, the
model directory and OUT all go there) is measured in turn, round by round (default: the
repository's disk and, where it fits, a tmpfs under /dev/shm as the fast disk). With
``--layer-digests`` it also builds in process with the weights stage writing each weight layer
blob (one copy) and without (``build(layer_digests=...)``: a plain file the image stage copies).

The slow disk: where the kernel lets this process throttle a block device (root, and the
cgroup v1 ``blkio`` controller or cgroup v2's ``io``), a third place is the repository's disk
with writes capped at ``--slow-mbps`` (default 200 MB/s, a standard hosted runner's disk):
the floor's copy and the build run in a cgroup holding that cap (``blkio.throttle.
write_bps_device`` / ``io.max wbps``), so every byte they make durable waits for it; the
other places' rounds run outside it. ``--slow-mbps 0`` leaves it out.

Before the rounds, as a user's install would have it and so that no round pays for it: packer's
modules are byte-compiled (a pip install compiles them; an editable checkout under
``PYTHONDONTWRITEBYTECODE``, this machine's setting, would compile every module again in each
of a build's two processes, about 0.2 s), and ``--touch-gb`` of memory is written once on a
tmpfs and freed (a VM that hands freed pages back to its host makes the first touch of a page
cost a host fault, about 3 s per GB here, which would land at random on the floor's copy and
on the builds; 0: not).

    .venv/bin/python benchmarks/build.py [--reps 5] [--gb 1.0] [--places DIR ...] [--slow-mbps 200]
        [--layer-digests] [--touch-gb 18]
"""

from __future__ import annotations

import compileall
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from convert import WORK, base_parser, generate, settle, stats, time_sha256, warm  # noqa: E402

from packer.publish import _fsync_dir  # noqa: E402

PACKER = Path(sys.executable).with_name("packer")


def model_dir(src: Path, place: Path) -> Path:
    """A model directory under ``place`` holding ``src`` (hardlinked, or copied to another file
    system) and a config, plus its recipe."""
    root = place / "build_model"
    if root.exists():
        shutil.rmtree(root)
    (root / "src").mkdir(parents=True)
    try:
        os.link(src, root / "src" / "pytorch_model.bin")
    except OSError:
        shutil.copyfile(src, root / "src" / "pytorch_model.bin")
    (root / "src" / "config.json").write_text('{"model_type": "llama"}\n')
    (root / "recipe.toml").write_text('name = "bench"\nversion = "1"\nsource = "src"\n')
    return root


def fsync_tree(root: Path) -> None:
    """Make every file and folder under ``root`` durable (what a copy pays to be on disk)."""
    for top, dirs, files in os.walk(root):
        for name in [*files, *dirs, "."]:
            path = os.path.join(top, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def time_durable_cp(src: Path, place: Path) -> float:
    """``cp`` of the checkpoint, then ``fsync`` of the copy and its folder: a durable copy."""
    dst = place / "cp.out"
    settle()
    t = time.perf_counter()
    subprocess.run(["cp", str(src), str(dst)], check=True)
    fd = os.open(dst, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    _fsync_dir(place)
    elapsed = time.perf_counter() - t
    dst.unlink()
    return elapsed


def time_sha256_read(src: Path) -> float:
    """One sha256 pass as the standard library makes it (``hashlib.file_digest``: reads into a
    buffer of its own): seconds. The floor takes the faster of this and the mmap pass."""
    import hashlib

    settle()
    with open(src, "rb") as f:
        t = time.perf_counter()
        hashlib.file_digest(f, "sha256")
        return time.perf_counter() - t


def time_build(root: Path, *extra: str) -> tuple[float, float, dict[str, float], tuple[int, int]]:
    """Wall seconds of ``packer build`` (with ``extra`` options) as it returns and until OUT is
    durable, its stage timings, and ``(OUT on disk, weight bytes)``."""
    from packer.filetree import disk_usage

    out = root / "out"
    shutil.rmtree(out, ignore_errors=True)
    settle()
    start = time.perf_counter()
    subprocess.run([str(PACKER), "build", str(root / "recipe.toml"), "-o", str(out), "-q", *extra], check=True)
    wall = time.perf_counter() - start
    fsync_tree(out)
    durable = time.perf_counter() - start
    stages = json.loads((out / "build-timings.json").read_text())["stages"]
    files = json.loads((out / "manifest.json").read_text())["files"]
    weights = sum(e["size"] for rel, e in files.items() if rel.endswith(".safetensors"))
    disk = (disk_usage(out), weights)
    shutil.rmtree(out)
    return wall, durable, {s["stage"]: s["seconds"] for s in stages}, disk


def time_in_process(root: Path, layer_digests: bool) -> float:
    from packer.building import build
    from packer.recipe import load_recipe

    out = root / "out"
    shutil.rmtree(out, ignore_errors=True)
    settle()
    start = time.perf_counter()
    build(load_recipe(root / "recipe.toml"), out, layer_digests=layer_digests)
    elapsed = time.perf_counter() - start
    shutil.rmtree(out)
    return elapsed


def touch_memory(gb: float) -> float:
    """Write up to ``gb`` GB of zeros to a tmpfs file, leaving 2 GB available, and remove it: seconds."""
    shm = Path("/dev/shm")
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    available = int(meminfo["MemAvailable"].split()[0]) * 1024
    todo = min(int(gb * 1e9), available - 2 * 2**30, shutil.disk_usage(shm).free - 2**30)
    if not shm.is_dir() or todo <= 0:
        return 0.0
    block, path = b"\0" * 2**26, shm / f"packer-touch-{os.getpid()}"
    start = time.perf_counter()
    try:
        with path.open("wb") as f:
            for _ in range(todo // len(block)):
                f.write(block)
    finally:
        path.unlink(missing_ok=True)
    return time.perf_counter() - start


def default_places(gb: float) -> list[Path]:
    """The repository's disk, and a tmpfs as the fast disk where three checkpoints fit there."""
    places = [WORK]
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 3.5 * gb * 1e9:
        places.append(shm / f"packer-bench-{os.getpid()}")
    return places


class Throttle:
    """A cgroup capping writes to the block device under ``place`` at ``bps`` bytes per second.

    Made with :meth:`make` (None where this kernel or user cannot); :meth:`inside` moves this
    process there for a block (children started inside inherit it) and back out after.
    """

    V1 = Path("/sys/fs/cgroup/blkio")
    V2 = Path("/sys/fs/cgroup")

    def __init__(self, group: Path, root: Path, bps: int, label: str) -> None:
        self.group, self.root, self.bps, self.label = group, root, bps, label

    @staticmethod
    def _disk(place: Path) -> str:
        """``MAJ:MIN`` of the whole disk holding ``place`` (a partition's parent: throttles name disks)."""
        dev = place.stat().st_dev
        node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
        if (node / "partition").exists():
            return (node.resolve().parent / "dev").read_text().strip()
        return f"{os.major(dev)}:{os.minor(dev)}"

    @classmethod
    def make(cls, place: Path, mbps: float) -> Throttle | None:
        bps = int(mbps * 1e6)
        try:
            disk = cls._disk(place)
            if (cls.V1 / "blkio.throttle.write_bps_device").exists():
                group = cls.V1 / "packer-bench-slow"
                group.mkdir(exist_ok=True)
                (group / "blkio.throttle.write_bps_device").write_text(f"{disk} {bps}\n")
                return cls(group, cls.V1, bps, f"blkio.throttle.write_bps_device {disk} {bps}")
            if "io" in (cls.V2 / "cgroup.subtree_control").read_text().split():
                group = cls.V2 / "packer-bench-slow"
                group.mkdir(exist_ok=True)
                (group / "io.max").write_text(f"{disk} wbps={bps}\n")
                return cls(group, cls.V2, bps, f"io.max {disk} wbps={bps}")
        except OSError as e:
            print(f"no slow disk: cannot throttle writes under {place} ({e})", file=sys.stderr)
            return None
        print(f"no slow disk: neither cgroup v1 blkio nor v2 io is available for {place}", file=sys.stderr)
        return None

    @contextmanager
    def inside(self) -> Iterator[None]:
        (self.group / "cgroup.procs").write_text(f"{os.getpid()}\n")
        try:
            yield
        finally:
            (self.root / "cgroup.procs").write_text(f"{os.getpid()}\n")

    def close(self) -> None:
        with suppress(OSError):
            self.group.rmdir()


class Place:
    """One place's runs: the checkpoint there, its model directory, and every measured number.

    With ``throttle`` (the slow disk) the model directory goes under ``place/slow`` and every
    timed command runs inside the throttle's cgroup."""

    def __init__(self, place: Path, src: Path, throttle: Throttle | None = None) -> None:
        self.throttle = throttle
        if throttle is not None:
            place = place / "slow"
        place.mkdir(parents=True, exist_ok=True)
        self.place = place
        self.src = src if src.parent == place else place / src.name
        if self.src != src:
            try:
                os.link(src, self.src)  # the slow place is on the same disk
            except OSError:
                shutil.copyfile(src, self.src)
        self.root = model_dir(self.src, place)
        self.size = src.stat().st_size
        self.runs: dict[str, list[float]] = {}
        self.disk: tuple[int, int] = (0, 0)

    def add(self, name: str, value: float) -> None:
        self.runs.setdefault(name, []).append(value)

    @property
    def name(self) -> str:
        return f"{self.place} (writes capped: {self.throttle.label})" if self.throttle else str(self.place)

    def round(self, layer_digests: bool) -> None:
        warm(self.src)
        settle()  # the other places' dirty pages are written before any throttle applies
        with self.throttle.inside() if self.throttle else nullcontext():
            self._round(layer_digests)

    def _round(self, layer_digests: bool) -> None:
        cp = time_durable_cp(self.src, self.place)
        mapped = time_sha256(self.src)["sha256 of the input alone (hashlib)"]
        read = time_sha256_read(self.src)
        self.add("durable copy of the checkpoint (cp + fsync)", cp)
        self.add("one sha256 pass over the checkpoint: over an mmap, 8 MiB at a time", mapped)
        self.add("one sha256 pass over the checkpoint: hashlib.file_digest (reads)", read)
        self.add("floor (the slower of the copy and the faster sha256 pass, per round)", max(cp, min(mapped, read)))
        wall, durable, parts, self.disk = time_build(self.root)
        self.add("packer build, whole process", wall)
        self.add("packer build, until OUT is durable (+ fsync)", durable)
        for name, secs in parts.items():
            self.add(f"stage: {name}", secs)
        for flag in (True, False) if layer_digests else ():
            self.add(f"build() in process, layer_digests={flag}", time_in_process(self.root, flag))

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        if self.src.parent == self.place and self.place != WORK:
            shutil.rmtree(self.place, ignore_errors=True)
        if self.throttle is not None:
            self.throttle.close()

    def table(self, reps: int) -> str:
        floor = statistics.median(self.runs["floor (the slower of the copy and the faster sha256 pass, per round)"])
        du, weights = self.disk
        lines = [f"\n{self.name} ({reps} rounds, {self.size / 1e9:.2f} GB zip checkpoint)\n",
                 "| what | seconds (min / median / max) | median / floor |", "|---|---|---|"]
        lines += [f"| {name} | {stats(vals)} | {statistics.median(vals) / floor:.2f}x |"
                  for name, vals in self.runs.items()]
        limit = (1.05 * weights + 2**26) / 2**20
        lines.append(f"\nOUT on disk (du, hard links once): {du / 2**20:.1f} MiB for {weights / 2**20:.1f} MiB of "
                     f"weights = {du / weights:.3f}x (limit 1.05x + 64 MiB = {limit:.1f} MiB)")
        return "\n".join(lines)


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--layer-digests", action="store_true",
                        help="also time build() in process, the weights stage writing the layer blobs and not")
    parser.add_argument("--places", nargs="*", type=Path, help="directories to build in (default: disk and tmpfs)")
    parser.add_argument("--slow-mbps", type=float, default=200.0,
                        help="also build on the repository's disk with writes capped at this rate (0: not)")
    parser.add_argument("--touch-gb", type=float, default=18.0,
                        help="memory to write once and free before the rounds (0: not)")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    src = generate(args.gb, "zip")
    compileall.compile_dir(Path(__file__).resolve().parents[1] / "packer", quiet=1)
    touched = touch_memory(args.touch_gb) if args.touch_gb > 0 else 0.0
    places: list[Place] = []
    try:
        places = [Place(p, src) for p in (args.places or default_places(args.gb))]
        throttle = Throttle.make(WORK, args.slow_mbps) if args.slow_mbps > 0 else None
        if throttle is not None:
            places.append(Place(WORK, src, throttle))
        for _ in range(args.reps):
            for p in places:  # interleaved: the places take turns within a round
                p.round(args.layer_digests)
    finally:
        for p in places:
            p.close()
    print(f"\n{os.cpu_count()} CPUs, warm page cache, memory touched first ({args.touch_gb:g} GB in "
          f"{touched:.1f} s), packer byte-compiled; each place's rounds interleaved with the others'")
    for p in places:
        print(p.table(args.reps))


if __name__ == "__main__":
    main()
