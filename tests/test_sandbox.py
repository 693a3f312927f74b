"""`packer convert` reads untrusted input in an isolated child: limits, no network."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from packer.demo import write_demo


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("demo-src")
    write_demo(d)
    return d


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "packer", *args], capture_output=True, text=True, check=False,
                          env={**os.environ, **(env or {})})


def test_audit_hook_refuses_sockets() -> None:
    code = ("import socket\nfrom packer.weights.sandbox import _isolate\n"
            "_isolate({'as': 2**34, 'cpu': 60, 'fsize': 2**30})\n"
            "try:\n    socket.socket()\nexcept PermissionError as e:\n    print('refused', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and proc.stdout.startswith("refused"), proc.stderr


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_convert_opens_no_socket(demo_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "trace"
    proc = subprocess.run(["strace", "-f", "-qq", "-e", "trace=socket,connect", "-o", str(log),
                           sys.executable, "-m", "packer", "convert", str(demo_dir / "pytorch_model.bin"),
                           "-o", str(tmp_path / "out")], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    calls = [line for line in log.read_text().splitlines() if "socket(" in line or "connect(" in line]
    assert calls == []
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_sandboxed_and_in_process_conversions_agree(demo_dir: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    assert run("convert", str(demo_dir / "pytorch_model.bin"), "-o", str(a)).returncode == 0
    assert run("convert", "--no-sandbox", str(demo_dir / "pytorch_model.bin"), "-o", str(b)).returncode == 0
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_limit_hit_in_child_is_one_line_and_leaves_nothing(demo_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run("convert", str(demo_dir / "pytorch_model.bin"), "-o", str(out), env={"PACKER_SANDBOX_FSIZE": "100000"})
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert not out.exists() or not any(p.suffix == ".safetensors" for p in out.iterdir())
