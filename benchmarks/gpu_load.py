"""GPU check for packer's loader (one script, < 3 minutes on one NVIDIA GPU).

* correctness: ``load_weights("cuda")`` bitwise against ``safetensors.torch.load_file(device="cuda")``
  (plus the dtype override, ``load_into`` and a CUDA-graph warm-up on a small model);
* throughput from a warm page cache against a measured pinned host-to-device probe
  (1 GiB pinned tensor copied in 64 MiB chunks, non_blocking, on a side stream);
* pinned host memory the loader used, time to the first tensor on the device;
* the same model through safetensors and ``torch.load`` for comparison.

Prints a markdown table. Exits 0 with a message when there is no CUDA device, 1 when a
correctness check fails.

Usage: python benchmarks/gpu_load.py [--size-gb 4] [--reps 3] [--keep]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from load_cpu import manifest, module_like, save_model  # the same helpers as the CPU benchmark

WORK = Path(os.environ.get("PACKER_BENCH_WORK", Path(__file__).resolve().parent / "_work" / "gpu_load"))
GIB = 2**30
CHUNK = 64 * 2**20


def generate(size_gb: float) -> tuple[Path, Path]:
    """bf16 and f32 tensors of ``size_gb`` GB (one odd-sized tensor), safetensors and pickle."""
    return save_model(WORK, size_gb, lambda g: {"odd": torch.randn(1001, 3, generator=g)},
                      lambda i, g: {f"layers.{i}.w": torch.randn(8192, 8192, generator=g).to(torch.bfloat16),
                                    f"layers.{i}.b": torch.randn(8192, generator=g)})  # fmt: skip


def warm(path: Path) -> None:
    buf = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def pinned_probe() -> float:
    """GB/s of 1 GiB pinned -> device in 64 MiB non_blocking chunks on a side stream (best of 3)."""
    src = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    stream, best = torch.cuda.Stream(), 0.0
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            for a in range(0, GIB, CHUNK):
                dst[a: a + CHUNK].copy_(src[a: a + CHUNK], non_blocking=True)
        stream.synchronize()
        best = max(best, GIB / 1e9 / (time.perf_counter() - start))
    del src, dst
    empty_host_cache()
    return best


def empty_host_cache() -> None:
    getattr(torch._C, "_host_emptyCache", lambda: None)()


def pinned_peak() -> int:
    stats = getattr(torch.cuda, "host_memory_stats", dict)()
    return int(stats.get("allocated_bytes.peak", -1))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    bad = [k for k in b if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
           or not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))]  # fmt: skip
    return bad


def checks(ld: Any, ref: dict[str, torch.Tensor]) -> list[str]:
    """dtype override, load_into straight into parameters, the graph pool on a small model."""
    from packer.runtime import loader as L

    problems = []
    sd = ld.load_weights("cuda", dtype=torch.float16)
    if not all(torch.equal(sd[k], v.to(torch.float16)) for k, v in ref.items()) or sd["tied"] is not sd["odd"]:
        problems.append("dtype override / alias differs")
    del sd
    mod = module_like(ld.manifest).cuda()  # a module whose state dict keys are the tensor names
    missing, unexpected = ld.load_into(mod, strict=False)
    got = mod.state_dict()
    if missing or unexpected != ["tied"] or not all(torch.equal(got[k], v) for k, v in ref.items()):
        problems.append("load_into differs")
    del mod, got
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()
    fn = L.warmup(model, [torch.randn(16, 64, device="cuda"), torch.randn(4, 64, device="cuda")], cuda_graphs=True)
    x = torch.randn(16, 64, device="cuda")
    with torch.inference_mode():
        want = model(x)
    if not torch.allclose(fn(x), want, atol=1e-5) or fn.replays != 1 or len(fn.graphs) != 2:
        problems.append(f"CUDA graph pool: replays={fn.replays} graphs={len(fn.graphs)}")
    fn(torch.randn(5, 64, device="cuda"))
    if fn.fallbacks != 1:
        problems.append("graph pool fallback not taken")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_load: no CUDA device here (torch.cuda.is_available() is False); nothing to measure")
        return 0
    os.environ.setdefault("PACKER_STARTUP_LOG", "off")
    from safetensors import safe_open
    from safetensors.torch import load_file

    from packer.runtime import loader as L

    torch.cuda.init()
    st, pt = generate(args.size_gb)
    size = st.stat().st_size
    m = manifest(st, aliases={"tied": "odd"}, device="cuda")
    for p in (st, pt):
        warm(p)
    probe = pinned_probe()
    ld = L.Loader(m, WORK, timeline=L.Timeline())
    runs: dict[str, list[float]] = {"packer": [], "safetensors": [], "torch.load": []}
    first: dict[str, list[float]] = {"packer": [], "safetensors": []}
    problems: list[str] = []
    ref: dict[str, torch.Tensor] = {}
    host_peak = 0
    alloc_peak = 0
    for rep in range(args.reps):
        empty_host_cache()
        getattr(torch.cuda, "reset_peak_host_memory_stats", lambda: None)()
        secs, sd = timed(lambda: ld.load_weights("cuda"))
        runs["packer"].append(secs)
        first["packer"].append(secs)  # the ring hands over every tensor at once
        host_peak = max(host_peak, ld.last_stats.host_bytes if ld.last_stats else 0)
        alloc_peak = max(alloc_peak, pinned_peak())
        secs, ref = timed(lambda: load_file(str(st), device="cuda"))
        runs["safetensors"].append(secs)
        if rep == 0:
            problems += [f"tensor {k!r} differs from safetensors" for k in same(sd, ref)]
            if sd["tied"] is not sd["odd"]:
                problems.append("alias is not the same tensor")
        del sd
        start = time.perf_counter()
        with safe_open(str(st), framework="pt", device="cuda") as f:
            f.get_tensor(next(iter(f.keys())))
            torch.cuda.synchronize()
            first["safetensors"].append(time.perf_counter() - start)
        if rep < 2:  # the slowest: two rounds keep the script under 3 minutes
            runs["torch.load"].append(timed(lambda: torch.load(str(pt), map_location="cuda", weights_only=True))[0])
    problems += checks(ld, {k: v for k, v in ref.items()})
    del ref
    med = {k: statistics.median(v) for k, v in runs.items()}
    gbps = {k: size / 1e9 / v for k, v in med.items()}
    print(f"{torch.cuda.get_device_name()}, model {size / 1e9:.2f} GB, torch {torch.__version__}, "
          f"{args.reps} rounds\n")
    print("| measure | value | target |\n|---|---|---|")
    print(f"| pinned host->device probe (1 GiB, 64 MiB chunks) | {probe:.1f} GB/s | |")
    print(f"| packer load_weights(cuda), median | {med['packer']:.3f} s, {gbps['packer']:.1f} GB/s "
          f"({gbps['packer'] / probe:.0%} of probe) | >= 80% of probe |")
    print(f"| safetensors load_file(device=cuda), median | {med['safetensors']:.3f} s, {gbps['safetensors']:.1f} GB/s "
          f"(packer {med['safetensors'] / med['packer']:.1f}x faster) | >= 3x |")
    print(f"| torch.load(map_location=cuda), median | {med['torch.load']:.3f} s, {gbps['torch.load']:.1f} GB/s "
          f"(packer {med['torch.load'] / med['packer']:.1f}x faster) | |")
    print(f"| pinned host memory: ring / allocator peak | {host_peak / 2**20:.0f} MiB / "
          f"{alloc_peak / 2**20:.0f} MiB | <= 512 MiB |")
    print(f"| time to first tensor: packer (all tensors) / safetensors (one) | "
          f"{statistics.median(first['packer']):.3f} s / {statistics.median(first['safetensors']):.3f} s | |")
    print(f"| min/max packer | {min(runs['packer']):.3f} / {max(runs['packer']):.3f} s | |")
    print(f"| correctness | {'ok' if not problems else '; '.join(problems)} | bitwise |")
    print("\nstage table of the last load:")
    for s in ld.report():
        if s["stage"] in ("headers", "read", "host->device"):
            print(f"  {s['stage']}: {s['seconds']:.3f}s {s['bytes'] / 1e9:.2f} GB {s['gbps'] or 0:.1f} GB/s")
    if not args.keep:
        shutil.rmtree(WORK, ignore_errors=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
