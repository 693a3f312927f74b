"""CPU load benchmark: packer's loader vs safetensors and torch.load, warm page cache.

Generates a >= 1 GB model once under benchmarks/_work/ (safetensors + the same weights as a
torch pickle), then measures, interleaved, min/median/max of:

* time to a usable state dict: ``Loader.load_weights("cpu")`` (mapped views),
  ``safetensors.torch.load_file``, ``torch.load(weights_only=True, mmap=True)`` (lazy views of the
  file, the fair peer of packer's mapped views) and ``mmap=False`` (an eager read);
* a forced private copy: ``load_weights("cpu", copy=True)`` (fresh memory, 4 KiB pages and
  again on huge pages with ``PACKER_HUGEPAGES=1``) and
  ``load_into(module)`` (existing tensors) against one ``readinto`` of the whole file into a
  preallocated buffer (throughput ratio, target >= 0.9);
* the loader's import cost beyond ``import torch`` (``python -X importtime``).

Usage: python benchmarks/load_cpu.py [--size-gb 1.1] [--reps 5] [--keep]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from packer.hashing import sha256_file
from packer.runtime.loader import Loader, Timeline

WORK = Path(__file__).resolve().parent / "_work" / "load_cpu"
REPO = Path(__file__).resolve().parents[1]


Tensors = dict[str, torch.Tensor]


def save_model(work: Path, size_gb: float, first: Callable[[torch.Generator], Tensors],
               layer: Callable[[int, torch.Generator], Tensors]) -> tuple[Path, Path]:
    """``first`` then ``layer(i)`` until ``size_gb`` GB, saved as safetensors and as a pickle (cached)."""
    st, pt = work / "weights" / "model.safetensors", work / "model.pt"
    if st.exists() and pt.exists() and st.stat().st_size >= size_gb * 1e9 * 0.95:
        return st, pt
    st.parent.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    sd = first(g)
    i = 0
    while sum(t.numel() * t.element_size() for t in sd.values()) < size_gb * 1e9:
        sd.update(layer(i, g))
        i += 1
    save_file(sd, str(st))
    torch.save(sd, str(pt))
    return st, pt


def generate(size_gb: float) -> tuple[Path, Path]:
    """A transformer-like state dict of ``size_gb`` GB in bf16 and f32, saved both ways."""

    def layer(i: int, g: torch.Generator) -> Tensors:
        return {f"layers.{i}.attn.qkv.weight": torch.randn(3072, 1024, generator=g).to(torch.bfloat16),
                f"layers.{i}.mlp.up.weight": torch.randn(4096, 1024, generator=g).to(torch.bfloat16),
                f"layers.{i}.mlp.down.weight": torch.randn(1024, 4096, generator=g).to(torch.bfloat16),
                f"layers.{i}.norm.weight": torch.ones(1024),
                f"layers.{i}.mlp.up.bias": torch.zeros(4096)}

    def first(g: torch.Generator) -> Tensors:
        return {"embed.weight": torch.randn(32000, 1024, generator=g).to(torch.bfloat16)}

    return save_model(WORK, size_gb, first, layer)


def packer_layout(st: Path) -> Path:
    """``st`` converted by packer (tensors laid out as a build lays them out: 64-byte aligned
    where the sizes allow it), under ``WORK/packer/weights`` (cached)."""
    from packer.recipe import WeightsConfig
    from packer.weights.convert import convert

    out = WORK / "packer" / "weights"
    if not (out / "model.safetensors").exists():
        convert(st, out, WeightsConfig(), verify=False)
    return out / "model.safetensors"


def manifest(st: Path, *, aliases: dict[str, str] | None = None, device: str = "cpu") -> dict[str, Any]:
    """The embedded manifest a build would give the loader for the single file ``st``."""
    with open(st, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    rel = "weights/model.safetensors"
    size, digest = sha256_file(st)
    return {"name": "bench", "version": "1",
            "files": {rel: {"size": size, "sha256": digest}},
            "weights": {"files": [rel], "index": None, "total_size": size, "aliases": aliases or {},
                        "tensors": {k: {"file": rel, **v} for k, v in header.items()}},
            "bundle": None, "runtime": {"device": device, "warmup": []}}


def module_like(m: dict[str, Any]) -> torch.nn.Module:
    """A module whose state dict has the weights' names, shapes and dtypes (memory touched)."""
    from packer.runtime.env import DTYPES

    root = torch.nn.Module()
    for name, rec in m["weights"]["tensors"].items():
        *path, leaf = name.split(".")
        parent = root
        for p in path:
            if not hasattr(parent, p):
                parent.add_module(p, torch.nn.Module())
            parent = getattr(parent, p)
        parent.register_buffer(leaf, torch.zeros(rec["shape"], dtype=getattr(torch, DTYPES[rec["dtype"]][0])))
    return root


def readinto_whole(path: Path, buf: bytearray) -> None:
    with open(path, "rb", buffering=0) as f:
        view, got = memoryview(buf), 0
        while got < len(buf) and (n := f.readinto(view[got:])):
            got += n


def timed(fn: Callable[[], Any]) -> float:
    gc.collect()
    start = time.perf_counter()
    result = fn()
    secs = time.perf_counter() - start
    del result
    return secs


def import_cost(reps: int, *, compile_: bool) -> list[float]:
    """ms of ``import packer.runtime.loader`` after ``import torch`` (-X importtime cumulative).

    ``compile_`` runs with -B and no cached bytecode (as ``python packer_loader.py`` does for
    its main script); otherwise the .pyc written by a first import is used.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    code = "import torch; import packer.runtime.loader"
    flags = ["-B"] if compile_ else []
    if compile_:
        shutil.rmtree(REPO / "packer" / "runtime" / "__pycache__", ignore_errors=True)
    else:
        subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True)  # writes the .pyc
    out = []
    for _ in range(reps):
        r = subprocess.run([sys.executable, *flags, "-X", "importtime", "-c", code],
                           capture_output=True, text=True, cwd=REPO, env=env, check=True)
        total = 0
        for line in r.stderr.splitlines():
            parts = [p.strip() for p in line.split("|")]
            if len(parts) == 3 and parts[2] in ("packer", "packer.runtime", "packer.runtime.loader"):
                total += int(parts[1])  # three sibling entries: packer, packer.runtime, the loader
        out.append(total / 1000)
    return out


def row(name: str, xs: list[float], unit: str = "s", extra: str = "") -> str:
    return f"| {name} | {min(xs):.3f} | {statistics.median(xs):.3f} | {max(xs):.3f} | {unit} | {extra} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="keep benchmarks/_work/load_cpu")
    args = ap.parse_args()
    os.environ["PACKER_STARTUP_LOG"] = "off"
    st, pt = generate(args.size_gb)
    size = st.stat().st_size
    built = packer_layout(st)  # packer loads what packer built; the peers read the library's file
    m, root = manifest(built), built.parent.parent
    buf = bytearray(size)  # preallocated (and touched) once, as the reference requires
    for p in (st, pt, built):
        readinto_whole(p, bytearray(p.stat().st_size))  # warm the page cache
    module = module_like(m)
    keys = ("packer", "safetensors", "torch.load-mmap", "torch.load", "copy", "copy-thp", "into", "readinto")
    runs: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(args.reps):  # interleaved: every candidate once per round
        runs["packer"].append(timed(lambda: Loader(m, root, timeline=Timeline()).load_weights("cpu")))
        runs["safetensors"].append(timed(lambda: load_file(str(st))))
        runs["torch.load-mmap"].append(timed(lambda: torch.load(str(pt), weights_only=True, mmap=True)))
        runs["torch.load"].append(timed(lambda: torch.load(str(pt), weights_only=True, mmap=False)))
        runs["copy"].append(timed(lambda: Loader(m, root, timeline=Timeline()).load_weights("cpu", copy=True)))
        os.environ["PACKER_HUGEPAGES"] = "1"
        runs["copy-thp"].append(timed(lambda: Loader(m, root, timeline=Timeline()).load_weights("cpu", copy=True)))
        del os.environ["PACKER_HUGEPAGES"]
        runs["into"].append(timed(lambda: Loader(m, root, timeline=Timeline()).load_into(module)))
        runs["readinto"].append(timed(lambda: readinto_whole(built, buf)))
    imports = import_cost(args.reps, compile_=False)
    compiled = import_cost(args.reps, compile_=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    gbps = {k: size / 1e9 / med[k] for k in ("copy", "copy-thp", "into", "readinto")}
    print(f"model: {size / 1e9:.2f} GB, {len(m['weights']['tensors'])} tensors, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {args.reps} interleaved rounds\n")
    print("| measure | min | median | max | unit | note |\n|---|---|---|---|---|---|")
    print(row("packer load_weights(cpu): usable state dict", runs["packer"], extra="mapped views"))
    print(row("safetensors.torch.load_file", runs["safetensors"],
              extra=f"packer is {med['safetensors'] / med['packer']:.1f}x faster (median)"))
    print(row("torch.load(weights_only=True, mmap=True) of a pickle", runs["torch.load-mmap"],
              extra=f"packer is {med['torch.load-mmap'] / med['packer']:.1f}x faster (median; both lazy views)"))
    print(row("torch.load(weights_only=True, mmap=False) of a pickle", runs["torch.load"],
              extra=f"packer is {med['torch.load'] / med['packer']:.0f}x faster (median; an eager read)"))
    print(row("packer load_weights(cpu, copy=True): private copy", runs["copy"], extra=f"{gbps['copy']:.2f} GB/s"))
    print(row("the same on huge pages (PACKER_HUGEPAGES=1)", runs["copy-thp"], extra=f"{gbps['copy-thp']:.2f} GB/s"))
    print(row("packer load_into(module on cpu): into existing tensors", runs["into"],
              extra=f"{gbps['into']:.2f} GB/s"))
    print(row("one readinto of the whole file (preallocated)", runs["readinto"],
              extra=f"{gbps['readinto']:.2f} GB/s; copy/readinto = {gbps['copy'] / gbps['readinto']:.2f}x "
                    f"({gbps['copy-thp'] / gbps['readinto']:.2f}x huge pages), "
                    f"load_into/readinto = {gbps['into'] / gbps['readinto']:.2f}x"))
    print(row("import packer.runtime.loader beyond torch (cached .pyc)", imports, unit="ms",
              extra="-X importtime cumulative"))
    print(row("same, compiling the source (-B, as a script)", compiled, unit="ms", extra="no .pyc"))
    if not args.keep:
        shutil.rmtree(WORK)
    return 0


if __name__ == "__main__":
    sys.exit(main())
