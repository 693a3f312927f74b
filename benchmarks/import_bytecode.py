"""A serving process's imports with and without compiled bytecode (what Dockerfile.runtime ships).

Fresh processes, interleaved, each importing what the runtime image's entry imports (``torch``,
``zstandard``; ``--modules`` changes it) under ``PYTHONDONTWRITEBYTECODE=1`` as the image runs:

* ``bytecode``: the interpreter's own ``__pycache__`` files (as compileall leaves them);
* ``none``: ``PYTHONPYCACHEPREFIX`` set to an empty directory, so no ``.pyc`` is found and every
  module is compiled from source in memory, as in an image whose ``__pycache__`` was deleted.

Reported: wall seconds (min / median / max) and the ratio of medians.

Usage: python benchmarks/import_bytecode.py [--rounds 5] [--python PY] [--modules torch,zstandard]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def run(python: str, modules: str, bytecode: bool, empty: str) -> float:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    if not bytecode:
        env["PYTHONPYCACHEPREFIX"] = empty
    start = time.perf_counter()
    subprocess.run([python, "-c", f"import {modules}"], env=env, check=True, timeout=600)
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--modules", default="torch,zstandard")
    args = ap.parse_args()
    times: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as empty:
        for i in range(args.rounds):
            for bytecode in ((True, False) if i % 2 == 0 else (False, True)):
                times[bytecode].append(run(args.python, args.modules, bytecode, empty))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"import {args.modules} in {args.python}, {args.rounds} rounds, fresh processes")
    for k, label in ((True, "with bytecode"), (False, "without (compiled at start)")):
        v = times[k]
        print(f"  {label:28} {min(v):6.2f} / {med[k]:6.2f} / {max(v):6.2f} s")
    print(f"  without / with: {med[False] / med[True]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
