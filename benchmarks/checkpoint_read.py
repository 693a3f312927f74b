"""Metadata read time: packer's restricted reader vs torch.load(weights_only=True).

packer reads only the pickle and the zip/legacy headers (O(metadata)); torch.load builds
every tensor (with mmap=True for zip files it maps instead of copying). Interleaved runs,
min/median/max, markdown table on stdout.

    .venv/bin/python benchmarks/checkpoint_read.py [--tensors 4000] [--reps 5]
    .venv/bin/python benchmarks/checkpoint_read.py --baseline main [--reps 15]

``--baseline REF`` compares packer's code against itself instead: the ``packer`` package of git
revision REF (``git archive`` into benchmarks/_work) and of this checkout each run in a worker
process of their own (collector off, imports done before timing), and the two read the same
files alternately: ``read_checkpoint`` and ``inspect_checkpoint`` (the tree walks) on a state
dict and on a training checkpoint (state dict, optimizer state, hyper-parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
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


def _training(n: int) -> dict[str, object]:
    """A training checkpoint: the state dict beside Adam-style state per tensor and hyper-parameters."""
    sd = _make(n)
    state = {i: {"step": torch.tensor(10.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}
             for i in range(n)}
    return {"state_dict": sd, "optimizer": {"state": state, "param_groups": [{"lr": 1e-3, "params": list(range(n))}]},
            "hparams": argparse.Namespace(lr=1e-3, layers=n // 8), "epoch": 3}


_WORKER = """
import gc, json, sys, time
from pathlib import Path
from packer.checkpoint import inspect_checkpoint, read_checkpoint
gc.disable()
for line in sys.stdin:
    fn, path, key = json.loads(line)
    t = time.perf_counter()
    if fn == "read":
        read_checkpoint(Path(path), key=key)
    else:
        inspect_checkpoint(Path(path))
    print(time.perf_counter() - t, flush=True)
"""


def _worker(package_root: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    return subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env, cwd=package_root)


def _export(ref: str) -> Path:
    repo = Path(__file__).resolve().parents[1]
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", ref], capture_output=True, text=True,
                         check=True).stdout.strip()
    dest = WORK / f"baseline-{sha[:12]}"
    if not (dest / "packer").is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(repo), "archive", sha, "packer"], capture_output=True,
                                 check=True).stdout
        tar = dest / "packer.tar"
        tar.write_bytes(archive)
        with tarfile.open(tar) as t:
            t.extractall(dest, filter="data")  # our own repository's files, not an input
        tar.unlink()
    return dest


def side_by_side(ref: str, n: int, reps: int) -> None:
    """``--baseline``: REF's packer and this checkout's, alternately on the same files."""
    WORK.mkdir(parents=True, exist_ok=True)
    files = {"state dict (zip)": (WORK / "sd.pt", None), "training checkpoint (zip)": (WORK / "train.pt", "state_dict")}
    torch.save(_make(n), files["state dict (zip)"][0])
    torch.save(_training(n), files["training checkpoint (zip)"][0])
    workers = {ref: _worker(_export(ref)), "this checkout": _worker(Path(__file__).resolve().parents[1])}
    runs: dict[tuple[str, str, str], list[float]] = {}
    for i in range(reps + 1):  # the first round warms caches and imports: not counted
        for what, (path, key) in files.items():
            for fn in ("read", "inspect"):
                order = list(workers.items()) if i % 2 else list(workers.items())[::-1]
                for name, proc in order:
                    assert proc.stdin is not None and proc.stdout is not None
                    proc.stdin.write(json.dumps([fn, str(path), key]) + "\n")
                    proc.stdin.flush()
                    seconds = float(proc.stdout.readline())
                    if i:
                        runs.setdefault((what, fn, name), []).append(seconds)
    for proc in workers.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    print(f"{n + 1} tensors; seconds over {reps} alternating runs\n")
    print("| file | call | code | min | median | max |")
    print("|---|---|---|---|---|---|")
    for (what, fn, name), ts in runs.items():
        call = "read_checkpoint" if fn == "read" else "inspect_checkpoint"
        print(f"| {what} | {call} | {name} | {min(ts):.4f} | {statistics.median(ts):.4f} | {max(ts):.4f} |")
    for path, _ in files.values():
        path.unlink()


def _time(fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--baseline", metavar="REF", help="compare with packer at git revision REF instead")
    args = ap.parse_args()
    if args.baseline:
        side_by_side(args.baseline, args.tensors, args.reps)
        return
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
