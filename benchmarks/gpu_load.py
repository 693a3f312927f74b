"""GPU check for packer's loader: bitwise every round, race hunting, and what limits the speed.

Runs from the repository root on a bare GPU machine (no packer installed, no zstandard): the
script puts the repository on ``sys.path`` itself. As each measurement finishes it rewrites,
under ``--out`` (default ``$OUT``, else ``benchmarks/_work/gpu_out``):

* ``gpu_load.md``: the tables (every figure says warm or cold page cache);
* ``gpu_load.json``: raw timings of every round, settings, environment, problems found;
* ``gpu_load_trace.json``: the Chrome trace of packer's loads (Perfetto, chrome://tracing).

Measured, on a bf16/f32 model of ``--size-gb`` GB (f32 of odd size first, so every bf16 tensor
sits at a misaligned file offset, as safetensors packs them):

* probes: pinning (``cudaHostRegister`` of an anonymous mapping, as the ring does), a read-only
  probe (the loader's reader threads into pinned memory, no copy) and a transfer probe (pinned
  -> device, 64 MiB copies on a side stream, no reads); packer's figure is set against the
  smaller of the two: the pipeline cannot beat its slower stage;
* warm rounds (page cache filled first) of ``load_weights("cuda")``, safetensors
  ``load_file(device=DEV)`` and ``torch.load(map_location=DEV)``, then one cold round
  each (``POSIX_FADV_DONTNEED`` on the file first: the guest's page cache only);
* bitwise comparison with safetensors and 256-byte alignment in every packer round;
* race hunting: 2 slots of 1 MiB (slots reused thousands of times), a stream slowed before
  each copy (``torch.cuda._sleep``), a verified load (hash thread); each checked bitwise;
* dtype override, ``load_into`` and the CUDA graph pool on a small model.

Exit 0 with a line saying so when there is no CUDA device, 1 when a check fails.
``--smoke-cpu`` runs the same flow on the CPU stand-in engine (the tests do, on a tiny model):
its numbers mean nothing, it only proves the script runs to the end and writes its files.

Usage: python benchmarks/gpu_load.py [--size-gb 4] [--reps 3] [--out DIR] [--preflight] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]  # no packer installed on the GPU machine: use this checkout

import torch  # noqa: E402

WORK = Path(os.environ.get("PACKER_BENCH_WORK", HERE / "_work" / "gpu_load"))
GIB, MIB = 2**30, 2**20
CHUNK = 64 * MIB
DEV = "cuda"  # "cpu" with --smoke-cpu


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def pinned(nbytes: int) -> tuple[torch.Tensor, Callable[[], None], str]:
    """Staging memory as the ring has it: pinned on CUDA, plain memory for the smoke run."""
    from packer.runtime.engines import pinned_buffer

    if DEV == "cuda":
        return pinned_buffer(torch, nbytes)
    return torch.empty(nbytes, dtype=torch.uint8), lambda: None, "cpu"


class Report:
    """Raw data and the rendered tables, rewritten whole after every measurement."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.data: dict[str, Any] = {"settings": {}, "env": {}, "probes": {}, "rounds": {}, "race": {},
                                     "checks": {}, "problems": [], "stages": [], "finished": False}
        out.mkdir(parents=True, exist_ok=True)

    def save(self) -> None:
        _atomic(self.out / "gpu_load.json", json.dumps(self.data, indent=1, default=str) + "\n")
        _atomic(self.out / "gpu_load.md", render(self.data))


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def render(d: dict[str, Any]) -> str:
    """The markdown tables from whatever has been measured so far."""
    size = d["settings"].get("model_bytes", 0)
    env = d["env"]
    lines = [f"# gpu_load: {env.get('device', '?')}, torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}",
             "", f"model {size / 1e9:.2f} GB, {d['settings'].get('reps', '?')} warm rounds, "
             f"settings {json.dumps({k: v for k, v in d['settings'].items() if k != 'model_bytes'})}", "",
             "| probe | GB/s (median, min-max) | what |", "|---|---|---|"]
    for name, p in d["probes"].items():
        lines.append(f"| {name} | {_med(p['gbps']):.1f} ({min(p['gbps']):.1f}-{max(p['gbps']):.1f}) | {p['what']} |")
    lines += ["", "| contender | cache | rounds | median s | min-max s | GB/s (median) | bitwise, aligned |",
              "|---|---|---|---|---|---|---|"]
    for r in d["rounds"].values():
        secs = r["seconds"]
        if not secs:
            continue
        lines.append(f"| {r['label']} | {r['cache']} | {len(secs)} | {_med(secs):.3f} | {min(secs):.3f}-{max(secs):.3f}"
                     f" | {size / 1e9 / _med(secs):.1f} | {r.get('ok', '')} |")
    warm = d["rounds"].get("packer_warm", {}).get("seconds")
    probes = [_med(p["gbps"]) for k, p in d["probes"].items() if k in ("read-only", "transfer")]
    if warm and len(probes) == 2:
        g = size / 1e9 / _med(warm)
        lines += ["", f"packer warm: {g:.1f} GB/s = {g / min(probes):.0%} of the slower probe "
                  f"({'read-only' if probes[0] <= probes[1] else 'transfer'}, {min(probes):.1f} GB/s); "
                  "the pipeline reads and copies at once, so it cannot beat its slower stage"]
    if d["race"]:
        lines += ["", "| race hunt | seconds | chunks | early refills | bitwise |", "|---|---|---|---|---|"]
        lines += [f"| {k} | {v['seconds']:.3f} | {v['chunks']} | {v['early_refills']} | {v['ok']} |"
                  for k, v in d["race"].items()]
    if d["checks"]:
        lines += ["", "| check | result |", "|---|---|"] + [f"| {k} | {v} |" for k, v in d["checks"].items()]
    if d["stages"]:
        lines += ["", "stages of the last warm packer load:", ""]
        lines += [f"- {s['stage']}: {s['seconds']:.4f} s, {s['bytes'] / 1e9:.3f} GB, {s['gbps'] or 0:.1f} GB/s"
                  for s in d["stages"]]
    lines += ["", f"problems: {'; '.join(d['problems']) if d['problems'] else 'none'}",
              f"finished: {d['finished']}", ""]
    return "\n".join(lines)


def generate(size_gb: float) -> tuple[Path, Path]:
    """bf16 weights and f32 biases, one odd f32 first; made on the GPU (fast), saved both ways."""
    from load_cpu import save_model  # the same writer as the CPU benchmark

    cg = torch.Generator(device=DEV).manual_seed(0)
    n = 8192 if DEV == "cuda" else 512

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=cg, device=DEV)

    return save_model(WORK, size_gb, lambda g: {"odd": rand(1001, 3).cpu()},
                      lambda i, g: {f"layers.{i}.w": rand(n, n).to(torch.bfloat16).cpu(),
                                    f"layers.{i}.b": rand(n).cpu()})


def warm_cache(path: Path) -> None:
    buf = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def drop_cache(path: Path) -> None:
    """Drop ``path`` from this machine's page cache (clean pages only: the file was synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def pin_probe(nbytes: int) -> tuple[float, str]:
    """GB/s of pinning ``nbytes`` the way the ring does, and how it was pinned."""
    start = time.perf_counter()
    buf, free, kind = pinned(nbytes)
    secs = time.perf_counter() - start
    free()
    del buf
    return nbytes / 1e9 / secs, kind


def transfer_probe(reps: int) -> list[float]:
    """GB/s of 1 GiB pinned -> device in 64 MiB non_blocking copies on a side stream (no reads)."""
    n = GIB if DEV == "cuda" else CHUNK
    src, free, _ = pinned(n)
    dst = torch.empty(n, dtype=torch.uint8, device=DEV)
    stream, out = torch.cuda.Stream() if DEV == "cuda" else None, []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for a in range(0, n, CHUNK):
                dst[a: a + CHUNK].copy_(src[a: a + CHUNK], non_blocking=True)
        sync()
        out.append(n / 1e9 / (time.perf_counter() - start))
    del dst
    free()
    return out


def read_probe(path: Path, readers: int, slots: int, reps: int) -> list[float]:
    """GB/s of the loader's reader threads filling pinned slots from ``path`` (no copy)."""
    from packer.runtime.engines import host_view
    from packer.runtime.ring import Latch, Read, Readers

    bufs = [pinned(CHUNK) for _ in range(slots)]
    views = [host_view(b) for b, _, _ in bufs]
    fd, size, out = os.open(path, os.O_RDONLY), path.stat().st_size, []
    pool = Readers(readers, piece=CHUNK // 4)
    try:
        for _ in range(reps):
            latches = [Latch() for _ in views]
            for latch in latches:
                latch.ready.set()
            start = time.perf_counter()
            for i, off in enumerate(range(0, size, CHUNK)):
                k = i % slots
                latches[k].wait()
                pool.submit(latches[k], Read(fd, off, views[k][: min(CHUNK, size - off)]))
            for latch in latches:
                latch.wait()
            out.append(size / 1e9 / (time.perf_counter() - start))
    finally:
        pool.close()
        os.close(fd)
        for _, free, _ in bufs:
            free()
    return out


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - start, out


def differs(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose bytes, dtype or shape differ, or whose data is not 256-byte aligned."""
    bad = []
    for k, v in want.items():
        t = got.get(k)
        if (t is None or t.dtype != v.dtype or t.shape != v.shape
                or not torch.equal(t.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))):
            bad.append(f"{k} differs")
        elif t.numel() and t.data_ptr() % 256:
            bad.append(f"{k} misaligned ({t.data_ptr() % 256})")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(HERE / "_work" / "gpu_out"))
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip optional parts past this")
    ap.add_argument("--preflight", action="store_true", help="check the imports, then stop")
    ap.add_argument("--keep", action="store_true", help="keep the generated model")
    ap.add_argument("--smoke-cpu", action="store_true", help="the same flow on the CPU stand-in (tests)")
    args = ap.parse_args()
    os.environ.setdefault("PACKER_STARTUP_LOG", "off")
    import load_cpu  # noqa: F401
    import safetensors
    from safetensors.torch import load_file  # noqa: F401  (fail here, not after minutes)

    from packer.runtime import loader as L

    global DEV
    DEV = "cpu" if args.smoke_cpu else "cuda"

    if args.preflight:
        print(f"gpu_load: imports ok (packer from {Path(L.__file__).parents[2]}, torch {torch.__version__}, "
              f"safetensors {safetensors.__version__}, zstandard {'zstandard' in sys.modules})")
        return 0
    if DEV == "cuda" and not torch.cuda.is_available():
        print("gpu_load: no CUDA device here (torch.cuda.is_available() is False); nothing to measure")
        return 0
    rep = Report(Path(args.out))
    try:
        return run(args, rep, L)
    finally:
        rep.save()
        if not args.keep:
            shutil.rmtree(WORK, ignore_errors=True)


def run(args: argparse.Namespace, rep: Report, L: Any) -> int:
    t0 = time.perf_counter()
    d = rep.data
    if DEV == "cuda":
        torch.cuda.init()
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke run)"
    d["env"] = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
                "cpus": os.cpu_count(), "python": sys.version.split()[0]}
    st, pt = generate(args.size_gb)
    os.sync()
    from load_cpu import manifest

    m = manifest(st, aliases={"tied": "odd"}, device=DEV)
    ld = L.Loader(m, WORK, timeline=L.Timeline())
    env = {k: v for k, v in os.environ.items() if k.startswith(("PACKER_", "PYTORCH_", "CUDA_"))}
    d["settings"] = {"model_bytes": st.stat().st_size, "reps": args.reps, "slots": ld.slots, "chunk": ld.chunk,
                     "readers": ld.readers, "generate_s": round(time.perf_counter() - t0, 1), "env": env}
    rep.save()
    probes(rep, st, ld)
    warm_rounds(rep, ld, st, pt, args)
    cold_rounds(rep, ld, st, pt, time.perf_counter() - t0 < args.budget_s)
    race_hunt(rep, m, L)
    extra_checks(rep, ld, L)
    d["finished"] = True
    rep.save()
    print(render(d))
    return 1 if d["problems"] else 0


def probes(rep: Report, st: Path, ld: Any) -> None:
    d = rep.data
    pins = [pin_probe(ld.slots * ld.chunk) for _ in range(3)]
    d["probes"]["pinning"] = {"gbps": [g for g, _ in pins], "what": f"pin {ld.slots * ld.chunk // MIB} MiB "
                              f"as the ring does ({pins[0][1]}); paid once per process"}
    rep.save()
    warm_cache(st)
    d["probes"]["read-only"] = {"gbps": read_probe(st, ld.readers, ld.slots, 3),
                                "what": f"{ld.readers} reader threads into {ld.slots} pinned 64 MiB slots, "
                                        "warm cache, no copy"}
    rep.save()
    d["probes"]["transfer"] = {"gbps": transfer_probe(5), "what": "1 GiB pinned -> device, 64 MiB copies, no reads"}
    rep.save()


def _round(d: dict[str, Any], key: str, label: str, cache: str) -> dict[str, Any]:
    return d["rounds"].setdefault(key, {"label": label, "cache": cache, "seconds": []})


def warm_rounds(rep: Report, ld: Any, st: Path, pt: Path, args: argparse.Namespace) -> None:
    from safetensors.torch import load_file

    d = rep.data
    first = _round(d, "packer_first", f"packer load_weights({DEV}), first in the process", "warm, pins the ring")
    pk = _round(d, "packer_warm", f"packer load_weights({DEV})", "warm")
    sf = _round(d, "safetensors_warm", f"safetensors load_file(device={DEV})", "warm")
    tl = _round(d, "torch_load_warm", f"torch.load(map_location={DEV}, weights_only)", "warm")
    warm_cache(st)
    warm_cache(pt)
    secs, sd = timed(lambda: ld.load_weights(DEV, pipeline=True))
    first["seconds"].append(secs)
    first["pin_s"] = ld.last_stats.pin_seconds
    del sd
    bad: list[str] = []
    for i in range(args.reps):
        secs, ref = timed(lambda: load_file(str(st), device=DEV))
        sf["seconds"].append(secs)
        secs, sd = timed(lambda: ld.load_weights(DEV, pipeline=True))
        pk["seconds"].append(secs)
        pk.setdefault("pin_s", []).append(ld.last_stats.pin_seconds)
        bad += [f"warm round {i}: {b}" for b in differs(sd, ref)]
        if sd["tied"] is not sd["odd"]:
            bad.append(f"warm round {i}: alias is not the same tensor")
        del sd, ref
        pk["ok"] = "ok" if not bad else f"{len(bad)} problems"
        rep.save()
    d["problems"] += bad
    s = ld.last_stats
    pin_first, pin_warm = first["pin_s"], max(pk["pin_s"])
    d["checks"]["pinned ring"] = (f"{s.host_bytes // MIB} MiB ({s.host_kind}), pinned by the first load "
                                  f"in {pin_first:.3f} s, by the warm rounds in {pin_warm:.3f} s")
    stages = ld.report(trace=rep.out / "gpu_load_trace.json")
    last = max(i for i, x in enumerate(stages) if x["stage"] == "headers")
    d["stages"] = stages[last:]
    rep.save()
    for _ in range(2):  # the slowest contender: two rounds keep the script short
        tl["seconds"].append(timed(lambda: torch.load(str(pt), map_location=DEV, weights_only=True))[0])
        rep.save()


def cold_rounds(rep: Report, ld: Any, st: Path, pt: Path, with_torch_load: bool) -> None:
    from safetensors.torch import load_file

    d = rep.data
    label = "cold (fadvise DONTNEED)"
    drop_cache(st)
    secs, sd = timed(lambda: ld.load_weights(DEV, pipeline=True))
    pk = _round(d, "packer_cold", f"packer load_weights({DEV})", label)
    pk["seconds"].append(secs)
    rep.save()
    drop_cache(st)
    secs, ref = timed(lambda: load_file(str(st), device=DEV))
    _round(d, "safetensors_cold", f"safetensors load_file(device={DEV})", label)["seconds"].append(secs)
    bad = [f"cold round: {b}" for b in differs(sd, ref)]
    pk["ok"] = "ok" if not bad else f"{len(bad)} problems"
    d["problems"] += bad
    del sd, ref
    rep.save()
    if with_torch_load:
        drop_cache(pt)
        secs = timed(lambda: torch.load(str(pt), map_location=DEV, weights_only=True))[0]
        _round(d, "torch_load_cold", f"torch.load(map_location={DEV}, weights_only)", label)["seconds"].append(secs)
        rep.save()


def race_hunt(rep: Report, m: dict[str, Any], L: Any) -> None:
    """Small slots reused thousands of times, a slowed stream, a verified load: each bitwise."""
    from safetensors.torch import load_file

    from packer.runtime.engines import CpuEngine, CudaEngine

    def slowed(dev: Any) -> Any:
        return CudaEngine(dev, stall_cycles=400_000) if DEV == "cuda" else CpuEngine(copy_delay=0.0002)

    d = rep.data
    ref = load_file(str(WORK / m["weights"]["files"][0]), device=DEV)
    runs: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
        ("2 slots x 1 MiB", {"slots": 2, "chunk": MIB}, {}),
        ("stream slowed 0.2 ms before each copy, 4 x 4 MiB",
         {"slots": 4, "chunk": 4 * MIB, "make_engine": slowed}, {}),
        ("verify=True (hash thread), default ring", {}, {"verify": True}),
    ]
    for name, opts, kw in runs:
        ld = L.Loader(m, WORK, timeline=L.Timeline())
        for k, v in opts.items():
            setattr(ld, k, v)
        try:
            secs, sd = timed(lambda ld=ld, kw=kw: ld.load_weights(DEV, pipeline=True, **kw))
        except Exception as e:  # recorded, and the next hunt still runs
            d["race"][name] = {"seconds": 0.0, "chunks": 0, "early_refills": -1, "ok": f"raised {e}"}
            d["problems"].append(f"{name}: raised {e}")
            rep.save()
            continue
        bad = differs(sd, ref)
        s = ld.last_stats
        d["race"][name] = {"seconds": secs, "chunks": s.chunks, "early_refills": s.early_refills,
                           "ok": "ok" if not bad else f"{len(bad)} differ", "hash_s": s.hash_seconds}
        d["problems"] += [f"{name}: {b}" for b in bad] + ([f"{name}: early refills"] if s.early_refills else [])
        del sd
        rep.save()
    L.release_ring()


def extra_checks(rep: Report, ld: Any, L: Any) -> None:
    """dtype override, load_into straight into parameters, the graph pool on a small model."""
    from load_cpu import module_like
    from safetensors.torch import load_file

    d = rep.data
    ref = load_file(str(WORK / ld.manifest["weights"]["files"][0]), device=DEV)
    sd = ld.load_weights(DEV, dtype=torch.float16, pipeline=True)
    ok = all(torch.equal(sd[k], v.to(torch.float16)) for k, v in ref.items()) and sd["tied"] is sd["odd"]
    d["checks"]["dtype override (float16)"] = "ok" if ok else "differs"
    del sd
    mod = module_like(ld.manifest).to(DEV)
    secs, (missing, unexpected) = timed(lambda mod=mod: ld.load_into(mod, strict=False))
    got = mod.state_dict()
    ok = not missing and unexpected == ["tied"] and all(torch.equal(got[k], v) for k, v in ref.items())
    d["checks"]["load_into (warm)"] = f"{'ok' if ok else 'differs'}, {secs:.3f} s"
    del mod, got
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(DEV)
    fn = L.warmup(model, [torch.randn(16, 64, device=DEV), torch.randn(4, 64, device=DEV)], cuda_graphs=True)
    x = torch.randn(16, 64, device=DEV)
    with torch.inference_mode():
        want = model(x)
    graphs = 2 if DEV == "cuda" else 0  # the smoke run has no graphs: every call is a fallback
    ok = torch.allclose(fn(x), want, atol=1e-5) and fn.replays == min(graphs, 1) and len(fn.graphs) == graphs
    fn(torch.randn(5, 64, device=DEV))
    ok = ok and fn.fallbacks == 1 + (graphs == 0)
    d["checks"]["CUDA graph pool"] = f"{'ok' if ok else 'differs'} (graphs {len(fn.graphs)})"
    d["problems"] += [f"check {k}: {v}" for k, v in d["checks"].items() if "differs" in v]
    rep.save()


if __name__ == "__main__":
    sys.exit(main())
