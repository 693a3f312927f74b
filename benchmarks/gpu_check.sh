#!/usr/bin/env bash
# The one command a GPU session runs, from the repository root of a bare GPU machine
# (python3 with torch, safetensors, transformers, pytest, hypothesis; no packer installed, no
# zstandard, no .venv: nothing on this path needs them). Under 6 minutes, so a rerun fits.
#
#   bash benchmarks/gpu_check.sh          # results under $OUT (else benchmarks/_work/gpu_check)
#
# 1. prints the environment (env.txt), checks that every import resolves from this checkout;
# 2. stops there, exit 0, with a "no CUDA" line when torch sees no GPU (how CI runs it);
# 3. runs the CUDA-marked tests (pytest.txt; among them the CUDA half of the vLLM load format:
#    vLLM cannot be installed here, so an engine stand-in takes the ring's device tensors through
#    its load_weights as vLLM's model does; the vLLM side itself runs on CPU under `pytest -m vllm`), benchmarks/gpu_load.py (gpu_load.md,
#    gpu_load.json, gpu_load_trace.json, each rewritten as a measurement finishes) and, when it
#    exists, benchmarks/cold_start.py --device cuda (into cold_start/); among the tests, vllm_start's
#    fork server on the GPU (tests/test_fork_server.py): its child initialises and uses CUDA, CUDA
#    initialised before its fork is refused in one line, and a plain fork after CUDA initialisation
#    fails in the child (why the guard exists);
# 4. where vLLM is importable, benchmarks/vllm_warm.py: packer's warm state on this GPU, and the
#    same start through `python -m packer.adapters.vllm_start` (warm-once: torch imported once,
#    token ids equal) (warm.txt);
# 5. appends a summary line to env.txt; exit 1 when a step failed.
# The device tool brings back at most 8 files: this script writes 6, cold_start/ gets the rest.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/benchmarks/_work/gpu_check}"
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET_S:-330}"  # seconds for the whole script
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
START=$(date +%s)
# Packages the bare machine lacks travel as wheels in .whl/ (ignored by git, named in the run's
# carry): zstandard, which cold_start.py's `packer build` needs (docs/how-to/gpu-check.md gives the download).
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/packer-site "$ROOT"/.whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/packer-site"
fi
mkdir -p "$OUT"

left() { local n=$(( BUDGET - ($(date +%s) - START) - ${1:-0} )); echo $(( n > 10 ? n : 10 )); }
say() { echo "gpu_check: $*"; }

{
    say "environment, $(date -u +%FT%TZ)"
    echo "repo: $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
    uname -srm
    echo "cpus: $(nproc)"
    free -g 2>/dev/null | head -2
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem \
        --format=csv 2>&1
    "$PY" - <<'EOF'
import importlib, os, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "safetensors", "transformers", "pytest", "hypothesis", "numpy", "zstandard"):
    try:
        print(f"{name} {importlib.import_module(name).__version__}")
    except Exception as e:  # missing is fine where this path does not need it
        print(f"{name} missing ({type(e).__name__})")
import torch
print("cuda available", torch.cuda.is_available(), "torch cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
print({k: v for k, v in os.environ.items() if k.startswith(("PACKER_", "PYTORCH_", "CUDA_"))})
EOF
} 2>&1 | tee "$OUT/env.txt"

if ! "$PY" benchmarks/gpu_load.py --preflight 2>&1 | tee -a "$OUT/env.txt"; then
    say "imports fail from this checkout (see above)" | tee -a "$OUT/env.txt"
    exit 1
fi

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"; then
    say "no CUDA device here (torch.cuda.is_available() is False): stopping at the CUDA boundary, nothing failed" \
        | tee -a "$OUT/env.txt"
    exit 0
fi

say "CUDA-marked tests (and the ring/graph CPU tests on this torch)"
timeout "$(( $(left) < 120 ? $(left) : 120 ))" "$PY" -m pytest -q -p no:cacheprovider -rs \
    tests/test_cuda.py tests/test_ring.py tests/test_graphs.py \
    "tests/test_loader.py::test_cuda_graph_capture_on_gpu" \
    "tests/test_vllm_format.py::test_load_into_vllm_hands_every_tensor_in_file_order" \
    "tests/test_fork_server.py::test_on_a_gpu_children_of_the_server_use_cuda_and_cuda_first_is_refused" \
    2>&1 | tee "$OUT/pytest.txt"
TESTS=$?

say "gpu_load.py ($(left) s left)"
timeout "$(left 40)" "$PY" benchmarks/gpu_load.py --out "$OUT" --budget-s "$(left 150)"
LOAD=$?

COLD="absent"
if [ -f benchmarks/cold_start.py ] && ! "$PY" -c "import zstandard" 2>/dev/null; then
    COLD="skipped: zstandard missing (carry it in .whl/, see the README)"
    say "cold_start.py skipped: zstandard is not installed here and no wheel came in .whl/"
elif [ -f benchmarks/cold_start.py ]; then
    say "cold_start.py --device cuda ($(left) s left)"
    mkdir -p "$OUT/cold_start"
    OUT="$OUT/cold_start" timeout "$(left)" "$PY" benchmarks/cold_start.py --device cuda --rounds 2 \
        --work /tmp/packer-cold-start --chart "$OUT/cold_start/cold_start.png" \
        2>&1 | tee "$OUT/cold_start/cold_start.txt"
    COLD=$?
fi

# The warm state on the first GPU: `packer warm` of a small Llama (its request mix: logprobs, sampling,
# penalties, a short and a long prompt), then what each cache root of the state holds ("root: ..."
# lines: vLLM, Inductor, Triton, FlashInfer, DeepGEMM, TileLang, CuTe DSL, the CUDA driver's JIT cache;
# files, bytes, the library and version keyed; the roots nothing wrote), then fresh vLLM starts with
# empty engine caches, cold (state off) against warm (the state checked and used), each asking for
# logprobs, compiler runs counted; the hit line and vLLM's AOT load must show in the warm start. Needs
# vLLM in $VLLM_PREFIX (default: $PY's prefix), which a bare GPU machine lacks: then it says so and
# counts as skipped.
WARM="skipped: no vLLM importable"
VLLM_PREFIX="${VLLM_PREFIX:-$("$PY" -c 'import sys; print(sys.prefix)')}"
if [ -x "$VLLM_PREFIX/bin/python" ] && "$VLLM_PREFIX/bin/python" -c "import vllm" 2>/dev/null \
        && "$PY" -c "import zstandard, click" 2>/dev/null; then
    say "vllm_warm.py on cuda ($(left) s left)"
    PACKER_VLLM_VENV="$VLLM_PREFIX" timeout "$(left)" "$PY" benchmarks/vllm_warm.py --rounds 1 --layers 2 --rewarm \
        --contenders cold,warm,warm-once 2>&1 | tee "$OUT/warm.txt"
    WARM=$?
else
    say "warm step skipped: no vLLM (and zstandard, click) importable here"
fi

say "summary: tests rc=$TESTS, gpu_load rc=$LOAD, cold_start rc=$COLD, warm rc=$WARM, $(( $(date +%s) - START )) s" \
    | tee -a "$OUT/env.txt"
[ "$TESTS" = 0 ] && [ "$LOAD" = 0 ] && case "$COLD" in 0 | absent | skipped*) true ;; *) false ;; esac \
    && case "$WARM" in 0 | skipped*) true ;; *) false ;; esac
