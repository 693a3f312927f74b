"""Streaming a build's weights from a registry against pulling the image first (issue 40).

``python benchmarks/stream_load.py [--sizes 1GB,4GB] [--rounds 3] [--work DIR]`` makes a Llama
layout of each size (bf16, random weights, one safetensors file as ``packer build`` writes it
below 5 GB), builds it (1 MiB chunk digests, the default), pushes it with ``packer push`` to
Debian's ``docker-registry`` on loopback, then runs, interleaved, each in a fresh process:

* (a) **streamed**: ``load_weights("cpu", root="oci://...@sha256:...")``: the small layers
  fetched and proven, every weight chunk fetched with ``Range`` and proven as it arrives, into
  private memory; and, in another process, the time to the *first* tensor: the lazy load
  (``proven=True``: chunks fetched when first used) and the first tensor used;
* (b) **pull, then load**: ``skopeo copy --preserve-digests`` of the image to an OCI layout on
  disk (skopeo proves each blob's digest), then packer's load from it (a mapping, as a pulled
  image is loaded);
* (c) **local, verified**: ``load_weights("cpu", verify=True)`` of the build on disk (mapped,
  every file hashed whole).

Each prints the time to the first tensor and to all tensors (from the call), the bytes fetched,
the CPU seconds (the process and its children: skopeo) and the peak memory above the process's
size before the call. Then, each round, tensor parallel 2 on gloo
(``from_pretrained(tp_plan="auto")``, a process per rank), streamed and local with
``verify=True``: each rank's time from the call to its model, and the bytes each streamed rank
fetched (each one hashed) against its share. The page cache is warm for every contender (the
registry serves from it as the local load reads from it). Ratios are medians of the same run.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HIDDEN, INTER, VOCAB, HEADS = 2048, 5632, 32000, 16
SIZES = {"1GB": 8, "4GB": 36}  # decoder layers: 1.09 GB and 3.98 GB of bf16


def make_model(src: Path, layers: int) -> None:
    import torch
    from safetensors.torch import save_file

    src.mkdir(parents=True, exist_ok=True)
    (src / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": layers, "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS, "vocab_size": VOCAB, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN),
              "model.norm.weight": (HIDDEN,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                   p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": (HIDDEN, HIDDEN),
                   p + "self_attn.v_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                   p + "mlp.gate_proj.weight": (INTER, HIDDEN), p + "mlp.up_proj.weight": (INTER, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, INTER)}
    tensors = {k: (torch.rand(s, generator=g) * 0.04 - 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_registry(work: Path, upstream: str | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Debian's ``docker-registry`` on loopback, its storage under ``work``; with ``upstream``
    (``host:port``), a pull-through cache of that registry."""
    port = free_port()
    proxy = f"proxy:\n  remoteurl: http://{upstream}\n" if upstream else ""
    (work / "registry.yml").write_text(
        "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {work / 'registry-data'}\nhttp:\n  addr: 127.0.0.1:{port}\n{proxy}")
    proc = subprocess.Popen(["docker-registry", "serve", str(work / "registry.yml")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"127.0.0.1:{port}"


# --- one measurement, in a fresh process ---


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def child(mode: str, out: Path, ref: str, work: Path) -> dict[str, Any]:
    sys.path.insert(0, str(out))
    os.environ["PACKER_STARTUP_LOG"] = "off"
    import packer_loader as pl
    import torch  # noqa: F401 - imported before the clock starts, as in a server

    base, cpu0, t0 = _status("VmRSS"), _cpu(), time.perf_counter()
    result: dict[str, Any] = {}
    if mode == "stream":
        tensors = pl.load_weights("cpu", root=ref)
    elif mode == "stream-first":
        tensors = pl.load_weights("cpu", root=ref, proven=True)
        first = next(iter(tensors.values()))
        first.clone()  # its chunks fetched and proven now
    elif mode == "pull":
        pulled = work / "pulled"
        shutil.rmtree(pulled, ignore_errors=True)
        pulled.mkdir()
        for p in out.iterdir():  # the small files as a pulled image's model directory has them
            if p.name != "image":
                os.symlink(p, pulled / p.name)
        subprocess.run(["skopeo", "copy", "--quiet", "--preserve-digests", "--src-tls-verify=false",
                        f"docker://{ref.removeprefix('oci://')}", f"oci:{pulled / 'image'}:bench"], check=True)
        result["pull_s"] = time.perf_counter() - t0
        tensors = pl.load_weights("cpu", root=pulled)
    else:  # "local"
        tensors = pl.load_weights("cpu", root=out, verify=True)
    end = time.perf_counter()
    fetched = [s for s in pl.report() if s["stage"] == "fetch (registry, proven)"]
    result |= {"first_s": end - t0 if mode != "stream" else None, "all_s": end - t0 if mode != "stream-first" else None,
               "cpu_s": _cpu() - cpu0, "peak_extra": max(_status("VmHWM") - base, 0),
               "fetched": fetched[-1]["bytes"] if fetched else 0, "tensors": len(tensors),
               "nbytes": sum(t.numel() * t.element_size() for t in tensors.values())}
    if mode == "pull":
        shutil.rmtree(work / "pulled", ignore_errors=True)
    return result


def tp_rank(out: Path, ref: str, streamed: bool) -> dict[str, Any]:
    sys.path.insert(0, str(out))
    os.environ["PACKER_STARTUP_LOG"] = "off"
    import datetime

    import packer_loader as pl
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    dist.barrier()  # both ranks start the clock together
    t0, cpu0 = time.perf_counter(), _cpu()
    if streamed:
        model = pl.from_pretrained(AutoModelForCausalLM, device="cpu", tp_plan="auto", root=ref)
    else:
        model = pl.from_pretrained(AutoModelForCausalLM, device="cpu", tp_plan="auto", root=out, verify=True)
    load_s, cpu_s = time.perf_counter() - t0, _cpu() - cpu0
    stages = [s for s in pl.report() if s["stage"] == "fetch (registry, proven)"]
    sys.path.insert(0, str(REPO))
    from tests.tp_worker import plan_bytes  # what the plan shards and replicates, as the TP tests count it

    sharded, replicated = plan_bytes(model)
    return {"rank": dist.get_rank(), "load_s": load_s, "cpu_s": cpu_s, "fetched": stages[-1]["bytes"] if stages else 0,
            "chunks": stages[-1].get("chunks", 0) if stages else 0, "sharded": sharded, "replicated": replicated}


def run_child(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise SystemExit(f"{args[:2]} failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tp(out: Path, ref: str, address: str, mode: str) -> list[dict[str, Any]]:
    port = free_port()
    procs = []
    for r in range(2):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PACKER_REGISTRY_INSECURE": address}
        procs.append(subprocess.Popen([sys.executable, __file__, "--child", mode, str(out), ref], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (_, se) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"tp rank failed: {se[-3000:]}")
    return [json.loads(so.strip().splitlines()[-1]) for so, _ in outs]


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"


def bench(size: str, rounds: int, work: Path, tp_only: bool = False) -> dict[str, Any]:
    from packer.building import build
    from packer.oci.push import push
    from packer.recipe import recipe_from_dict

    src, out = work / size / "src", work / size / "out"
    if not (out / "manifest.json").is_file():
        shutil.rmtree(work / size, ignore_errors=True)
        make_model(src, SIZES[size])
        build(recipe_from_dict({"name": "bench", "version": "1", "source": str(src)}), out, sandbox=False)
        shutil.rmtree(src)
    proc, address = start_registry(work / size)
    try:
        digest = push(out, f"{address}/bench/{size.lower()}:1", tls_verify=False)[f"{address}/bench/{size.lower()}:1"]
        ref = f"oci://{address}/bench/{size.lower()}@{digest}"
        env = {"PACKER_REGISTRY_INSECURE": address}
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in ("stream", "stream-first", "pull", "local")}
        tp_ranks: dict[str, list[list[dict[str, Any]]]] = {"tp-stream": [], "tp-local": []}
        for _ in range(rounds):
            for mode in runs if not tp_only else ():
                before = proc_cpu(proc.pid)
                runs[mode].append(run_child(["--child", mode, str(out), ref, str(work / size)], env))
                runs[mode][-1]["registry_cpu_s"] = proc_cpu(proc.pid) - before
            for mode in tp_ranks if size == "1GB" else ():
                tp_ranks[mode].append(tp(out, ref, address, mode))
        costs = request_costs(ref, address, proc.pid) if size == "1GB" and not tp_only else []
    finally:
        proc.terminate()
        proc.wait()
    nbytes = runs["stream"][0]["nbytes"] if runs["stream"] else tp_ranks["tp-stream"][0][0]["sharded"] + \
        tp_ranks["tp-stream"][0][0]["replicated"]
    return {"size": size, "nbytes": nbytes, "runs": runs, "tp": tp_ranks, "costs": costs}


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def request_costs(ref: str, address: str, pid: int) -> list[dict[str, float]]:
    """What one ``Range`` request costs the registry, by size: sequential requests for spans of
    the weight blob through packer's client, the registry's CPU and the wall time per request."""
    from packer.runtime.registry import Registry, parse_ref

    os.environ["PACKER_REGISTRY_INSECURE"] = address
    reg = Registry(parse_ref(ref))
    layers = json.loads(reg.manifest()[0])["layers"]
    blob = max(layers, key=lambda d: d["size"])
    out = []
    for size in (4 << 10, 1 << 20, 8 << 20, 64 << 20):
        n, view = min(128, blob["size"] // size), memoryview(bytearray(size))
        cpu, t = proc_cpu(pid), time.perf_counter()
        for i in range(n):
            reg.read_range(blob["digest"], i * size, view)
        out.append({"size": size, "requests": n, "registry_ms": (proc_cpu(pid) - cpu) / n * 1e3,
                    "wall_ms": (time.perf_counter() - t) / n * 1e3})
    return out


def report(res: dict[str, Any]) -> None:
    r, gb = res["runs"], res["nbytes"] / 1e9
    if r["stream"]:
        report_loads(res, r, gb)
    report_tp(res)


def report_loads(res: dict[str, Any], r: dict[str, list[dict[str, Any]]], gb: float) -> None:
    med = {m: statistics.median(x["all_s"] if x["all_s"] is not None else x["first_s"] for x in r[m]) for m in r}
    print(f"\n{res['size']} model: {res['nbytes']} bytes of weights ({r['stream'][0]['tensors']} tensors), "
          f"{len(r['stream'])} interleaved rounds, min / median / max")
    print("| contender | first tensor (s) | all tensors (s) | fetched (MB) | CPU (s) | registry CPU (s) "
          "| peak above start (MB) |")
    print("|---|---|---|---|---|---|---|")
    names = {"stream": "(a) streamed", "pull": "(b) skopeo copy + load", "local": "(c) local, verified whole"}
    for m, label in names.items():
        first = r["stream-first"] if m == "stream" else r[m]
        print(f"| {label} | {spread([x['first_s'] for x in first])} | {spread([x['all_s'] for x in r[m]])} | "
              f"{statistics.median(x['fetched'] for x in r[m]) / 1e6:.0f} | {spread([x['cpu_s'] for x in r[m]])} | "
              f"{spread([x['registry_cpu_s'] for x in r[m]])} | "
              f"{spread([x['peak_extra'] / 1e6 for x in r[m]])} |")
    pulls = spread([x["pull_s"] for x in r["pull"]])
    print(f"streamed / (b): {med['stream'] / med['pull']:.2f}; streamed / (c): {med['stream'] / med['local']:.2f}; "
          f"streamed rate {gb / med['stream']:.2f} GB/s; skopeo copy alone {pulls} s")
    for c in res["costs"]:
        print(f"one Range request of {c['size'] >> 10} KiB ({c['requests']} in a row): registry CPU "
              f"{c['registry_ms']:.2f} ms, wall {c['wall_ms']:.2f} ms")


def report_tp(res: dict[str, Any]) -> None:
    for mode, label in (("tp-stream", "streamed"), ("tp-local", "local, verify=True")):
        for rank in (0, 1) if res["tp"].get(mode) else ():
            runs = res["tp"][mode]
            print(f"TP 2 {label}, rank {rank}: call to model {spread([r[rank]['load_s'] for r in runs])} s, "
                  f"CPU {spread([r[rank]['cpu_s'] for r in runs])} s")
    for t in res["tp"]["tp-stream"][-1] if res["tp"].get("tp-stream") else ():
        share = t["sharded"] / 2 + t["replicated"]
        print(f"TP 2 rank {t['rank']}: fetched and hashed {t['fetched'] / 1e6:.1f} MB in {t['chunks']} chunks; "
              f"its share {share / 1e6:.1f} MB ({t['fetched'] / share:.3f}x), the file {res['nbytes'] / 1e6:.1f} MB")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        mode, out, ref = sys.argv[2], Path(sys.argv[3]), sys.argv[4]
        if mode.startswith("tp-"):
            got = tp_rank(out, ref, streamed=mode == "tp-stream")
        else:
            got = child(mode, out, ref, Path(sys.argv[5]))
        print(json.dumps(got))
        sys.stdout.flush()
        atexit._run_exitfuncs()  # the streamed loads' private directories; then no slow teardown
        os._exit(0)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1GB,4GB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/packer-stream-bench"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--tp-only", action="store_true", help="only the tensor parallel rounds (1GB)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    sizes = ["1GB"] if args.tp_only else args.sizes.split(",")  # the TP rounds run at 1 GB only
    results = [bench(s, args.rounds, args.work, args.tp_only) for s in sizes]
    for res in results:
        report(res)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
