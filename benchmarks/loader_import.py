"""Fresh-process import of the emitted loader beyond ``import torch``, without a bytecode cache.

Side by side, interleaved: the loader this tree emits (the ``packer_loader.py`` stub and its
``packer_runtime/`` package, every file compiled from source, as the stub always does) and the
one a reference commit emits (by default ``main``; before the runtime shipped as modules, one
joined ``packer_loader.py``). Both are emitted for the same small artifacts by their own
commit's ``tests/loader_fixtures.make_out``. Each run is a fresh interpreter with
``PYTHONDONTWRITEBYTECODE=1`` and ``-X pycache_prefix`` pointing at a new empty directory, so
no ``.pyc`` is read or written anywhere; it imports torch, then times ``import packer_loader``:
wall time (``time.perf_counter``, what a start-up pays) and the process's CPU time
(``time.process_time``, which a busy shared machine inflates far less).

    .venv/bin/python benchmarks/loader_import.py [--ref main] [--runs 15]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET_MS = 30.0  # benchmarks/RESULTS.md: the loader's import beyond torch

EMIT = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import packer
assert Path(packer.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), packer.__file__
from tests.loader_fixtures import make_out
make_out(Path(sys.argv[2]))
"""

TIME = """
import sys, time
import torch
sys.path.insert(0, sys.argv[1])
start, cpu = time.perf_counter(), time.process_time()
import packer_loader
print((time.perf_counter() - start) * 1e3, (time.process_time() - cpu) * 1e3)
"""


def emit(src: Path, out: Path) -> None:
    """Emit the loader for the fixture artifacts into ``out`` with the packer of ``src``."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    subprocess.run([sys.executable, "-c", EMIT, str(src), str(out)], cwd=src, env=env, check=True)


def import_ms(out: Path, scratch: Path) -> tuple[float, float]:
    """One fresh process: (wall, CPU) ms of ``import packer_loader`` after ``import torch``, nothing cached."""
    prefix = Path(tempfile.mkdtemp(dir=scratch))  # empty: no bytecode to find, none left behind
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PACKER_STARTUP_LOG": "off"}
    r = subprocess.run([sys.executable, "-X", f"pycache_prefix={prefix}", "-c", TIME, str(out)],
                       capture_output=True, text=True, cwd=scratch, env=env, check=True)
    shutil.rmtree(prefix)
    wall, cpu = r.stdout.strip().splitlines()[-1].split()
    return float(wall), float(cpu)


def size(out: Path) -> tuple[int, int]:
    """(files, bytes) of the emitted loader: the stub and its runtime directory when there is one."""
    files = [out / "packer_loader.py", *(p for p in (out / "packer_runtime").rglob("*.py"))]
    return len(files), sum(p.stat().st_size for p in files)


def row(name: str, clock: str, xs: list[float], note: str) -> str:
    return f"| {name} | {clock} | {min(xs):.1f} | {statistics.median(xs):.1f} | {max(xs):.1f} | {note} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="main", help="the commit whose emitted loader is the reference")
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="loader-import-"))
    try:
        ref_src = work / "ref-src"
        ref_src.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.ref], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(ref_src)], input=archive.stdout, check=True)
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.ref], capture_output=True,
                                text=True, check=True).stdout.strip()
        outs = {"this tree": work / "new", f"{args.ref} ({commit})": work / "ref"}
        emit(REPO, outs["this tree"])
        emit(ref_src, outs[f"{args.ref} ({commit})"])
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in outs}
        for _ in range(args.runs):  # interleaved: the machine's drift hits both alike
            for name, out in outs.items():
                times[name].append(import_ms(out, work))
        ref = times[f"{args.ref} ({commit})"]
        print(f"import packer_loader after import torch, no bytecode cache, {args.runs} fresh processes each (ms)")
        print("| loader | clock | min | median | max | note |")
        print("|---|---|---|---|---|---|")
        for name, out in outs.items():
            files, nbytes = size(out)
            for i, clock in enumerate(("wall", "CPU")):
                xs = [t[i] for t in times[name]]
                ratio = statistics.median(xs) / statistics.median(t[i] for t in ref)
                verdict = "met" if statistics.median(xs) <= BUDGET_MS else "not met"
                print(row(f"{name} ({files} file(s), {nbytes / 1e3:.0f} KB)", clock, xs,
                          f"{ratio:.2f} x the reference; budget {BUDGET_MS:.0f} ms (median): **{verdict}**"))
        print(json.dumps(times))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
