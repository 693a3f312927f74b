"""PACKER_TOOLS_REQUIRED=1 (.ci/run sets it) turns a tool- or package-guarded skip into a failure.

Each case runs pytest in a fresh process on tests written here, with this suite's conftest as
theirs, once with the switch and once without, and asserts the exit code and the counts; the
last case removes one real tool (strace) from PATH under a real test of the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CASES = {
    "test_module_guard.py": 'import pytest\npytest.importorskip("no_such_package_for_packer")\n\n'
                            "def test_never():\n    pass\n",
    "test_tool_guard.py": 'import pytest\n\ndef test_tool():\n    pytest.skip("frobnicate is not installed")\n',
    "test_hardware.py": 'import pytest\n\ndef test_gpu():\n    pytest.skip("hardware: needs a CUDA device")\n',
    "test_plain.py": "def test_ok():\n    pass\n",
}


def pytest_in(tmp: Path, *args: str, required: bool, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PACKER_TOOLS_REQUIRED": "1" if required else "0", "PYTHONPATH": str(REPO)}
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=300, check=False)


def suite(tmp: Path) -> Path:
    d = tmp / "suite"
    d.mkdir()
    (d / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    for name, text in CASES.items():
        (d / name).write_text(text)
    return d


def test_guarded_skips_pass_without_the_switch(tmp_path: Path) -> None:
    proc = pytest_in(suite(tmp_path), required=False)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "1 passed, 3 skipped" in proc.stdout, proc.stdout[-2000:]


def test_guarded_skips_fail_under_the_switch_and_hardware_skips_stay(tmp_path: Path) -> None:
    # a skip at collection or setup is reported as an error; either way the run exits 1
    proc = pytest_in(suite(tmp_path), "--continue-on-collection-errors", required=True)
    assert proc.returncode == 1, proc.stdout[-2000:]
    tail = proc.stdout.strip().splitlines()[-1]
    assert "1 failed, 1 passed, 1 skipped, 1 error" in tail, proc.stdout[-2000:]
    assert "PACKER_TOOLS_REQUIRED=1: this test was skipped (Skipped: frobnicate is not installed)" in proc.stdout
    assert "no_such_package_for_packer" in proc.stdout


def test_a_tool_removed_from_the_machine_fails_the_real_test(tmp_path: Path) -> None:
    # the venv's bin alone on PATH: strace (and every other system tool) is gone for the child
    only_venv = str(Path(sys.executable).parent)
    target = "tests/test_sandbox.py::test_convert_opens_no_socket"
    skipped = pytest_in(REPO, target, required=False, path=only_venv)
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout[-2000:]
    failed = pytest_in(REPO, target, required=True, path=only_venv)
    assert failed.returncode == 1 and "1 error" in failed.stdout, failed.stdout[-2000:]
    assert "strace is not installed" in failed.stdout
