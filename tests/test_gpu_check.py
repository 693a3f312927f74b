"""benchmarks/gpu_check.sh on a machine without CUDA: it runs up to the CUDA boundary and stops cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="hardware: the CPU half of the check runs where CUDA is not")
def test_gpu_check_stops_at_the_cuda_boundary_without_zstandard(tmp_path: Path) -> None:
    block = tmp_path / "block"
    block.mkdir()
    (block / "zstandard.py").write_text("raise ImportError('not on the bare GPU machine')\n")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "PYTHONPATH": str(block)}
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1].startswith("gpu_check: no CUDA device here") and "nothing failed" in lines[-1]
    assert f"gpu_load: imports ok (packer from {ROOT}," in r.stdout and "zstandard False" in r.stdout
    text = (out / "env.txt").read_text()
    assert f"torch {torch.__version__}" in text and "zstandard missing" in text and "no CUDA device" in text
    assert sorted(p.name for p in out.iterdir()) == ["env.txt"]  # nothing GPU-side was started


@pytest.mark.slow
def test_gpu_load_runs_its_whole_flow_on_the_cpu_stand_in(tmp_path: Path) -> None:
    """The GPU run is one shot: every step of gpu_load.py runs here first (numbers meaningless)."""
    out = tmp_path / "out"
    env = {**os.environ, "PACKER_BENCH_WORK": str(tmp_path / "work")}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_load.py"), "--smoke-cpu", "--size-gb", "0.01",
           "--reps", "2", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((out / "gpu_load.json").read_text())
    assert data["finished"] and data["problems"] == []
    assert {r["cache"] for r in data["rounds"].values()} == {"warm", "warm, pins the ring", "cold (fadvise DONTNEED)"}
    assert set(data["probes"]) == {"pinning", "read-only", "transfer"} and len(data["race"]) == 3
    assert all(v["ok"] == "ok" and v["early_refills"] == 0 for v in data["race"].values())
    md = (out / "gpu_load.md").read_text()
    assert "of the slower probe" in md and "| packer load_weights(cpu) | warm | 2 |" in md
    trace = json.loads((out / "gpu_load_trace.json").read_text())
    assert any(e["name"] == "read" for e in trace["traceEvents"])
    assert not (tmp_path / "work").exists()  # the model is removed unless --keep
