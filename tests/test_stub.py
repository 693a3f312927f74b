"""packer.stub: the emitted loader is deterministic, lint-clean and self-contained."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import py_compile
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from packer.errors import StubError
from packer.formats import LOADER_NAME
from packer.fsutil import canonical_json
from packer.stub import emit_loader, render
from tests.loader_fixtures import make_out

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    d = tmp_path_factory.mktemp("out")
    return d, make_out(d)


def run_loader(path: Path, *args: str, env: dict[str, str] | None = None,
               block_packer: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the emitted file as a script; ``import packer`` fails inside when ``block_packer``."""
    guard = "import sys; sys.modules['packer'] = None; " if block_packer else ""
    code = guard + (f"import runpy, sys; sys.argv = [{str(path)!r}, *{list(args)!r}]; "
                    "runpy.run_path(sys.argv[0], run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=path.parent.parent, env={**os.environ, **(env or {})})


def test_emit_is_deterministic_and_pins_the_manifest(out: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    d, m = out
    stage = emit_loader(tmp_path, m)
    again = emit_loader(tmp_path, json.loads(json.dumps(m)))
    body = (tmp_path / LOADER_NAME).read_bytes()
    assert body == (d / LOADER_NAME).read_bytes() and stage == again
    assert stage.section == {"file": LOADER_NAME,
                             "embedded_sha256": hashlib.sha256(canonical_json(m)).hexdigest()}
    (entry,) = stage.files
    assert (entry.path, entry.size, entry.sha256) == (LOADER_NAME, len(body), hashlib.sha256(body).hexdigest())
    assert list(tmp_path.iterdir()) == [tmp_path / LOADER_NAME]  # no temp file left behind
    assert body.startswith(b"#!/usr/bin/env python3\n# Emitted by packer for \"tiny-\\xe9t\\xe9 'model'\" '1'")
    assert body.isascii()


def test_emitted_file_compiles_and_passes_ruff(out: tuple[Path, dict[str, Any]]) -> None:
    d, _ = out
    py_compile.compile(str(d / LOADER_NAME), doraise=True, cfile=str(d / "x.pyc"))
    (d / "x.pyc").unlink()
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    r = subprocess.run([ruff, "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(d / LOADER_NAME)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_emitted_module_round_trips_the_manifest(out: tuple[Path, dict[str, Any]]) -> None:
    d, m = out
    mod = import_emitted(d / LOADER_NAME)
    assert mod.manifest() == m
    assert canonical_json(mod.manifest()) == canonical_json(m)


def test_selftest_without_the_packer_package(out: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    d, m = out
    env = {"PACKER_BUNDLE_CACHE": str(tmp_path / "cache"), "PACKER_STARTUP_LOG": "text"}
    r = run_loader(d / LOADER_NAME, "--selftest", "--device", "cpu", "--verify", env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines[-1] == f"packer_loader: self-test passed ({len(m['weights']['tensors'])} tensors on cpu)"
    stages = [x.split(":")[0] for x in lines if x.startswith("[startup] ")]
    assert stages[0] == "[startup] import torch" and "[startup] bundle" in stages
    assert stages[-1] == "[startup] total"
    assert sorted(os.listdir(tmp_path / "cache" / m["bundle"]["sha256"])) == ["config.json", "tok"]


def import_emitted(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"emitted_{abs(hash(path))}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_selftest_exit_codes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "out"
    d.mkdir()
    m = make_out(d, bundle=False)
    monkeypatch.setenv("PACKER_STARTUP_LOG", "off")
    mod = import_emitted(d / LOADER_NAME)
    assert mod.main([]) == 2
    assert mod.main(["--selftest", "--device", "cpu"]) == 0
    rel = m["weights"]["files"][1]
    data = bytearray((d / rel).read_bytes())
    data[-3] ^= 1
    (d / rel).write_bytes(data)
    assert mod.main(["--selftest", "--device", "cpu"]) == 0  # sizes and headers still match
    capsys.readouterr()
    assert mod.main(["--selftest", "--device", "cpu", "--verify"]) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"packer_loader: self-test failed: {rel}: sha256 ")
    moved = tmp_path / "elsewhere"
    shutil.copytree(d, moved)
    (d / rel).unlink()
    assert mod.main(["--selftest", "--device", "cpu"]) == 1
    assert f"{rel}: missing" in capsys.readouterr().err.splitlines()[-1]
    monkeypatch.setenv("PACKER_ARTIFACTS", str(moved))  # artifacts found through the environment
    assert mod.main(["--selftest", "--device", "cpu"]) == 0
    assert mod.main(["--selftest", "--device", "cpu", "--root", str(d)]) == 1
    if not torch.cuda.is_available():
        assert mod.main(["--selftest", "--device", "cuda"]) == 1
        assert "CUDA is not available" in capsys.readouterr().err.splitlines()[-1]



@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback where CUDA is missing")
def test_selftest_says_when_it_checks_a_cuda_build_on_cpu(tmp_path: Path) -> None:
    from packer.build import build
    from packer.recipe import demo_recipe

    out = tmp_path / "out"
    build(demo_recipe(), out)  # runtime.device = "cuda"
    r = run_loader(out / LOADER_NAME, "--selftest")
    assert r.returncode == 0, r.stderr
    assert "the build's device is cuda but CUDA is not available here; checking on cpu" in r.stderr
    r = run_loader(out / LOADER_NAME, "--selftest", "--device", "cuda")  # asked for: required
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("packer_loader: self-test failed: device 'cuda' asked for"), last


def test_warmup_inputs_from_the_recipe(tmp_path: Path) -> None:
    body, _ = render({"runtime": {"device": "cpu", "warmup": [{"name": "input_ids", "shape": [2, 7], "dtype": "int64"},
                                                             {"name": "x", "shape": [3], "dtype": "float16"}]}})
    (tmp_path / LOADER_NAME).write_bytes(body)
    inputs = import_emitted(tmp_path / LOADER_NAME).warmup_inputs("cpu")
    assert [(k, tuple(v.shape), v.dtype) for d in inputs for k, v in d.items()] == [
        ("input_ids", (2, 7), torch.int64), ("x", (3,), torch.float16)]


def test_render_refuses_a_template_without_the_block() -> None:
    with pytest.raises(StubError, match="packer:embedded"):
        render({}, loader_source="x = 1\n", reader_source="")


def test_reader_with_triple_quotes_falls_back_to_literals() -> None:
    reader = "X = '''a\\\\b'''\nY = 'é'\n"
    body, _ = render({"name": "n"}, reader_source=reader)
    ns: dict[str, Any] = {}
    exec(compile(body, "emitted", "exec"), ns)
    assert ns["_BUNDLE_READER_SOURCE"] == reader
    assert max(len(x) for x in body.decode().splitlines()) <= 120  # ruff: E501 at 120


@pytest.mark.parametrize("text", ["plain", "quote ' and \\\\ backslash", "line\nbreak", "\u00e9\u4e2d\U0001f600"])
def test_embedded_strings_survive(text: str) -> None:
    body, digest = render({"name": text, "version": "1"}, reader_source="")
    ns: dict[str, Any] = {}
    exec(compile(body, "emitted", "exec"), ns)
    assert json.loads(ns["_EMBEDDED_JSON"]) == {"name": text, "version": "1"}
    assert digest == hashlib.sha256(canonical_json({"name": text, "version": "1"})).hexdigest()


def test_import_beyond_torch_loads_only_the_standard_library(out: tuple[Path, dict[str, Any]]) -> None:
    # what importing the loader costs beyond `import torch` is measured by benchmarks/load_cpu.py;
    # here, the outcome that keeps it small: nothing but standard-library modules gets imported
    d, _ = out
    code = textwrap.dedent(f"""
        import importlib.util, json, sys, torch
        before = set(sys.modules)
        spec = importlib.util.spec_from_file_location("pl", {str(d / LOADER_NAME)!r})
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        print(json.dumps(sorted(set(sys.modules) - before)))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    new = {name.split(".")[0] for name in json.loads(r.stdout)} - {"pl"}
    assert new <= set(sys.stdlib_module_names), sorted(new - set(sys.stdlib_module_names))
