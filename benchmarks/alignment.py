"""What 64-byte aligned tensors cost: header padding, tensors copied at CPU load, load time.

For each model the weights are converted by the ``packer`` on ``PYTHONPATH`` (run once with
this tree, once with main's, to put them side by side), then:

* header padding: the spaces after the header JSON (bytes) and the data start mod 64;
* tensors, of them with a size that is a multiple of 64 bytes, of them at a 64-aligned
  file offset, and the number whose offset is not aligned (main: unaligned views after a CPU
  load; this tree: the tensors the loader copies);
* the tensors whose data pointer is not 64-aligned after ``load_weights("cpu")``;
* min/median/max seconds of ``load_weights("cpu")`` (views) over interleaved rounds, page cache warm.

Models: the demo (a llama-style bf16 checkpoint), the tests' tiny diffusers UNet, and a
transformer-like model of ``--size-gb`` GB (benchmarks/load_cpu.py's generator).

Usage: PYTHONPATH=TREE python benchmarks/alignment.py [--size-gb 1.1] [--reps 7]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from packer.recipe import WeightsConfig
from packer.runtime.loading import Loader
from packer.runtime.timeline import Timeline
from packer.weights.convert import convert

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # load_cpu's generator; packer and tests come from PYTHONPATH


def demo_source(work: Path) -> Path:
    from packer.demo import write_demo

    (work / "demo").mkdir()
    return write_demo(work / "demo")


def unet_source(work: Path) -> Path:
    from safetensors.torch import save_file

    from tests.component_fixtures import diffusers_pipeline

    pipe = diffusers_pipeline(work / "sd")  # leaves pickles; the UNet as one safetensors file
    src = work / "unet"
    src.mkdir()
    save_file({k: v.contiguous() for k, v in pipe.unet.state_dict().items()}, str(src / "model.safetensors"))
    return src


def transformer_source(work: Path, size_gb: float) -> Path:
    from load_cpu import generate  # cached under benchmarks/_work/load_cpu

    st, _ = generate(size_gb)
    return st.parent


def header_facts(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        text = f.read(n)
    header = json.loads(text)
    header.pop("__metadata__", None)
    start = 8 + n
    spans = [tuple(v["data_offsets"]) for v in header.values()]
    return {"header_bytes": start, "padding": len(text) - len(text.rstrip(b" ")),
            "data_start_mod_64": start % 64, "tensors": len(spans),
            "size_multiple_of_64": sum((e - b) % 64 == 0 for b, e in spans),
            "at_aligned_offset": sum((start + b) % 64 == 0 for b, e in spans if e > b),
            "misaligned_offset": sum((start + b) % 64 != 0 for b, e in spans if e > b),
            "header": header}


def manifest(path: Path, header: dict[str, Any]) -> dict[str, Any]:
    from packer.hashing import sha256_file

    rel = "weights/model.safetensors"
    size, digest = sha256_file(path)
    return {"name": "bench", "version": "1", "files": {rel: {"size": size, "sha256": digest}},
            "weights": {"files": [rel], "index": None, "total_size": size, "aliases": {},
                        "tensors": {k: {"file": rel, **v} for k, v in header.items()}},
            "bundle": None, "runtime": {"device": "cpu", "warmup": []}}


def measure(name: str, src: Path, work: Path, reps: int) -> dict[str, Any]:
    out = work / f"{name}-out"
    convert(src, out / "weights", WeightsConfig(), verify=False)
    files = sorted((out / "weights").glob("*.safetensors"))
    assert len(files) == 1, files  # one shard each (the default shard size)
    facts = header_facts(files[0])
    m = manifest(files[0], facts.pop("header"))
    ld = Loader(m, out, timeline=Timeline())
    sd = ld.load_weights("cpu")
    facts["unaligned_after_load"] = sum(t.data_ptr() % 64 != 0 for t in sd.values())
    copied = getattr(ld, "last_copied", [])  # this tree: the tensors copied to be aligned
    facts["copied"] = [len(copied), sum(sd[n].numel() * sd[n].element_size() for n in copied)]
    del sd
    times = []
    for _ in range(reps):
        gc.collect()
        start = time.perf_counter()
        sd = Loader(m, out, timeline=Timeline()).load_weights("cpu")
        times.append(time.perf_counter() - start)
        del sd
    facts["load_s"] = [round(min(times), 4), round(statistics.median(times), 4), round(max(times), 4)]
    facts["bytes"] = files[0].stat().st_size
    shutil.rmtree(out)
    return facts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.1)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    os.environ["PACKER_STARTUP_LOG"] = "off"
    import packer

    print(f"packer from {Path(packer.__file__).parent.parent}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, {args.reps} rounds", flush=True)
    with tempfile.TemporaryDirectory(dir=BENCH / "_work" if (BENCH / "_work").is_dir() else None) as tmp:
        work = Path(tmp)
        sources = {"demo": demo_source(work), "tiny UNet": unet_source(work),
                   f"transformer {args.size_gb} GB": transformer_source(work, args.size_gb)}
        for name, src in sources.items():
            print(json.dumps({"model": name, **measure(name.split()[0], src, work, args.reps)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
