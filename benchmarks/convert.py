"""Benchmark: ``packer convert`` against ``cp`` and the torch.load + save_file reference.

Generates (once, cached under benchmarks/_work/) a llama-style bf16 checkpoint with tied
embeddings, in torch's zip format and again in the legacy format, warms the page cache and
runs every contender several times, interleaved, printing min/median/max wall times and the
ratios, then the peak anonymous memory of a conversion at two checkpoint sizes.

    .venv/bin/python benchmarks/convert.py [--reps 5] [--gb 1.0] [--small-gb 0.5] [--clean]

packer runs in-process (the function ``packer convert`` calls; sha256 of every output is
computed while writing). The reference runs in a subprocess with torch already imported
before its clock starts (so torch's import time is not charged to it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "benchmarks" / "_work"
HIDDEN, INTER, VOCAB = 2048, 5632, 32000


def _layers_for(gb: float) -> int:
    per_layer = 2 * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER + 2 * HIDDEN)
    return max(1, math.ceil((gb * 1e9 - 2 * VOCAB * HIDDEN) / per_layer))


def generate(gb: float, fmt: str) -> Path:
    """A llama-like bf16 state dict of about ``gb`` GB with lm_head tied to embed_tokens."""
    path = WORK / f"llama_{gb:g}gb_{fmt}.bin"
    if path.exists():
        return path
    import torch

    torch.manual_seed(0)
    emb = torch.empty(VOCAB, HIDDEN, dtype=torch.bfloat16).normal_()
    sd = {"model.embed_tokens.weight": emb, "lm_head.weight": emb,
          "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
    shapes = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, HIDDEN),
              "self_attn.v_proj": (HIDDEN, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
              "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
              "mlp.down_proj": (HIDDEN, INTER)}
    for i in range(_layers_for(gb)):
        for name, shape in shapes.items():
            sd[f"model.layers.{i}.{name}.weight"] = torch.empty(shape, dtype=torch.bfloat16).normal_()
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[f"model.layers.{i}.{norm}.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    tmp = path.with_suffix(".tmp")
    torch.save(sd, tmp, _use_new_zipfile_serialization=(fmt == "zip"))
    os.replace(tmp, path)
    return path


def warm(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(64 * 2**20):
            pass


def settle() -> None:
    """Every contender starts with no dirty pages and the last one's clean-up behind it."""
    os.sync()
    time.sleep(1.0)


def time_cp(src: Path) -> dict[str, float]:
    dst = WORK / "cp.out"
    settle()
    t = time.perf_counter()
    subprocess.run(["cp", str(src), str(dst)], check=True)
    elapsed = time.perf_counter() - t
    dst.unlink()
    return {"cp": elapsed}


def time_sha256(src: Path) -> dict[str, float]:
    """hashlib over the input alone: the floor for any converter that hashes its output."""
    import hashlib
    import mmap

    settle()
    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        t = time.perf_counter()
        h, view = hashlib.sha256(), memoryview(mm)
        for i in range(0, len(mm), 8 << 20):
            h.update(view[i:i + (8 << 20)])
        elapsed = time.perf_counter() - t
        view.release()
    return {"sha256 of the input alone (hashlib)": elapsed}


PACKER = """
import sys, time
from pathlib import Path
from packer.recipe import WeightsConfig
from packer.weights.convert import convert
t = time.perf_counter()
result = convert(Path(sys.argv[1]), Path(sys.argv[2]), WeightsConfig(), verify=sys.argv[3] == "1")
assert all(len(f.sha256) == 64 for f in result.files)
print(time.perf_counter() - t)
"""

REFERENCE = """
import hashlib, sys, time
t0 = time.perf_counter()
import torch
from safetensors.torch import save_file
src, dst, mmap = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
t = time.perf_counter()
sd = torch.load(src, mmap=mmap, weights_only=True, map_location="cpu")
seen, out = set(), {}
for k, v in sd.items():  # what the reference converters do with ties: keep the first name
    if v.untyped_storage().data_ptr() in seen:
        continue
    seen.add(v.untyped_storage().data_ptr())
    out[k] = v.contiguous()
save_file(out, dst, metadata={"format": "pt"})
saved = time.perf_counter() - t
h = hashlib.sha256()
with open(dst, "rb", buffering=0) as f:
    while chunk := f.read(8 << 20):
        h.update(chunk)
print(saved, time.perf_counter() - t, t - t0)
"""


def _process(args: list[str]) -> tuple[float, list[float]]:
    settle()
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        return wall, []
    return wall, [float(x) for x in done.stdout.split()]


def time_packer(src: Path, verify: bool) -> dict[str, float]:
    out = WORK / "packer.out"
    shutil.rmtree(out, ignore_errors=True)
    wall, (inside,) = _process([PACKER, str(src), str(out), str(int(verify))])
    shutil.rmtree(out)
    name = "packer convert" + (" --verify" if verify else "")
    return {f"{name} (in-process)": inside, f"{name} (whole process)": wall}


def time_reference(src: Path, mmap: bool) -> dict[str, float]:
    dst = WORK / "ref.safetensors"
    wall, times = _process([REFERENCE, str(src), str(dst), str(int(mmap))])
    dst.unlink(missing_ok=True)
    if not times:
        return {}  # torch.load(mmap=True) cannot read legacy files
    name = "torch.load(mmap=True) + save_file" if mmap else "torch.load + save_file"
    saved, hashed, imports = times
    return {f"{name} (in-process)": saved, f"{name} + sha256 (in-process)": hashed,
            f"{name} (whole process)": wall - (hashed - saved)}


MEMORY = """
import sys, threading, time
from pathlib import Path
from packer.recipe import WeightsConfig
from packer.weights.convert import convert

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
peak, stop = [anon()], False
base = peak[0]
def sample():
    while not stop:
        peak.append(anon()); time.sleep(0.002)
th = threading.Thread(target=sample); th.start()
convert(Path(sys.argv[1]), Path(sys.argv[2]), WeightsConfig(), verify=sys.argv[3] == "1")
stop = True; th.join()
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(base, max(peak), int(hwm) * 1024)
"""


def peak_memory(src: Path, verify: bool) -> tuple[int, int, int]:
    out = WORK / "mem.out"
    shutil.rmtree(out, ignore_errors=True)
    done = subprocess.run([sys.executable, "-c", MEMORY, str(src), str(out), str(int(verify))],
                          capture_output=True, text=True, check=True)
    shutil.rmtree(out)
    base, peak, hwm = (int(x) for x in done.stdout.split())
    return base, peak, hwm


def stats(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def base_parser(doc: str) -> argparse.ArgumentParser:
    """``--reps`` and ``--gb``: the options of every benchmark built on :func:`generate`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="interleaved rounds (each reported as min / median / max)")
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB")
    return parser


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--small-gb", type=float, default=0.5)
    parser.add_argument("--clean", action="store_true", help="delete the generated files after")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    files = {fmt: generate(args.gb, fmt) for fmt in ("zip", "legacy")}
    small = generate(args.small_gb, "zip")
    contenders = [
        time_cp,
        time_sha256,
        lambda s: time_packer(s, verify=False),
        lambda s: time_packer(s, verify=True),
        lambda s: time_reference(s, mmap=True),
        lambda s: time_reference(s, mmap=False),
    ]
    results: dict[str, dict[str, list[float]]] = {fmt: {} for fmt in files}
    for _ in range(args.reps):
        for fmt, src in files.items():
            warm(src)
            for fn in contenders:
                for name, value in fn(src).items():
                    results[fmt].setdefault(name, []).append(value)
    print(f"\n{args.reps} interleaved runs, warm page cache, {os.cpu_count()} CPUs; "
          "in-process = the conversion call only; whole process = interpreter, imports and all")
    print("\n| input | contender | wall s (min / median / max) | median / cp |")
    print("|---|---|---|---|")
    for fmt, src in files.items():
        size = src.stat().st_size / 1e9
        cp = statistics.median(results[fmt]["cp"])
        for name, vals in results[fmt].items():
            ratio = statistics.median(vals) / cp
            print(f"| {fmt} {size:.2f} GB | {name} | {stats(vals)} | {ratio:.2f}x |")
    print("\n| input | reference | packer | speed-up (median) |")
    print("|---|---|---|---|")
    for fmt in files:
        med = {n: statistics.median(v) for n, v in results[fmt].items()}
        for name in med:
            if name.startswith("torch.load"):
                mine = "packer convert (whole process)" if "whole" in name else \
                    "packer convert (in-process)"
                print(f"| {fmt} | {name} | {mine} | {med[name] / med[mine]:.2f}x |")
    print("\n| checkpoint | verify | baseline RssAnon | peak RssAnon | peak - baseline | VmHWM |")
    print("|---|---|---|---|---|---|")
    for src in (small, files["zip"]):
        for verify in (False, True):
            base, peak, hwm = peak_memory(src, verify)
            mib = lambda n: f"{n / 2**20:.0f} MiB"  # noqa: E731
            print(f"| {src.stat().st_size / 1e9:.2f} GB | {verify} | {mib(base)} | {mib(peak)} "
                  f"| {mib(peak - base)} | {mib(hwm)} |")
    (WORK / "convert_results.json").write_text(json.dumps(results, indent=1))
    if args.clean:
        for p in (*files.values(), small):
            p.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
