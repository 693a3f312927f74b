"""Cold start end to end: fresh processes from interpreter start to the first forward pass.

Generates once under benchmarks/_work/cold_start/ a >= 1 GB bf16 Llama-style model from a
transformers ``LlamaConfig`` (tied embeddings) with a WordPiece tokenizer made locally by
the tokenizers library (no network), saved as ``model.safetensors`` (what transformers reads)
and ``pytorch_model.bin`` (what the naive path and ``packer build`` read), then builds it with
``packer build``. Each round runs, interleaved, one fresh process per contender:

* naive: construction with random init, ``torch.load`` + ``load_state_dict``;
* transformers: ``AutoModelForCausalLM.from_pretrained`` on the same safetensors;
* packer: ``packer_loader.from_pretrained`` (init_empty + load_into by assignment);
* load_into: the same by hand, ``init_empty`` + ``LlamaForCausalLM(config)`` + ``load_into``;
* warm: a worker forked from ``packer_loader.warm_context`` (torch, transformers and the
  Llama modelling code preloaded, ``prepare()`` done): its clock starts when the pool owner
  asks for it (``Process.start``), so "interpreter" is the fork.

Each reports a stage table (interpreter, import torch, import transformers, config,
construction, weights, tokenizer, first forward), peak RSS (``ru_maxrss``), and its logits,
compared bitwise with transformers'. "ready" is the measure the targets use: from torch and
transformers imported to model and tokenizer ready (loader import, config, construction,
weights, tokenizer), in wall seconds and in CPU seconds of the process (``process_time``, all
threads: the figure a shared machine's load disturbs least); each contender's ratio to
transformers is given of the medians and round by round. The median round goes to a PNG chart.

The packer build is redone when packer's runtime or stub template changed since it was made
(a fingerprint beside it, ``out.fingerprint``), so the loader measured is this checkout's.

Usage: python benchmarks/cold_start.py [--device cpu|cuda] [--rounds 3] [--prompt-words 18]
[--contenders transformers,packer,...] [--chart FILE]
(matplotlib is needed for the chart only: ``pip install matplotlib``; it is not a packer
dependency.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORK = Path(__file__).resolve().parent / "_work" / "cold_start"
REPO = Path(__file__).resolve().parents[1]
STAGES = ["interpreter", "import torch", "import transformers", "import loader", "config", "construction",
          "weights", "tokenizer", "first forward"]
LOADER = ("headers", "map", "assign", "read into module", "ring")  # the loader's own weight stages
CONTENDERS = ["transformers", "naive", "packer", "load_into", "warm"]  # transformers: the reference
READY = ("import loader", "config", "construction", "weights", "tokenizer")  # after torch + transformers
TEXT = "the quick brown fox jumps over the lazy dog " * 2  # 18 tokens: a short first request
PROMPT = {"words": 18}  # --prompt-words: the first request, in words of TEXT (one token each)


def fingerprint() -> str:
    """sha256 over this checkout's runtime modules and stub template: what the build emits."""
    h = hashlib.sha256()
    for f in sorted([*(REPO / "packer" / "runtime").rglob("*.py"), REPO / "packer" / "stub" / "template.py"]):
        if "__pycache__" not in f.parts:
            h.update(f.relative_to(REPO).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def make_model(work: Path, layers: int) -> None:
    """The HF directory (config, tokenizer, safetensors, pickle) and the packer build (cached,
    rebuilt when the loader's code changed)."""
    hf, out, stamp = work / "hf", work / "out", work / "out.fingerprint"
    if (out / "packer_loader.py").is_file() and stamp.is_file() and stamp.read_text() == fingerprint():
        return
    if (hf / "pytorch_model.bin").is_file():
        build(work, out, stamp)
        return
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=True,
                      dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cpu"):
        torch.set_default_dtype(torch.bfloat16)
        model = LlamaForCausalLM(cfg)
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(hf)
    torch.save(model.state_dict(), hf / "pytorch_model.bin")
    words = ["[UNK]", "[PAD]", "[CLS]", "[SEP]"] + TEXT.split()[:9]
    words += [f"{a}{b}{c}" for a in "abcdefghijklmnopqrstuvwxyz" for b in "aeiou" for c in "bcdfglmnprst"]
    words += [f"##{w}" for w in words[4:]]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(hf)
    build(work, out, stamp)


def build(work: Path, out: Path, stamp: Path) -> None:
    """``packer build`` of the generated checkpoint into ``out`` (replaced), then its fingerprint."""
    import shutil

    recipe = work / "recipe.toml"
    recipe.write_text(f'name = "cold-start"\nversion = "1"\nsource = "{work / "hf"}"\n\n[weights]\n'
                      'files = ["pytorch_model.bin"]\ntie_prefer = ["model.embed_tokens.weight"]\n\n'
                      '[image]\ncompression = "none"\n\n[runtime]\ndevice = "cpu"\n')
    stamp.unlink(missing_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    print(f"building {out} with this checkout's packer", flush=True)
    subprocess.run([sys.executable, "-m", "packer", "build", str(recipe), "-o", str(out), "-q"],
                   check=True, cwd=REPO)
    stamp.write_text(fingerprint())


# --- the contenders, each run in a fresh process ----------------------------------------


def child(name: str, work: Path, device: str, spawned: float) -> dict[str, Any]:
    t: dict[str, float] = {"interpreter": time.time() - spawned}
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        t[stage] = t.get(stage, 0.0) + now - clock
        clock = now

    import torch

    lap("import torch")
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    _ = transformers.models.llama.modeling_llama.LlamaModel  # the lazy modelling import
    lap("import transformers")
    cpu = time.process_time()
    hf = work / "hf"
    if name == "naive":
        config = AutoConfig.from_pretrained(hf)
        lap("config")
        torch.set_default_dtype(torch.bfloat16)
        model = LlamaForCausalLM(config)
        torch.set_default_dtype(torch.float32)
        lap("construction")
        model.load_state_dict(torch.load(hf / "pytorch_model.bin", weights_only=True), strict=False)
        model.tie_weights()
        model = model.to(device).eval()
        lap("weights")
        tok = AutoTokenizer.from_pretrained(hf)
    elif name == "transformers":
        config = AutoConfig.from_pretrained(hf)
        lap("config")
        on = {} if device == "cpu" else {"device_map": device}  # device_map needs accelerate
        model = AutoModelForCausalLM.from_pretrained(hf, config=config, **on)
        lap("weights")  # construction and weights are one call
        tok = AutoTokenizer.from_pretrained(hf)
    elif name == "load_into":  # the generic way in, by hand: what from_pretrained strings together
        sys.path.insert(0, str(work / "out"))
        import packer_loader as P

        lap("import loader")
        config = AutoConfig.from_pretrained(P.bundle_dir())
        lap("config")
        with P.init_empty(dtype=torch.bfloat16):
            model = LlamaForCausalLM(config)
        lap("construction")
        P.load_into(model, device=device)  # strict: every key has its place; tied names are one tensor
        model = model.eval()
        lap("weights")
        tok = AutoTokenizer.from_pretrained(P.bundle_dir())
    else:
        sys.path.insert(0, str(work / "out"))
        import packer_loader as P

        lap("import loader")
        model = P.from_pretrained(AutoModelForCausalLM, device=device)
        stages = P.report()
        lap("weights")
        split(t, stages)
        tok = AutoTokenizer.from_pretrained(P.bundle_dir())
    lap("tokenizer")
    ready_cpu = time.process_time() - cpu
    out = forward(t, clock, model, tok, torch, device, work / f"logits-{name}.pt")
    out["ready_cpu_s"] = ready_cpu
    return out


def split(t: dict[str, float], stages: list[dict[str, Any]]) -> None:
    """From the whole from_pretrained call in ``t["weights"]``, move config and construction out."""
    by = {}
    for s in stages:
        by[s["stage"]] = by.get(s["stage"], 0.0) + s["seconds"]
    t["config"] = by.get("config", 0.0) + by.get("bundle", 0.0)
    t["construction"] = by.get("construct", 0.0)
    t["weights"] -= t["config"] + t["construction"]
    t["loader weight stages"] = sum(by.get(k, 0.0) for k in LOADER)


def forward(t: dict[str, float], clock: float, model: Any, tok: Any, torch: Any, device: str,
            logits_file: Path) -> dict[str, Any]:
    import resource

    ids = tok(" ".join(TEXT.split()[: PROMPT["words"]]), return_tensors="pt")["input_ids"].to(device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t["first forward"] = time.perf_counter() - clock
    torch.save(logits.cpu(), logits_file)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    extra = t.pop("loader weight stages", None)
    return {"stages": t, "peak_rss_mib": rss, "tokens": ids.shape[1], "loader_weight_stages_s": extra}


def warm_worker(work: str, device: str, asked: float, conn: Any, words: int) -> None:
    """Runs in a worker forked from the warm server: load, tokenizer, first forward."""
    PROMPT["words"] = words
    t: dict[str, float] = {"interpreter": time.time() - asked, "import torch": 0.0,
                           "import transformers": 0.0}
    clock, cpu = time.perf_counter(), time.process_time()
    import packer_loader as P
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    before = len(P.report())  # the server's stages come with the fork
    model = P.from_pretrained(AutoModelForCausalLM, device=device)
    t["weights"] = time.perf_counter() - clock
    split(t, P.report()[before:])
    clock = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(P.bundle_dir())
    t["tokenizer"] = time.perf_counter() - clock
    ready_cpu = time.process_time() - cpu
    out = forward(t, time.perf_counter(), model, tok, torch, device, Path(work) / "logits-warm.pt")
    conn.send({**out, "ready_cpu_s": ready_cpu})


def warm_owner(work: Path, device: str) -> dict[str, Any]:
    """The pool owner: start the prepared fork server once, then time one worker."""
    sys.path.insert(0, str(work / "out"))
    start = time.perf_counter()
    import packer_loader as P

    ctx = P.warm_context(["torch", "transformers", "transformers.models.llama.modeling_llama",
                          "tokenizers"])
    server = time.perf_counter() - start
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=warm_worker, args=(str(work), device, time.time(), send, PROMPT["words"]))
    p.start()
    got: dict[str, Any] = recv.recv()
    p.join()
    got["server_start_s"] = server
    return got


# --- the parent: rounds, tables, chart --------------------------------------------------


def run_one(name: str, work: Path, device: str) -> dict[str, Any]:
    role = "warm-owner" if name == "warm" else name
    cmd = [sys.executable, __file__, "--child", role, "--work", str(work), "--device", device,
           "--prompt-words", str(PROMPT["words"]), "--spawned", repr(time.time())]
    env = {**os.environ, "PACKER_STARTUP_LOG": "off", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work)
    if r.returncode != 0:
        raise SystemExit(f"{name} failed:\n{r.stderr[-3000:]}")
    res: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return res


def ready(run: dict[str, Any]) -> float:
    """Wall seconds from torch and transformers imported to model and tokenizer ready."""
    return sum(run["stages"].get(k, 0.0) for k in READY)


def spread(xs: list[float]) -> str:
    return f"{min(xs):.3f} / {statistics.median(xs):.3f} / {max(xs):.3f}"


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    head = "| stage (s, min / median / max) | " + " | ".join(results) + " |"
    lines = [head, "|" + "---|" * (len(results) + 1)]
    for stage in [*STAGES, "total", "ready", "ready, CPU s"]:
        cells = []
        for runs in results.values():
            xs = [sum(r["stages"].values()) if stage == "total" else ready(r) if stage == "ready"
                  else r["ready_cpu_s"] if stage == "ready, CPU s" else r["stages"].get(stage, 0.0) for r in runs]
            cells.append(spread(xs))
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    rss = [f"{statistics.median([r['peak_rss_mib'] for r in runs]):.0f}" for runs in results.values()]
    lines.append("| peak RSS (MiB, median) | " + " | ".join(rss) + " |")
    return "\n".join(lines)


def ratios(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each contender's "ready" against transformers': of the medians, and round by round."""
    ref = results.get("transformers")
    if not ref:
        return []
    lines = []
    for name, runs in results.items():
        if name == "transformers":
            continue
        for what, key in (("wall", ready), ("CPU", lambda r: r["ready_cpu_s"])):
            per = [key(a) / key(b) for a, b in zip(runs, ref, strict=True)]
            med = statistics.median(map(key, runs)) / statistics.median(map(key, ref))
            lines.append(f"{name}: ready / transformers' ({what}): {med:.2f} of the medians; "
                         f"round by round {spread(per)} (min / median / max)")
    return lines


def chart(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"chart: not drawn (matplotlib is not installed); {path} left as it was")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    names = list(results)
    left = [0.0] * len(names)
    for stage in STAGES:
        widths = [statistics.median([r["stages"].get(stage, 0.0) for r in results[n]]) for n in names]
        ax.barh(names, widths, left=left, label=stage)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds from process start (warm: from Process.start) to first forward, median")
    ax.legend(fontsize=7, ncol=4, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=9, help="9 layers: 1.06 GB in bf16")
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--prompt-words", type=int, default=18, help="length of the first request (1..18)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"comma-separated, from {','.join(CONTENDERS)} (transformers: the reference)")
    ap.add_argument("--chart", type=Path, default=Path(__file__).resolve().parent / "cold_start.png")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spawned", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    PROMPT["words"] = args.prompt_words
    if args.child == "warm-owner":
        print(json.dumps(warm_owner(args.work, args.device)))
        return
    if args.child:
        print(json.dumps(child(args.child, args.work, args.device, args.spawned)))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    make_model(args.work, args.layers)
    files = json.loads((args.work / "out" / "manifest.json").read_text())["files"]  # weights may lie in blobs
    size = sum(e["size"] for rel, e in files.items() if rel.endswith(".safetensors"))
    print(f"model: {size / 1e9:.2f} GB bf16, {args.layers} layers; device {args.device}; "
          f"first request {args.prompt_words} tokens; "
          f"load average before: {os.getloadavg()}", flush=True)
    names = [n for n in args.contenders.split(",") if n]
    if "transformers" not in names or not set(names) <= set(CONTENDERS):
        raise SystemExit(f"--contenders: transformers (the reference) and any of {CONTENDERS}; got {names}")
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    import torch

    for r in range(args.rounds):
        k = r % len(names)  # rotate the order: no contender always follows the 2.4 GB naive run
        for name in names[k:] + names[:k]:
            results[name].append(run_one(name, args.work, args.device))
        want = torch.load(args.work / "logits-transformers.pt", weights_only=True)  # this round's
        for name in names:
            got = torch.load(args.work / f"logits-{name}.pt", weights_only=True)
            results[name][-1]["bitwise"] = bool(torch.equal(got, want))
        print(f"round {r + 1}/{args.rounds} done; load average {os.getloadavg()}", flush=True)
    print(table(results))
    for name, runs in results.items():
        print(f"{name}: logits bitwise equal to transformers': {[x['bitwise'] for x in runs]}")
    print("\n".join(ratios(results)))
    for name in ("packer", "warm"):
        if name in results:
            xs = [x["loader_weight_stages_s"] * 1e3 for x in results[name]]
            print(f"{name}: the loader's weight stages (headers, map, assign): {min(xs):.1f} / "
                  f"{statistics.median(xs):.1f} / {max(xs):.1f} ms")
    if "warm" in results:
        print(f"warm server start (once per pool, not in the worker's time): "
              f"{[round(x['server_start_s'], 2) for x in results['warm']]} s")
    print(json.dumps({n: [{**x["stages"], "ready_cpu_s": x["ready_cpu_s"]} for x in runs]
                      for n, runs in results.items()}))
    chart(results, args.chart)
    print(f"load average after: {os.getloadavg()}")

if __name__ == "__main__":
    main()
