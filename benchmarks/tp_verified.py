"""What a verified tensor-parallel rank hashes and reads against its share (gloo ranks on CPU).

A Llama (width 512, 8 heads and 8 key/value heads so that TP 8 splits whole heads, 4 layers)
is built with packer at the default chunk size (1 MiB, whose chunks are cut at the ranks' splits
for TP 2, 4 and 8: ``packer-chunks/v2``, packer/runtime/chunks.py). For TP 2, 4 and 8, each rank
runs ``tests/tp_verify_worker.py``: the emitted loader's ``from_pretrained(tp_plan="auto",
verify=True)`` on its own copy of the build, then a second verified load on that copy dropped
from the page cache, counting ``read_bytes`` of ``/proc/self/io`` (what it read from the disk).
The share of a rank is ``1/N`` of the tensors the plan shards plus the replicated ones; the
header and the small files (manifest, chunk table, signature) are not in it. Logits are compared
bitwise across the ranks of each degree.

Usage: .venv/bin/python benchmarks/tp_verified.py [--degrees 2,4,8] [--layers 4]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "benchmarks" / "_work" / "tp_verified"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--degrees", default="2,4,8")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    import torch

    from tests.built import build_dir, open_build
    from tests.hf_fixtures import llama
    from tests.test_chunks import WEIGHTS, _per_rank, _ranks

    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    llama(WORK / "hf", hidden=512, heads=8, kv_heads=8, intermediate=1536, layers=args.layers, vocab=1024, tied=False)
    build_dir(WORK / "hf", WORK / "out")
    fc = open_build(WORK / "out").chunk_table()[WEIGHTS]
    print(f"untied Llama, width 512, {args.layers} layers: weight file {fc.size / 1e6:.2f} MB in {fc.total} chunks "
          f"of at most {fc.chunk // 2**20} MiB, cut at {len(fc.cuts) - 1} offsets")
    print(f"{'TP':>3} {'rank':>4} {'share MB':>9} {'hashed MB':>10} {'hashed/share':>13} {'disk MB':>8} "
          f"{'disk/share':>11}")
    same = True
    for world in (int(d) for d in args.degrees.split(",")):
        work, logits = WORK / f"tp{world}", None
        ours = _ranks(_per_rank(WORK / "out", work, world), world)
        for r, got in enumerate(ours):
            if got["error"]:
                print(f"TP {world} rank {r}: {got['error']}")
                return 1
            share = got["sharded"] / world + got["replicated"]
            print(f"{world:>3} {r:>4} {share / 1e6:9.3f} {got['hashed'] / 1e6:10.3f} {got['hashed'] / share:13.4f} "
                  f"{got['disk'] / 1e6:8.3f} {got['disk'] / share:11.4f}")
            logits = got["logits"] if logits is None else logits
            same &= torch.equal(logits, got["logits"])
        shutil.rmtree(work)
    print(f"logits bitwise equal across the ranks of each degree: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
