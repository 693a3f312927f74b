"""Bytes read per rank under tensor parallelism (2 gloo ranks on CPU): packer against transformers.

Two processes per contender run ``tests/tp_worker.py``: packer's emitted loader
``from_pretrained(AutoModelForCausalLM, tp_plan="auto")`` and transformers' own
``from_pretrained(tp_plan="auto")`` on the same weight files, each rank on its own copy of them
dropped from the page cache, counting ``read_bytes`` of ``/proc/self/io`` from the start of the
load to the end of the first forward pass. The share of a rank is 1/2 of the tensors the plan
shards plus the replicated ones. Logits are compared bitwise between the contenders.

Usage: .venv/bin/python benchmarks/tp_bytes.py [--layers 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "benchmarks" / "_work" / "tp_bytes"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    import torch

    from tests.test_tp import WIDE, prepare, ranks

    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    prepare(WORK, 2, **{**WIDE, "layers": args.layers, "tied": False})
    ratios: dict[str, list[list[float]]] = {"packer": [[], []], "hf": [[], []]}
    same = True
    for _ in range(args.rounds):
        got = {mode: ranks(WORK, mode) for mode in ("packer", "hf")}
        same &= all(torch.equal(got["packer"][r]["logits"], got["hf"][r]["logits"]) for r in range(2))
        for mode, res in got.items():
            for r in range(2):
                share = got["packer"][r]["sharded"] / 2 + got["packer"][r]["replicated"]
                ratios[mode][r].append(res[r]["read_bytes"] / share)
    p0 = got["packer"][0]
    print(f"untied Llama, width 512, {args.layers} layers: sharded {p0['sharded'] / 1e6:.2f} MB, replicated "
          f"{p0['replicated'] / 1e6:.3f} MB; share per rank {(p0['sharded'] / 2 + p0['replicated']) / 1e6:.2f} MB; "
          f"logits bitwise equal: {same}")
    print(f"{'read_bytes / share (min / median / max)':42} {'rank 0':>22} {'rank 1':>22}")
    for mode, label in (("packer", "packer from_pretrained(tp_plan='auto')"),
                        ("hf", "transformers from_pretrained(tp_plan=...)")):
        cells = [f"{min(v):.3f} / {statistics.median(v):.3f} / {max(v):.3f}" for v in ratios[mode]]
        print(f"{label:42} {cells[0]:>22} {cells[1]:>22}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
