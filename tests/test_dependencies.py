"""A missing runtime dependency is named as itself, in one line, exit 1: never as a file verdict.

Each case runs the real CLI in a fresh process whose ``sitecustomize`` makes one package
unimportable (``sys.modules[name] = None``, the import system's own way to block a module), as if
it had been uninstalled. The packaging check in ``.ci/run`` repeats the numpy case with a real
``pip uninstall`` in a venv that holds only the wheel and the CPU torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BLOCKER = """\
import os, sys
for name in os.environ.get("PACKER_TEST_BLOCK", "").split(","):
    if name:
        sys.modules[name] = None
"""


def run_without(tmp_path: Path, module: str, *args: str) -> subprocess.CompletedProcess[str]:
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(BLOCKER)
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PACKER_TEST_BLOCK": module,
           "PYTHONPATH": os.pathsep.join([str(shim), str(repo)])}
    return subprocess.run([sys.executable, "-m", "packer", *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path, check=False)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(4)}, path)
    return path


def assert_names(proc: subprocess.CompletedProcess[str], dist: str) -> None:
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: packer needs {dist}: "), lines[0]
    assert "rejects" not in lines[0]
    assert f"pip install {dist}" in lines[0]


@pytest.mark.parametrize("module", ["numpy", "safetensors"])
@pytest.mark.parametrize("sandbox", [True, False])
def test_convert_names_the_missing_package(tmp_path: Path, checkpoint: Path, module: str, sandbox: bool) -> None:
    out = tmp_path / "out"
    args = ["convert", str(checkpoint), "-o", str(out)] + ([] if sandbox else ["--no-sandbox"])
    assert_names(run_without(tmp_path, module, *args), module)
    assert not out.exists()


def test_cast_path_names_torch(tmp_path: Path, checkpoint: Path) -> None:
    out = tmp_path / "out"
    proc = run_without(tmp_path, "torch", "convert", str(checkpoint), "-o", str(out), "--dtype", "float16")
    assert_names(proc, "torch")
    assert not out.exists()


def test_build_names_zstandard(tmp_path: Path) -> None:
    proc = run_without(tmp_path, "zstandard", "build", "-o", str(tmp_path / "out"))
    assert_names(proc, "zstandard")
    assert not (tmp_path / "out").exists()


def test_hub_source_names_huggingface_hub(tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "m"\nversion = "1"\nsource = "hf://org/model@0123456789abcdef0123456789abcdef01234567"\n')
    proc = run_without(tmp_path, "huggingface_hub", "build", str(recipe), "-o", str(tmp_path / "out"))
    assert_names(proc, "huggingface-hub")


def test_cli_without_click_is_one_line(tmp_path: Path) -> None:
    assert_names(run_without(tmp_path, "click", "--version"), "click")


def test_version(tmp_path: Path) -> None:
    proc = run_without(tmp_path, "", "--version")
    assert proc.returncode == 0
    from packer import __version__

    assert proc.stdout.strip() == f"packer, version {__version__}"


def test_emitted_loader_names_a_missing_zstandard(tmp_path: Path) -> None:
    from packer.building import build
    from packer.recipe import demo_recipe

    out = tmp_path / "out"
    build(demo_recipe(), out)
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(BLOCKER)
    # an empty bundle cache: a hit needs no zstandard (one stat), the extraction on a miss does
    env = {**os.environ, "PACKER_TEST_BLOCK": "zstandard", "PYTHONPATH": str(shim),
           "PACKER_BUNDLE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, str(out / "packer_loader.py"), "--selftest"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, check=False)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("packer_loader: self-test failed: packer_loader needs zstandard: "), last
