"""Benchmark: a whole ``packer build`` of a ~1 GB checkpoint, stage by stage, against its floor.

Uses the llama-style zip checkpoint of ``benchmarks/convert.py`` (generated once under
benchmarks/_work/) as ``pytorch_model.bin`` of a model directory with a config file, and runs
``packer build`` on it as a release job would (the CLI in a fresh process, sandboxed weights
stage, image layers, the final verification), warm page cache, interleaved with the floor's
two parts measured in the same round: a durable copy of the checkpoint (``cp``, then ``fsync``
of the copy) and one sha256 pass over it; the floor is the slower of the two. The build is
timed as it returns and durable (``fsync`` of every file of OUT after it returns: what the
floor's copy pays). The disk figures: OUT's size on disk (``du``, hard links once) against the
weight bytes. Each place in ``--places`` (a directory on a file system: the checkpoint, the
model directory and OUT all go there) is measured in turn, round by round (default: the
repository's disk and, where it fits, a tmpfs under /dev/shm as the fast disk). With
``--layer-digests`` it also builds in process with the weights stage writing each weight layer
blob (one copy) and without (``build(layer_digests=...)``: a plain file the image stage copies).

    .venv/bin/python benchmarks/build.py [--reps 5] [--gb 1.0] [--places DIR ...] [--layer-digests]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
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


def time_build(root: Path, *extra: str) -> tuple[float, float, dict[str, float], tuple[int, int]]:
    """Wall seconds of ``packer build`` (with ``extra`` options) as it returns and until OUT is
    durable, its stage timings, and ``(OUT on disk, weight bytes)``."""
    from packer.fsutil import disk_usage

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
    from packer.build import build
    from packer.recipe import load_recipe

    out = root / "out"
    shutil.rmtree(out, ignore_errors=True)
    settle()
    start = time.perf_counter()
    build(load_recipe(root / "recipe.toml"), out, layer_digests=layer_digests)
    elapsed = time.perf_counter() - start
    shutil.rmtree(out)
    return elapsed


def default_places(gb: float) -> list[Path]:
    """The repository's disk, and a tmpfs as the fast disk where three checkpoints fit there."""
    places = [WORK]
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 3.5 * gb * 1e9:
        places.append(shm / f"packer-bench-{os.getpid()}")
    return places


class Place:
    """One place's runs: the checkpoint there, its model directory, and every measured number."""

    def __init__(self, place: Path, src: Path) -> None:
        place.mkdir(parents=True, exist_ok=True)
        self.place = place
        self.src = src if src.parent == place else place / src.name
        if self.src != src:
            shutil.copyfile(src, self.src)
        self.root = model_dir(self.src, place)
        self.size = src.stat().st_size
        self.runs: dict[str, list[float]] = {}
        self.disk: tuple[int, int] = (0, 0)

    def add(self, name: str, value: float) -> None:
        self.runs.setdefault(name, []).append(value)

    def round(self, layer_digests: bool) -> None:
        warm(self.src)
        cp = time_durable_cp(self.src, self.place)
        sha = time_sha256(self.src)["sha256 of the input alone (hashlib)"]
        self.add("durable copy of the checkpoint (cp + fsync)", cp)
        self.add("one sha256 pass over the checkpoint", sha)
        self.add("floor (the slower of the two, per round)", max(cp, sha))
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

    def table(self, reps: int) -> str:
        floor = statistics.median(self.runs["floor (the slower of the two, per round)"])
        du, weights = self.disk
        lines = [f"\n{self.place} ({reps} rounds, {self.size / 1e9:.2f} GB zip checkpoint)\n",
                 "| what | seconds (min / median / max) | median / floor |", "|---|---|---|"]
        lines += [f"| {name} | {stats(vals)} | {statistics.median(vals) / floor:.2f}x |"
                  for name, vals in self.runs.items()]
        limit = (1.05 * weights + 2**26) / 2**20
        lines.append(f"\nOUT on disk (du, hard links once): {du / 2**20:.1f} MiB for {weights / 2**20:.1f} MiB of "
                     f"weights = {du / weights:.3f}x (limit 1.05x + 64 MiB = {limit:.1f} MiB)")
        return "\n".join(lines)


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--layer-digests", action="store_true", help="also compare build(layer_digests=...)")
    parser.add_argument("--places", nargs="*", type=Path, help="directories to build in (default: disk and tmpfs)")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    src = generate(args.gb, "zip")
    places: list[Place] = []
    try:
        places = [Place(p, src) for p in (args.places or default_places(args.gb))]
        for _ in range(args.reps):
            for p in places:  # interleaved: the places take turns within a round
                p.round(args.layer_digests)
    finally:
        for p in places:
            p.close()
    print(f"\n{os.cpu_count()} CPUs, warm page cache; each place's rounds interleaved with the others'")
    for p in places:
        print(p.table(args.reps))


if __name__ == "__main__":
    main()
