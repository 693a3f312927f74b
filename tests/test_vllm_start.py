"""``python -m packer.adapters.vllm_start``: vLLM's default process layout, every process forked from one
parent that imported torch and vLLM once; the same token ids as vLLM's own start (marker ``vllm``).

torch's imports are counted by a ``sitecustomize`` the test writes: each interpreter that imports
torch appends its pid to a file (a forked process finds torch imported already and appends nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.test_vllm_format import PROMPTS, REPO, build, env, vllm_python
from tests.torch_imports import count_in, imports


def counted_env(tmp: Path, name: str) -> tuple[dict[str, str], Path]:
    """vLLM's default process layout (no ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with torch's imports counted."""
    site, log = tmp / f"site-{name}", tmp / f"torch-imports-{name}"
    count_in(site, log)
    e = {k: v for k, v in env(tmp).items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    e["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    return e, log


def start(tmp: Path, model_dir: Path, name: str, launcher: list[str]) -> tuple[list[list[int]], int, str]:
    """Token ids, the number of interpreters that imported torch, and the log of one start."""
    e, log = counted_env(tmp, name)
    args = [str(vllm_python()), *launcher, str(REPO / "tests" / "vllm_generate.py"), str(model_dir), "packer", "1",
            json.dumps(PROMPTS)]
    r = subprocess.run(args, capture_output=True, text=True, env=e, timeout=900, check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    lines = [x for x in r.stdout.splitlines() if x.startswith('{"ids": ')]
    assert len(lines) == 1, out[-4000:]
    return json.loads(lines[0])["ids"], imports(log), out


@pytest.mark.vllm
def test_one_import_of_torch_and_the_same_token_ids(tmp_path: Path) -> None:
    _, d = build(tmp_path, tied=False)
    want, imports, _ = start(tmp_path, d, "default", [])
    got, once, log = start(tmp_path, d, "once", ["-m", "packer.adapters.vllm_start"])
    assert got == want and all(len(ids) == 8 for ids in got)
    assert imports >= 3 and once == 1, (imports, once)  # the caller, the engine core, the worker: then one
    assert "changed after the fork server's imports" not in log
    assert "CUDA was initialised" not in log
