"""vLLM's start in compile mode: its default cold start against packer's warm state, and start options.

Uses the generated bf16 Llama and packer build of benchmarks/vllm_startup.py (``--layers``),
warms it once with ``packer warm`` (its default request mix; kept under benchmarks/_work/;
``--rewarm`` makes it again) and prints what each cache root of the state holds, then starts,
interleaved and each contender in turn first, one fresh process per contender and round:
``LLM(MODEL_DIR, load_format="packer", dtype="float32", max_model_len=128, max_num_seqs=2)`` in
compile mode (no ``enforce_eager``) and one greedy request **that asks for logprobs** (5), in
the vLLM virtual environment ($PACKER_VLLM_VENV). Every process gets new, empty engine caches
(``VLLM_CACHE_ROOT``, ``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``, and a new ``TMPDIR``,
where Inductor keeps its precompiled headers), so only what packer ships can help, and a
folder first on ``PATH`` whose C/C++ compilers log each run (the compiles are counted):

* ``cold``: vLLM's default cold start, the warm state switched off (``PACKER_WARM=off``);
* ``warm``: packer's warm state, which the plugin checks and points vLLM at;
* ``warm-fork``: the same with ``VLLM_WORKER_MULTIPROC_METHOD=fork`` (the installed vLLM's
  other worker start method);
* ``warm-inproc``: the same with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (for ``LLM``, the engine
  core and the model in the caller's process: one process importing torch and vLLM instead of
  three; for the API server, the model inside the engine core's process: two);
* ``warm-once``: the warm state and vLLM's default process layout, started through
  ``python -m packer.adapters.vllm_start``: the caller imports torch and vLLM once and the engine
  core and its worker are forked from a server forked from it.

Every start's interpreters that import torch are counted (a ``sitecustomize`` on ``PYTHONPATH``
appends the pid of each process whose ``import torch`` runs; a forked process appends nothing).

``--entry serve`` starts vLLM's OpenAI API server instead (``python -m
vllm.entrypoints.openai.api_server`` with the same arguments) and asks it, over HTTP, for the
same completion as soon as it answers.

Neither variable enters vLLM's compile hash, so all warm contenders hit the same state.

Reported (min / median / max over rounds): seconds from process start to the engine ready and
to the first request answered, the CPU seconds of every process of the start's session
(sampled from /proc every 0.2 s; the machine may be shared: trust the ratios), and the
compiler runs that compiled or linked. Every warm run must print the hit line and load vLLM's
AOT artifact; token ids are compared across all runs.

Usage: .venv/bin/python benchmarks/vllm_warm.py [--rounds 3] [--layers 4] [--width 1024] [--rewarm]
       [--contenders cold,warm,warm-fork,warm-inproc,warm-once] [--entry llm|serve]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_startup import REPO, VENV, build_out, env, make_model  # noqa: E402

sys.path.insert(0, str(REPO))
from tests.torch_imports import count_in  # noqa: E402
from tests.torch_imports import imports as torch_imports  # noqa: E402

ARGS = ["--load-format", "packer", "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "2"]
CHILD = """
import json, sys, time
def main():
    from vllm import LLM, SamplingParams
    llm = LLM(sys.argv[1], load_format="packer", dtype="float32", max_model_len=128, max_num_seqs=2)
    ready = time.time()
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5)
    out = llm.generate([{"prompt_token_ids": list(range(2, 34))}], params, use_tqdm=False)
    o = out[0].outputs[0]
    print(json.dumps({"ready": ready, "first": time.time(), "ids": list(o.token_ids),
                      "logprobs": len((o.logprobs or [{}])[0])}), flush=True)
if __name__ == "__main__":
    main()
"""
CONTENDERS = {"cold": {"PACKER_WARM": "off"}, "warm": {}, "warm-fork": {"VLLM_WORKER_MULTIPROC_METHOD": "fork"},
              "warm-inproc": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, "warm-once": {}}
LAUNCHERS = {"warm-once": ["-m", "packer.adapters.vllm_start"]}  # put before the entry's own arguments
COMPILERS = ("g++", "gcc", "c++", "cc", "clang", "clang++")
HIT = "packer: warm state: hit ("
AOT = "Directly load AOT compilation from path"


def warm_state(model_dir: Path, out: Path, rewarm: bool) -> Path:
    """The build ``out`` behind ``model_dir``, warmed once with ``packer warm`` (the engine arguments above)."""
    if rewarm or not list((out / "warm").glob("vllm-*")):
        r = subprocess.run([sys.executable, "-m", "packer", "warm", str(out), "--python", str(VENV / "bin" / "python"),
                            "--model-dir", str(model_dir), "--json", "--", *ARGS],
                           env={**env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=1800,
                           check=False)
        if r.returncode != 0:
            raise SystemExit(f"packer warm failed:\n{r.stderr[-3000:]}")
        print(f"warmed: {json.loads(r.stdout)}", file=sys.stderr)
    return out


def roots_held(out: Path) -> list[str]:
    """One line per cache root of each warm state of ``out``: files, bytes, the library and version keyed."""
    from packer.warm.pins import load_state, state_dirs

    lines = []
    for state in state_dirs(out):
        doc = load_state(state)
        libraries = doc["key"].get("roots") or {}
        for root in doc["roots"]:
            pins = [p for rel, p in doc["files"].items() if rel.startswith(f"{root}/")]
            lines.append(f"{state.name} {root}: {len(pins)} files, {sum(p['size'] for p in pins)} bytes "
                         f"({libraries.get(root, 'no library keyed')})")
        absent = sorted(set(libraries) - set(doc["roots"]))
        lines.append(f"{state.name}: absent roots (nothing written): {', '.join(absent) or 'none'}")
    return lines


def compiler_wrappers(folder: Path, log: Path) -> None:
    """C/C++ compilers in ``folder`` (first on PATH) that log each command line, then run the real one
    under the name it was called by (``g++ -v`` prints it, and Inductor keys its ISA probes on that)."""
    folder.mkdir()
    for name in COMPILERS:
        real = shutil.which(name)
        if real:
            (folder / name).write_text(f'#!/bin/bash\necho "{name} $*" >> {log}\n'
                                       f'PATH="${{PATH//{folder}:/}}" exec -a {name} {real} "$@"\n')
            (folder / name).chmod(0o755)


def compile_runs(log: Path) -> int:
    """Compiler runs that compiled or linked (``-c``/``-o``), not version probes."""
    lines = log.read_text().splitlines() if log.exists() else []
    return sum(1 for x in lines if {"-c", "-o"} & set(x.split()))


def serve_first_answer(proc: subprocess.Popen[str], port: int, model_dir: Path, box: dict[str, Any]) -> None:
    """Poll the API server until it answers one completion (greedy, 8 tokens, logprobs 5); record
    the times of ``/health`` and of that answer in ``box``, then stop the server's session."""
    import urllib.error
    import urllib.request

    body = json.dumps({"model": str(model_dir), "prompt": list(range(2, 34)), "max_tokens": 8, "temperature": 0,
                       "logprobs": 5, "return_token_ids": True}).encode()
    while proc.poll() is None:
        try:
            if "ready" not in box:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    box["ready"] = time.time()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                choice = json.loads(r.read())["choices"][0]
            box.update(first=time.time(), ids=choice.get("token_ids") or choice["text"],
                       logprobs=len((choice.get("logprobs") or {}).get("top_logprobs", [{}])[0]))
            box.setdefault("ready", box["first"])
            break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(model_dir: Path, contender: str, entry: str = "llm") -> dict[str, object]:
    caches = Path(tempfile.mkdtemp(prefix="vllm-warm-bench-"))
    (caches / "tmp").mkdir()  # Inductor keeps its precompiled headers under $TMPDIR: fresh, as in a new pod
    compiler_wrappers(caches / "bin", caches / "compilers.log")
    count_in(caches / "site", caches / "torch-imports")
    (caches / "child.py").write_text(CHILD)
    extra = {"VLLM_CACHE_ROOT": str(caches / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
             "TRITON_CACHE_DIR": str(caches / "triton"), "TMPDIR": str(caches / "tmp"),
             "PYTHONPATH": f"{caches / 'site'}:{REPO}",
             "PATH": f"{caches / 'bin'}:{os.environ.get('PATH', '')}", **CONTENDERS[contender]}
    start = time.time()
    logs = caches / "log"
    box: dict[str, Any] = {}
    try:
        with logs.open("w+") as f:
            if entry == "serve":
                port = free_port()
                cmd = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), *ARGS,
                       "--port", str(port)]
            else:
                cmd = [str(caches / "child.py"), str(model_dir)]
            proc = subprocess.Popen([str(VENV / "bin" / "python"), *LAUNCHERS.get(contender, []), *cmd], stdout=f,
                                    stderr=subprocess.STDOUT, text=True, env={**env(), **extra}, cwd=caches,
                                    start_new_session=True)
            if entry == "serve":
                threading.Thread(target=serve_first_answer, args=(proc, port, model_dir, box),
                                 daemon=True).start()
            cpu = session_cpu(proc)
            f.seek(0)
            log = f.read()
        compiles = compile_runs(caches / "compilers.log")
        imports = torch_imports(caches / "torch-imports")
    finally:
        shutil.rmtree(caches, ignore_errors=True)
    if (proc.returncode != 0 and entry != "serve") or (entry == "serve" and "first" not in box):
        raise SystemExit(f"{contender}: vLLM failed:\n{log[-3000:]}")
    answers = [x for x in log.splitlines() if x.startswith('{"ready"')]
    res: dict[str, Any] = box if entry == "serve" else json.loads(answers[0])
    line = next((x for x in log.splitlines() if x.startswith("packer: warm state:")), "")
    return {"ready": res["ready"] - start, "first": res["first"] - start, "cpu": cpu, "ids": res["ids"],
            "compiles": compiles, "imports": imports, "logprobs": res["logprobs"],
            "hit": log.count(HIT) == 1 and AOT in log, "line": line}


def session_cpu(proc: subprocess.Popen[str], every: float = 0.2, timeout: float = 1200) -> float:
    """CPU seconds of every process in ``proc``'s session until it exits (sampled from /proc).

    vLLM's engine-core and worker processes are not all waited for, so the child's own rusage
    misses them; each process's user+system time is kept as last seen.
    """
    tick = os.sysconf("SC_CLK_TCK")
    seen: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("a vLLM start took over 20 minutes")
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[3]) == proc.pid:  # the session id (the child leads its own session)
                    seen[int(d)] = max(seen.get(int(d), 0), int(fields[11]) + int(fields[12]))
        time.sleep(every)
    return sum(seen.values()) / tick


def stats(values: list[float]) -> str:
    return f"{min(values):6.1f} / {statistics.median(values):6.1f} / {max(values):6.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024, help="hidden size of the generated Llama (1024, or 256 ...)")
    ap.add_argument("--rewarm", action="store_true")
    ap.add_argument("--contenders", default="cold,warm", help=f"comma-separated, of {', '.join(CONTENDERS)}")
    ap.add_argument("--entry", choices=("llm", "serve"), default="llm",
                    help="llm: vLLM's LLM class in a script; serve: vLLM's OpenAI API server, asked over HTTP")
    args = ap.parse_args()
    who_all = args.contenders.split(",")
    if not who_all or any(w not in CONTENDERS for w in who_all) or "cold" not in who_all:
        raise SystemExit(f"--contenders: a list of {', '.join(CONTENDERS)} with cold among them")
    model_dir = make_model(args.layers, args.width)
    out = warm_state(model_dir, build_out(args.layers, args.width), args.rewarm)
    for line in roots_held(out):
        print(f"root: {line}")
    print(f"load average (1, 5, 15 min) at the start: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results: dict[str, list[dict[str, object]]] = {w: [] for w in who_all}
    for i in range(args.rounds):
        order = who_all[i % len(who_all):] + who_all[:i % len(who_all)]  # each contender in turn first
        for who in order:
            results[who].append(run(model_dir, who, args.entry))
            last = results[who][-1]
            print(f"round {i + 1} {who}: first answer {last['first']:.1f} s, {last['cpu']:.1f} CPU-s, "
                  f"{last['compiles']} compiles, torch imported {last['imports']}x, load {os.getloadavg()[0]:.2f}  "
                  f"{last['line']}", file=sys.stderr)
    ids = [r["ids"] for rs in results.values() for r in rs]
    same = all(x == ids[0] for x in ids)
    warm = [r for w, rs in results.items() if w != "cold" for r in rs]
    hits = all(r["hit"] for r in warm) and not any(r["hit"] for r in results["cold"])
    logprobs = all(int(r["logprobs"]) >= 5 for rs in results.values() for r in rs)  # type: ignore[call-overload]
    size = sum(p.stat().st_size for p in (out / "warm").rglob("*") if p.is_file())
    print(f"entry {args.entry}; model dir {model_dir} ({args.layers} layers, width {args.width}), "
          f"warm state {size / 1e6:.1f} MB, "
          f"{args.rounds} rounds, {os.cpu_count()} cores; token ids equal: {same}; hit line and AOT load in every "
          f"warm run: {hits}; logprobs in every answer: {logprobs}; load average (1, 5, 15 min) at the end: "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| (min / median / max) | " + " | ".join(who_all) + " |")
    print("|---|" + "---|" * len(who_all))
    for key, label in (("ready", "process start → engine ready, s"), ("first", "process start → first answer, s"),
                       ("cpu", "CPU seconds, all its processes"), ("compiles", "compiler runs (compile or link)"),
                       ("imports", "interpreters that imported torch")):
        cold = statistics.median(float(r[key]) for r in results["cold"])  # type: ignore[arg-type]
        cells = []
        for w in who_all:
            values = [float(r[key]) for r in results[w]]  # type: ignore[arg-type]
            ratio = (f" ({statistics.median(values) / cold:.2f}×)"
                     if w != "cold" and cold and key not in ("compiles", "imports") else "")
            cells.append(stats(values).replace("  ", " ").strip() + ratio)
        print(f"| {label} | " + " | ".join(cells) + " |")
    return 0 if same and hits and logprobs else 1


if __name__ == "__main__":
    sys.exit(main())
