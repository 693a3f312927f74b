"""Every cache root an engine and its GPU kernel libraries use, through a warm state's life:
captured by ``packer warm`` (packer/warm/capture.py), keyed with its library and version
(packer/warm/roots.py, packer/warm/key.py), relocated on a hit by the trust gate
(packer/adapters/gate.py, through the plugin's decision in packer/adapters/vllm_warm.py) and
refused when one byte of it changed; the request mix reaches the engine's run and is recorded.

No vLLM and no GPU here: a stand-in engine (a small Python script run as the engine's
interpreter) writes a file into each cache directory it is given, as vLLM, Inductor, Triton,
FlashInfer, DeepGEMM, TileLang, CuTe DSL and the CUDA driver write theirs on a GPU boot.
``benchmarks/gpu_check.sh`` runs the real thing on the first GPU lent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from packer.adapters import gate, vllm_warm
from packer.warm.key import STATE_ENV
from packer.warm.pins import ROOTS, load_state
from packer.warm.requests import DEFAULT_REQUESTS
from tests.built import build_dir
from tests.hf_fixtures import VLLM_LLAMA, llama
from tests.test_warm_state import KEY

REPO = Path(__file__).resolve().parents[1]
LIBRARIES = {"vllm": "vllm 0.32.0", "inductor": "torch 2.13.0+cpu", "triton": "triton 3.5.0",
             "flashinfer": "flashinfer 0.2.8", "deepgemm": "deep_gemm 2.1.0", "tilelang": "tilelang 0.1.6",
             "cutedsl": "cutlass-dsl 4.2.0", "cuda": "nvidia-driver 570.86.15"}
ABSENT = "tilelang"  # the stand-in writes nothing there: the state has no such root
# what each library writes, as the stand-in plays it (relative to the directory its variable names)
WRITES = {"vllm": "modelinfos/llama.json", "inductor": "fxgraph/ab/fabc", "triton": "KEY1/kernel.cubin",
          "flashinfer": ".cache/flashinfer/90/cached_ops/batch_prefill/batch_prefill.so",
          "deepgemm": "cache/kernel.gemm.f8/kernel.cubin", "tilelang": "kernels/k.so",
          "cutedsl": "dsl/kernel.o", "cuda": "ComputeCache/4/2/c41a3b"}

ENGINE = """
import json, os, sys
from pathlib import Path

wrote = {}
for root, var in CACHE_ENV.items():
    if root == ABSENT:
        continue
    f = Path(os.environ[var]) / WRITES[root]
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(f"{root} compiled\\n".encode() * 64)
Path(os.environ["STAND_IN_SAW"]).write_text(json.dumps({
    "requests": os.environ.get("PACKER_WARM_REQUESTS"),
    "env": {v: os.environ.get(v) for v in [*CACHE_ENV.values(), *STATE_ENV]}}))
key = {**KEY, "model_path": sys.argv[1], "state_env": STATE_ENV, "roots": LIBRARIES}
Path(os.environ["PACKER_WARM_CAPTURE"]).write_text(json.dumps(key))
print(json.dumps({"ids": [1, 2, 3, 4], "requests": 7}))
"""


def stand_in(tmp: Path, then: str = "") -> Path:
    """An engine interpreter whose warm run writes each cache root (but :data:`ABSENT`), then runs
    the Python code ``then`` (a hostile engine's extra moves) before it reports."""
    engine = tmp / "stand_in_gpu_engine.py"
    engine.write_text(f"KEY = {KEY!r}\nCACHE_ENV = {gate.CACHE_ENV!r}\nSTATE_ENV = {STATE_ENV!r}\n"
                      f"LIBRARIES = {LIBRARIES!r}\nWRITES = {WRITES!r}\nABSENT = {ABSENT!r}\n"
                      + ENGINE.replace("print(json.dumps(", then + "\nprint(json.dumps("))
    python = tmp / "python-stand-in"
    python.write_text(f'#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "packer.adapters.vllm_warm_run" ]; '
                      f'then shift 2; exec {sys.executable} {engine} "$@"; fi\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python


@pytest.fixture(scope="module")
def warmed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A build warmed by the stand-in engine through ``packer warm`` (the CLI, as an operator runs it)."""
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("warm-roots")
    llama(tmp / "hf", **VLLM_LLAMA)
    out = tmp / "out"
    build_dir(tmp / "hf", out)
    saw = tmp / "saw.json"
    r = subprocess.run([sys.executable, "-m", "packer", "warm", str(out), "--python", str(stand_in(tmp)), "--json",
                        "--", "--dtype", "float32"], capture_output=True, text=True, timeout=300, check=False,
                       cwd=tmp, env={**os.environ, "PYTHONPATH": str(REPO), "PACKER_BUNDLE_CACHE": str(tmp / "bundle"),
                                     "STAND_IN_SAW": str(saw)})
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    return {"tmp": tmp, "out": out, "summary": summary, "state": Path(summary["state"]),
            "saw": json.loads(saw.read_text())}


def test_every_root_the_engine_wrote_is_captured_and_pinned(warmed: dict[str, Any]) -> None:
    doc = load_state(warmed["state"])
    held = [r for r in ROOTS if r != ABSENT]
    assert doc["roots"] == sorted(held)  # the absent root is simply absent
    assert sorted(doc["files"]) == sorted(f"{r}/{WRITES[r]}" for r in held)
    # each root was a new, empty directory of its own, and the run had packer's settings
    env = warmed["saw"]["env"]
    dirs = [env[gate.CACHE_ENV[r]] for r in ROOTS]
    assert all(dirs) and len(set(dirs)) == len(ROOTS)
    assert {k: env[k] for k in STATE_ENV} == STATE_ENV == {"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0",
                                                          "TRITON_CACHE_AUTOTUNING": "1"}


def test_the_key_names_each_roots_library_and_the_request_mix(warmed: dict[str, Any]) -> None:
    key = load_state(warmed["state"])["key"]
    assert key["roots"] == LIBRARIES
    assert key["requests"] == [dict(r) for r in DEFAULT_REQUESTS]
    assert json.loads(warmed["saw"]["requests"]) == key["requests"]  # what the engine's run was sent


@pytest.fixture()
def decide(warmed: dict[str, Any], tmp_path: Path,
           capsys: pytest.CaptureFixture[str]) -> Iterator[Any]:
    """The plugin's decision for the warmed build, as vLLM's process makes it: ``decide(libraries)``
    returns ``(plan, the line printed)``; the process's environment is put back afterwards."""
    saved = dict(os.environ)
    key = load_state(warmed["state"])["key"]
    plans = []

    def run(libraries: dict[str, str] | None = None) -> tuple[Any, str]:
        for name in (*gate.CACHE_ENV.values(), *STATE_ENV, vllm_warm.DECIDED, vllm_warm.SWITCH,
                     vllm_warm.CAPTURE, "PACKER_REQUIRE_SIGNATURE"):
            os.environ.pop(name, None)
        os.environ["PACKER_WARM_DIR"] = str(tmp_path)
        now = {k: key[k] for k in vllm_warm.BEFORE_CONFIG}
        now["roots"] = dict(libraries or key["roots"])
        args = types.SimpleNamespace(model=key["model_path"], load_format="packer", model_loader_extra_config=None)
        orig = vllm_warm.current_key
        vllm_warm.current_key = lambda _args: now  # type: ignore[assignment]
        try:
            plan = vllm_warm.before_config(args, lambda _m, _a=None: warmed["out"] / "packer_loader.py")
        finally:
            vllm_warm.current_key = orig  # type: ignore[assignment]
        plans.append(plan)
        return plan, capsys.readouterr().err

    try:
        yield run
    finally:
        for plan in plans:
            if plan is not None and plan.redirect is not None:
                plan.redirect.restore()
        os.environ.clear()
        os.environ.update(saved)


def test_a_hit_points_every_root_at_its_checked_copy(decide: Any) -> None:
    plan, said = decide()
    assert said == "" and plan is not None and plan.redirect is not None  # the line comes after the config
    copy = plan.redirect.dir / "state"
    for root in ROOTS:
        var = gate.CACHE_ENV[root]
        if root == ABSENT:
            assert var not in os.environ  # the library finds its own cache, as without packer
            continue
        assert os.environ[var] == str(copy / root)
        assert (Path(os.environ[var]) / WRITES[root]).read_bytes() == f"{root} compiled\n".encode() * 64
    assert {k: os.environ[k] for k in STATE_ENV} == STATE_ENV
    plan.redirect.restore()
    assert not any(gate.CACHE_ENV[r] in os.environ for r in ROOTS) and not copy.exists()


@pytest.mark.parametrize("root", [r for r in ROOTS if r != ABSENT])
def test_another_library_version_is_a_miss_naming_the_root(decide: Any, root: str) -> None:
    name = LIBRARIES[root].split()[0]
    plan, said = decide({**LIBRARIES, root: f"{name} 99.0"})
    assert plan is None and not any(gate.CACHE_ENV[r] in os.environ for r in ROOTS)
    assert said == f"packer: warm state: miss (cache root {root}: '{name} 99.0', warmed with '{LIBRARIES[root]}')\n"


def test_a_library_whose_cache_the_state_does_not_hold_may_change(decide: Any) -> None:
    plan, said = decide({**LIBRARIES, ABSENT: "tilelang 0.2.0"})
    assert said == "" and plan is not None and plan.redirect is not None


@pytest.mark.parametrize("root", [r for r in ROOTS if r != ABSENT])
def test_a_changed_byte_in_any_root_refuses_the_state(warmed: dict[str, Any], decide: Any, root: str) -> None:
    f = warmed["state"] / "files" / root / WRITES[root]
    data = f.read_bytes()
    f.write_bytes(data[:7] + bytes([data[7] ^ 1]) + data[8:])
    try:
        plan, said = decide()
    finally:
        f.write_bytes(data)
    assert plan is None and not any(gate.CACHE_ENV[r] in os.environ for r in ROOTS)
    assert said.startswith(f"packer: warm state: miss (refused: {f}: sha256 "), said


def test_packer_warm_sends_the_mix_it_is_given(warmed: dict[str, Any], tmp_path: Path) -> None:
    subprocess.run(["cp", "-a", str(warmed["out"]), str(tmp_path / "out")], check=True)
    mix = [{"prompt_tokens": 3, "logprobs": 2}, {"n": 3, "temperature": 0.5}]
    (tmp_path / "mix.json").write_text(json.dumps(mix))
    (tmp_path / "bad.json").write_text(json.dumps([{"logprobs": -1}]))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PACKER_BUNDLE_CACHE": str(tmp_path / "bundle"),
           "STAND_IN_SAW": str(tmp_path / "saw.json")}
    warm = [sys.executable, "-m", "packer", "warm", str(tmp_path / "out"), "--python", str(stand_in(tmp_path))]
    r = subprocess.run([*warm, "--requests", str(tmp_path / "bad.json")], capture_output=True, text=True,
                       timeout=300, check=False, env=env)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: --requests {tmp_path / 'bad.json'}[0].logprobs: expected an integer from 0 to 2147483648, "
        "got int -1"], r.stderr
    r = subprocess.run([*warm, "--requests", str(tmp_path / "mix.json")], capture_output=True, text=True,
                       timeout=300, check=False, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(json.loads((tmp_path / "saw.json").read_text())["requests"]) == mix
    assert load_state(tmp_path / "out" / "warm" / warmed["state"].name)["key"]["requests"] == mix
