"""Metadata read time: packer's restricted reader vs torch.load(weights_only=True).

packer reads only the pickle and the zip/legacy headers (O(metadata)); torch.load builds
every tensor (with mmap=True for zip files it maps instead of copying). Interleaved runs,
min/median/max, markdown table on stdout.

    .venv/bin/python benchmarks/checkpoint_read.py [--tensors 4000] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from packer.checkpoint import read_checkpoint

WORK = Path(__file__).parent / "_work" / "checkpoint_read"


def _make(n: int) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for i in range(n):
        sd[f"model.layers.{i // 8}.p{i % 8}.weight"] = torch.zeros(32, 32, dtype=torch.bfloat16)
    sd["lm_head.weight"] = sd["model.layers.0.p0.weight"]
    return sd


def _time(fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    sd = _make(args.tensors)
    files = {"zip": WORK / "zip.pt", "legacy": WORK / "legacy.pt"}
    torch.save(sd, files["zip"])
    torch.save(sd, files["legacy"], _use_new_zipfile_serialization=False)
    runs: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.reps):
        for fmt, path in files.items():
            mmap = fmt == "zip"
            runs.setdefault((fmt, "packer read_checkpoint"), []).append(_time(lambda p=path: read_checkpoint(p)))
            runs.setdefault((fmt, f"torch.load(weights_only, mmap={mmap})"), []).append(
                _time(lambda p=path, m=mmap: torch.load(p, weights_only=True, mmap=m))
            )
    print(f"{args.tensors + 1} tensors, {files['zip'].stat().st_size / 1e6:.1f} MB; seconds over {args.reps} runs\n")
    print("| format | reader | min | median | max |")
    print("|---|---|---|---|---|")
    for (fmt, name), ts in runs.items():
        print(f"| {fmt} | {name} | {min(ts):.4f} | {statistics.median(ts):.4f} | {max(ts):.4f} |")
    for path in files.values():
        path.unlink()


if __name__ == "__main__":
    main()
