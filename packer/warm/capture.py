"""``packer warm``: run the engine once against a build and keep what it wrote for its start-up.

The engine runs in its own interpreter (``--python``; vLLM's environment, where packer's
plugin is installed) as a server would: the ``packer`` load format, compile mode unless the
engine arguments say otherwise, one request. Its cache directories (``VLLM_CACHE_ROOT``,
``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``) are new and empty, so everything in them
after the run is this model's start-up state; the plugin records the key of exactly that run
(:mod:`packer.adapters.vllm_warm`). The files are pinned into ``OUT/warm/<name>/``
(:mod:`packer.warm.pins`), beside the build and outside its manifest: the build stays byte for
byte what it was, and ``packer verify OUT`` checks the state's pins too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from packer.errors import WarmStateError
from packer.formats import LOADER_NAME
from packer.reading import REPORT, parse_json, read_bytes
from packer.show import show
from packer.warm.key import STATE_ENV, state_name
from packer.warm.pins import ROOTS, WARM_DIR, collect, write_state

ENGINES = ("vllm",)
RUNNER = "packer.adapters.vllm_warm_run"
_ENV_OF_ROOT = {"vllm": "VLLM_CACHE_ROOT", "inductor": "TORCHINDUCTOR_CACHE_DIR", "triton": "TRITON_CACHE_DIR"}


def warm(out: Path, *, engine: str, engine_args: list[str], python: str | None = None,
         model_dir: Path | None = None, timeout: float = 1800.0,
         signer: Callable[[dict[str, Any]], bytes] | None = None) -> dict[str, Any]:
    """Capture the engine's start-up state for the build ``out`` into ``out/warm/<name>/``.

    Args:
        out: a build output (``packer_loader.py`` at its top).
        engine: ``"vllm"``.
        engine_args: the engine's own flags (``--dtype float32 --max-model-len 4096``), as the
            server will be given them: the state is keyed on them.
        python: the engine's interpreter (default: this one).
        model_dir: the model directory the server will be given (vLLM hashes the path): laid
            out there (links into ``out``) when it does not exist; default: the one
            ``packer_loader.py --model-dir`` prints on this machine.
        timeout: seconds for the engine's run.
        signer: signs the state (``state.sig``, :mod:`packer.warm.trust`); None: unsigned.

    Returns:
        a summary: the state's directory, name, file count, bytes, seconds, the run's token ids.

    Raises:
        WarmStateError: not a build, an unknown engine, or the engine's run failed (its log's end
            in the message).
    """
    if engine not in ENGINES:
        raise WarmStateError(f"--engine {engine!r}: packer warms {', '.join(ENGINES)}")
    if not (out / LOADER_NAME).is_file():
        raise WarmStateError(f"{out}: no {LOADER_NAME}; `packer warm` takes a build output (packer build -o OUT)")
    python = python or sys.executable
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="packer-warm-run-"))
    try:
        model = _model_dir(out, python, model_dir, work, timeout)
        roots = {root: work / root for root in ROOTS}
        for d in roots.values():
            d.mkdir()
        env = {**os.environ, **{_ENV_OF_ROOT[r]: str(d) for r, d in roots.items()},
               **STATE_ENV, "PACKER_WARM_CAPTURE": str(work / "key.json"), "PACKER_WARM": "off"}
        env.pop("PACKER_WARM_STATE", None)
        ids = _run(python, [str(model), *engine_args], env, timeout)
        key = _read_key(work / "key.json")
        name = state_name(key)
        doc = write_state(out / WARM_DIR / name, name=name, key=key, files=collect(roots), signer=signer)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"state": str(out / WARM_DIR / name), "name": name, "files": len(doc["files"]),
            "bytes": sum(p["size"] for p in doc["files"].values()), "model_path": key["model_path"],
            "seconds": round(time.monotonic() - start, 2), "token_ids": ids}


def _model_dir(out: Path, python: str, model_dir: Path | None, work: Path, timeout: float) -> Path:
    loader = out.resolve() / LOADER_NAME
    if model_dir is not None and model_dir.exists():
        return model_dir.absolute()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import packer_loader as p; "
            "print(p.model_dir(out=sys.argv[2]) if len(sys.argv) > 2 else p.model_dir())")
    args = [python, "-c", code, str(loader.parent), *([str(model_dir.absolute())] if model_dir else [])]
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False, cwd=work)
    if r.returncode != 0:
        raise WarmStateError(f"{loader}: laying out the model directory failed: {show(r.stderr.strip()[-600:])}")
    return Path(r.stdout.strip().splitlines()[-1])


def _run(python: str, argv: list[str], env: dict[str, str], timeout: float) -> list[int]:
    try:
        r = subprocess.run([python, "-m", RUNNER, *argv], capture_output=True, text=True, env=env,
                           timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise WarmStateError(f"{python} -m {RUNNER}: the engine's warm run took over {timeout:.0f} s") from None
    lines = [x for x in r.stdout.splitlines() if x.startswith('{"ids": ')]
    if r.returncode != 0 or not lines:
        raise WarmStateError(_failure(python, r))
    report = parse_json(lines[-1], REPORT, where=f"{python} -m {RUNNER}", error=WarmStateError)
    return list(report["ids"])


def _read_key(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise WarmStateError(f"{path}: the engine's run recorded no key (is packer's vLLM plugin installed "
                             "in that interpreter?)")
    key = parse_json(read_bytes(path, REPORT, error=WarmStateError), REPORT, where=str(path), error=WarmStateError)
    if not isinstance(key, dict) or "config" not in key:
        raise WarmStateError(f"{path}: the recorded key has no engine configuration hash")
    return key


def _failure(python: str, r: subprocess.CompletedProcess[str]) -> str:
    """One line for a failed warm run: the engine's last error line (a missing vLLM said as such)."""
    said = [x.strip() for x in (r.stdout + r.stderr).splitlines() if x.strip()]
    last = said[-1] if said else "no output"
    if "No module named 'vllm'" in last:
        return (f"{python} cannot import vllm: run packer warm with --python pointing at the engine's "
                "interpreter (the one vLLM is installed in), or pip install vllm there")
    return f"{python} -m {RUNNER}: the engine's warm run failed (exit {r.returncode}): {show(last[-600:])}"
