"""The variables the loader sets before CUDA starts: expandable segments only on request."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOC = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
CODE = ("import os, warnings; warnings.simplefilter('always'); import packer.runtime.loader; "
        "print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '-'), os.environ.get('PYTORCH_ALLOC_CONF', '-'))")


def run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if k not in (*ALLOC, "PACKER_EXPANDABLE_SEGMENTS", "CUDA_MODULE_LOADING")}
    return subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, cwd=ROOT,
                          env={**base, **env})


@pytest.mark.parametrize(("env", "want", "warned"), [
    ({}, ["-", "-"], False),  # never by default: it breaks CUDA IPC in unprivileged containers
    ({"PACKER_EXPANDABLE_SEGMENTS": "1"}, ["expandable_segments:True", "-"], False),
    ({"PACKER_EXPANDABLE_SEGMENTS": "1", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"},
     ["max_split_size_mb:128", "-"], True),
    ({"PACKER_EXPANDABLE_SEGMENTS": "1", "PYTORCH_ALLOC_CONF": "backend:native"}, ["-", "backend:native"], True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, ["expandable_segments:False", "-"], False),
])
def test_expandable_segments_only_on_request_never_over_the_user(env: dict[str, str], want: list[str],
                                                                 warned: bool) -> None:
    r = run(env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == want
    assert ("PACKER_EXPANDABLE_SEGMENTS=1 ignored" in r.stderr) is warned


def test_torch_is_reached_through_one_accessor_that_imports_it() -> None:
    """Runtime helpers called before anything imported torch import it (they used to look it
    up in sys.modules and raise KeyError)."""
    code = ("import sys\n"
            "from packer.runtime.env import torch_dtype\n"
            "from packer.runtime import graphs\n"
            "assert 'torch' not in sys.modules\n"
            "print(torch_dtype('BF16', 't')[0])\n"
            "print(graphs._clone_out(3))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["torch.bfloat16", "3"]
    # no module of the runtime looks torch up in sys.modules without importing it
    src = Path(__file__).resolve().parents[1] / "packer" / "runtime"
    assert not [p.name for p in src.glob("*.py") if 'sys.modules["torch"]' in p.read_text()]
