"""Benchmark: a whole ``packer build`` of a ~1 GB checkpoint, stage by stage, against ``cp``.

Uses the llama-style zip checkpoint of ``benchmarks/convert.py`` (generated once under
benchmarks/_work/) as ``pytorch_model.bin`` of a model directory with a config file, and runs
``packer build`` on it as a release job would (the CLI in a fresh process, sandboxed weights
stage, image layers, the final verification), interleaved with ``cp`` of the checkpoint,
warm page cache. Prints min/median/max of the whole process and of each stage (from
``OUT/build-timings.json``). With ``--layer-digests`` it also builds in process with the
weight layers' digests computed during conversion and without (``build(layer_digests=...)``;
on with three cores or more), to show what moving that hash costs or saves here.

    .venv/bin/python benchmarks/build.py [--reps 5] [--gb 1.0] [--layer-digests]
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

from convert import WORK, base_parser, generate, settle, stats, time_cp, warm  # noqa: E402

PACKER = Path(sys.executable).with_name("packer")


def model_dir(src: Path) -> Path:
    """A model directory holding ``src`` (hardlinked) and a config, plus its recipe."""
    root = WORK / "build_model"
    if root.exists():
        shutil.rmtree(root)
    (root / "src").mkdir(parents=True)
    os.link(src, root / "src" / "pytorch_model.bin")
    (root / "src" / "config.json").write_text('{"model_type": "llama"}\n')
    (root / "recipe.toml").write_text('name = "bench"\nversion = "1"\nsource = "src"\n')
    return root


def time_build(root: Path, *extra: str) -> tuple[float, dict[str, float]]:
    """Wall seconds of ``packer build`` (with ``extra`` options) and its stage timings."""
    out = root / "out"
    shutil.rmtree(out, ignore_errors=True)
    settle()
    start = time.perf_counter()
    subprocess.run([str(PACKER), "build", str(root / "recipe.toml"), "-o", str(out), "-q", *extra], check=True)
    wall = time.perf_counter() - start
    stages = json.loads((out / "build-timings.json").read_text())["stages"]
    shutil.rmtree(out)
    return wall, {s["stage"]: s["seconds"] for s in stages}


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


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--layer-digests", action="store_true", help="also compare build(layer_digests=...)")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    src = generate(args.gb, "zip")
    root = model_dir(src)
    cp: list[float] = []
    walls: list[float] = []
    stages: dict[str, list[float]] = {}
    digests: dict[bool, list[float]] = {False: [], True: []}
    try:
        for _ in range(args.reps):
            warm(src)
            cp.append(time_cp(src)["cp"])
            wall, parts = time_build(root)
            walls.append(wall)
            for name, secs in parts.items():
                stages.setdefault(name, []).append(secs)
            for flag in digests if args.layer_digests else ():
                digests[flag].append(time_in_process(root, flag))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med_cp = statistics.median(cp)
    print(f"\n{args.reps} interleaved runs, {os.cpu_count()} CPUs, {src.stat().st_size / 1e9:.2f} GB zip "
          "checkpoint, warm page cache\n")
    print("| what | seconds (min / median / max) | median / cp |\n|---|---|---|")
    print(f"| cp of the checkpoint | {stats(cp)} | 1.00x |")
    print(f"| packer build, whole process | {stats(walls)} | {statistics.median(walls) / med_cp:.2f}x |")
    for name, vals in stages.items():
        print(f"| stage: {name} | {stats(vals)} | {statistics.median(vals) / med_cp:.2f}x |")
    for flag, vals in digests.items():
        if vals:
            print(f"| build() in process, layer_digests={flag} | {stats(vals)} | "
                  f"{statistics.median(vals) / med_cp:.2f}x |")


if __name__ == "__main__":
    main()
