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
