"""Benchmark: a whole ``packer build`` of a ~1 GB checkpoint with and without ``--sign-key``.

Signing must add no pass over the weights: ``model.sig`` is made from the digests the
manifest already holds, and the provenance from the final manifest. The same model directory
as ``benchmarks/build.py`` (the CLI in a fresh process, sandboxed weights stage, image layers,
final verification), unsigned and signed builds interleaved, warm page cache. Prints
min/median/max of the whole process for both, their ratio, and the two signing stages from
``OUT/build-timings.json`` (seconds and bytes they processed).

    .venv/bin/python benchmarks/sign.py [--reps 5] [--gb 1.0]
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build import model_dir, time_build  # noqa: E402
from convert import WORK, base_parser, generate, stats, warm  # noqa: E402


def make_key(where: Path) -> Path:
    """A fresh P-256 signing key (PEM, unencrypted)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    path = where / "signing.pem"
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def main() -> None:
    args = base_parser(__doc__).parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    src = generate(args.gb, "zip")
    root = model_dir(src)
    key = make_key(root)
    walls: dict[str, list[float]] = {"unsigned": [], "signed": []}
    stages: dict[str, list[float]] = {"sign": [], "provenance": [], "weights": [], "verify": []}
    try:
        for _ in range(args.reps):
            warm(src)
            walls["unsigned"].append(time_build(root)[0])
            wall, parts = time_build(root, "--sign-key", str(key))
            walls["signed"].append(wall)
            for name in stages:
                stages[name].append(parts[name])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = statistics.median(walls["unsigned"])
    print(f"\n{args.reps} interleaved runs, {os.cpu_count()} CPUs, {src.stat().st_size / 1e9:.2f} GB zip "
          "checkpoint, warm page cache\n")
    print("| what | seconds (min / median / max) | median / unsigned |\n|---|---|---|")
    for name, vals in walls.items():
        print(f"| packer build, {name}, whole process | {stats(vals)} | {statistics.median(vals) / base:.3f}x |")
    for name, vals in stages.items():
        print(f"| signed build, stage: {name} | {stats(vals)} | {statistics.median(vals) / base:.3f}x |")


if __name__ == "__main__":
    main()
