"""packer.stub: the emitted stub and runtime are deterministic, lint-clean, checked and debuggable."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from packer.errors import StubError
from packer.stub import RUNTIME, RUNTIME_DIR, emit_loader, planned_files, render, runtime_files
from packer.util.formats import LOADER_NAME
from packer.util.fsutil import canonical_json
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


def emitted_files(d: Path) -> dict[str, bytes]:
    """Every file the loader stage wrote under ``d``: the stub and its runtime."""
    files = [d / LOADER_NAME, *sorted((d / RUNTIME_DIR).rglob("*"))]
    return {f.relative_to(d).as_posix(): f.read_bytes() for f in files if f.is_file()}


def test_emit_is_deterministic_and_pins_the_manifest(out: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    d, m = out
    stage = emit_loader(tmp_path, m)
    first = emitted_files(tmp_path)
    again = emit_loader(tmp_path, json.loads(json.dumps(m)))
    assert emitted_files(tmp_path) == first == emitted_files(d) and stage == again  # byte for byte
    assert stage.section == {"file": LOADER_NAME, "runtime": RUNTIME_DIR,
                             "embedded_sha256": hashlib.sha256(canonical_json(m)).hexdigest()}
    assert [e.path for e in stage.files] == list(first) == planned_files()
    for e in stage.files:
        assert (e.size, e.sha256) == (len(first[e.path]), hashlib.sha256(first[e.path]).hexdigest())
    shipped = {rel.removeprefix(f"{RUNTIME_DIR}/"): data for rel, data in first.items() if rel != LOADER_NAME}
    source = {p.relative_to(RUNTIME).as_posix(): p.read_bytes() for p in RUNTIME.glob("*.py")}
    assert shipped == source  # verbatim: names, docstrings and line numbers as in packer/runtime
    assert {p.name for p in tmp_path.rglob("*")} == {LOADER_NAME, RUNTIME_DIR, *source}  # no temp file left
    body = first[LOADER_NAME]
    assert body.startswith(b"#!/usr/bin/env python3\n# Emitted by packer for \"tiny-\\xe9t\\xe9 'model'\" '1'")
    assert body.isascii() and body.count(b"\n") < 250  # a stub: the code is in the runtime files
    assert os.stat(tmp_path / LOADER_NAME).st_mode & 0o111  # runnable as a script


def test_emitted_files_compile_and_pass_ruff(out: tuple[Path, dict[str, Any]]) -> None:
    d, _ = out
    py_compile.compile(str(d / LOADER_NAME), doraise=True, cfile=str(d / "x.pyc"))
    (d / "x.pyc").unlink()
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    r = subprocess.run([ruff, "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(d / LOADER_NAME),
                        str(d / RUNTIME_DIR)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_emitted_module_round_trips_the_manifest(out: tuple[Path, dict[str, Any]]) -> None:
    d, m = out
    mod = import_emitted(d / LOADER_NAME)
    assert mod.manifest() == m
    assert canonical_json(mod.manifest()) == canonical_json(m)


def test_the_public_surface_is_the_one_the_loader_reference_documents(out: tuple[Path, dict[str, Any]]) -> None:
    d, _ = out
    mod = import_emitted(d / LOADER_NAME)
    page = (ROOT / "docs" / "reference" / "loader.md").read_text()
    table = page.split("<!-- loader API -->")[1].split("<!-- /loader API -->")[0]
    documented = set(re.findall(r"^\| `([A-Za-z_]+)", table, flags=re.M))
    assert sorted(mod.__all__) == sorted(documented) == mod.__all__
    assert all(hasattr(mod, name) for name in mod.__all__)


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


def emitted_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, Any], Any]:
    """A small build output without a bundle, its manifest and its emitted loader imported."""
    d = tmp_path / "out"
    d.mkdir()
    m = make_out(d, bundle=False)
    monkeypatch.setenv("PACKER_STARTUP_LOG", "off")
    return d, m, import_emitted(d / LOADER_NAME)


def test_selftest_exit_codes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    d, m, mod = emitted_out(tmp_path, monkeypatch)
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
    assert last.startswith(f"packer_loader: self-test failed: {d.resolve() / rel}: sha256 ")
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
        assert capsys.readouterr().err.splitlines()[-1].endswith("no CUDA device here; run with --device cpu")



def test_selftest_failure_names_the_type_and_the_absolute_path_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    d, m, mod = emitted_out(tmp_path, monkeypatch)
    rel = m["weights"]["files"][1]
    with open(d / rel, "r+b") as f:
        f.truncate((d / rel).stat().st_size - 1)
    capsys.readouterr()
    assert mod.main(["--selftest", "--device", "cpu", "--root", str(tmp_path / "out" / ".." / "out")]) == 1
    err = capsys.readouterr().err
    last = err.splitlines()[-1]
    assert last.startswith(f"packer_loader: self-test failed: {d.resolve() / rel}: ")  # absolute, '..' resolved
    assert last.endswith("[ArtifactMismatchError; PACKER_DEBUG=1 prints the traceback]")
    assert last.count(str(d.resolve())) == 1 and "Traceback" not in err
    monkeypatch.setenv("PACKER_DEBUG", "1")
    assert mod.main(["--selftest", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ArtifactMismatchError" in err
    assert err.splitlines()[-1].endswith("[ArtifactMismatchError]")  # the message names the absolute file
    assert err.splitlines()[-1].count(str(d.resolve())) == 1
    (d / rel).unlink()  # a message that names the absolute path already is not given it twice
    assert mod.main(["--selftest", "--device", "cpu"]) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert f"{rel}: missing (looked for {d.resolve()}" in last and last.count(str(d.resolve())) == 1, last


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="hardware: checks the fallback where CUDA is missing")
def test_selftest_says_when_it_checks_a_cuda_build_on_cpu(tmp_path: Path) -> None:
    from packer.building import build
    from packer.recipe import demo_recipe

    out = tmp_path / "out"
    build(demo_recipe(), out)  # runtime.device = "cuda"
    r = run_loader(out / LOADER_NAME, "--selftest")
    assert r.returncode == 0, r.stderr
    assert "the build's device is cuda but CUDA is not available here; checking on cpu" in r.stderr
    r = run_loader(out / LOADER_NAME, "--selftest", "--device", "cuda")  # asked for: required
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last == ("packer_loader: self-test not run: --device cuda needs CUDA, and torch sees no CUDA device "
                    "here; run with --device cpu"), last


def test_warmup_inputs_from_the_recipe(tmp_path: Path) -> None:
    emit_loader(tmp_path, {"runtime": {"device": "cpu", "warmup": [
        {"name": "input_ids", "shape": [2, 7], "dtype": "int64"}, {"name": "x", "shape": [3], "dtype": "float16"}]}})
    inputs = import_emitted(tmp_path / LOADER_NAME).warmup_inputs("cpu")
    assert [(k, tuple(v.shape), v.dtype) for d in inputs for k, v in d.items()] == [
        ("input_ids", (2, 7), torch.int64), ("x", (3,), torch.float16)]


def test_the_embedded_manifest_is_greppable_one_entry_a_line(out: tuple[Path, dict[str, Any]]) -> None:
    d, m = out
    lines = (d / LOADER_NAME).read_text().splitlines()
    for rel, entry in m["files"].items():  # grep <sha256> packer_loader.py: the file's own line
        hits = [x for x in lines if entry["sha256"] in x and f'"{ascii(rel)[1:-1]}":{{' in x]
        assert len(hits) == 1 and f'"size":{entry["size"]}' in hits[0], hits
    for name, t in m["weights"]["tensors"].items():
        hits = [x for x in lines if f'\'"{name}":{{' in x or f'{{"{name}":{{' in x]
        assert len(hits) == 1 and f'"data_offsets":{t["data_offsets"]}'.replace(" ", "") in hits[0], (name, hits)
    big = {"name": "n", "version": "1", "files": {f"weights/model-{i:05d}-of-00300.safetensors":
                                                   {"sha256": f"{i:064x}", "size": i} for i in range(300)},
           "aliases": {f"a{i}": f"b{i}" for i in range(40)}}
    body, digest = render(big, {"x.py": b""})
    head = body.decode().split("\n__all__ = [")[0]
    ns: dict[str, Any] = {}
    exec(compile(head, "emitted", "exec"), ns)
    assert json.loads(ns["_MANIFEST_JSON"]) == big
    assert digest == hashlib.sha256(canonical_json(big)).hexdigest()
    text = body.decode().splitlines()
    assert all(sum(f"{i:064x}" in x for x in text) == 1 for i in range(300))
    assert all(len(x) <= 120 or x.endswith("  # noqa: E501") for x in text)


def test_render_refuses_a_template_without_the_block() -> None:
    with pytest.raises(StubError, match="packer:embedded"):
        render({}, {}, template="x = 1\n")


@pytest.mark.parametrize("text", ["plain", "quote ' and \\\\ backslash", "line\nbreak", "\u00e9\u4e2d\U0001f600"])
def test_embedded_strings_survive(text: str) -> None:
    body, digest = render({"name": text, "version": "1"}, {"x.py": b"y = 1\n"})
    head = body.decode().split("\n__all__ = [")[0]  # the constants, without importing a runtime
    ns: dict[str, Any] = {}
    exec(compile(head, "emitted", "exec"), ns)
    assert json.loads(ns["_MANIFEST_JSON"]) == {"name": text, "version": "1"}
    assert ns["_RUNTIME_SHA256"] == {"x.py": hashlib.sha256(b"y = 1\n").hexdigest()}
    assert digest == hashlib.sha256(canonical_json({"name": text, "version": "1"})).hexdigest()
    assert all(len(x) <= 120 or x.endswith("  # noqa: E501") for x in body.decode().splitlines())  # ruff: E501


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
    assert len({n for n in new if n.startswith("_packer_runtime_")}) == 1  # this build's runtime, by path
    new = {n for n in new if not n.startswith("_packer_runtime_")}
    assert new <= set(sys.stdlib_module_names), sorted(new - set(sys.stdlib_module_names))


def fresh_copy(d: Path, dst: Path) -> Path:
    shutil.copytree(d, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


@pytest.mark.parametrize("fault", ["changed", "missing"])
def test_a_runtime_that_does_not_match_is_refused_in_one_line(out: tuple[Path, dict[str, Any]], tmp_path: Path,
                                                              fault: str) -> None:
    d = fresh_copy(out[0], tmp_path / "out")
    ring = d / RUNTIME_DIR / "ring.py"
    if fault == "changed":
        ring.write_text(ring.read_text().replace("MIB", "MIB * 2", 1))
    else:
        ring.unlink()
    r = run_loader(d / LOADER_NAME, "--selftest", "--device", "cpu")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"packer_loader: {ring}: "), r.stderr  # the absolute path
    assert ("sha256" if fault == "changed" else "No such file") in r.stderr
    assert "ship the packer_runtime/ directory this build wrote beside packer_loader.py" in r.stderr
    with pytest.raises(ImportError, match=f"^packer_loader: {re.escape(str(ring))}: "):
        import_emitted(d / LOADER_NAME)


def test_a_traceback_names_the_runtime_file_line_and_source(out: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    d = fresh_copy(out[0], tmp_path / "out")
    rel = out[1]["weights"]["files"][0]
    data = bytearray((d / rel).read_bytes())
    n = int.from_bytes(data[:8], "little")
    data[8: 8 + n] = b"[]".ljust(n)  # valid JSON of the same length, but not an object
    (d / rel).write_bytes(data)
    code = f"import sys; sys.path.insert(0, {str(d)!r}); import packer_loader; packer_loader.load_weights('cpu')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "PACKER_STARTUP_LOG": "off"})
    assert r.returncode == 1 and "ArtifactMismatchError" in r.stderr.splitlines()[-1], r.stderr
    frames = re.findall(r'^  File "([^"]+)", line (\d+), in (\w+)\n    (.+)$', r.stderr, flags=re.M)
    runtime = [(Path(f), int(n), fn, src) for f, n, fn, src in frames if Path(f).parent == d / RUNTIME_DIR]
    assert [(p.name, fn) for p, _, fn, _ in runtime][-4:] == [
        ("view_local.py", "open_weight"), ("shards.py", "open_shard"), ("shards.py", "read_header"),
        ("shards.py", "_check_header")], r.stderr
    for path, line, _, src in runtime:  # each frame's line is the shipped file's line, as in packer/runtime
        assert path.read_text().splitlines()[line - 1].strip() == src.strip()
        assert (RUNTIME / path.name).read_text().splitlines()[line - 1].strip() == src.strip()
    assert runtime[-1][3].strip().startswith("raise ArtifactMismatchError(")
    assert r.stderr.splitlines()[-1].endswith(f"{rel}: safetensors header is not a JSON object")


def test_the_runtime_is_imported_beside_the_stub_and_leaves_no_bytecode(out: tuple[Path, dict[str, Any]],
                                                                        tmp_path: Path) -> None:
    d = fresh_copy(out[0], tmp_path / "out")
    decoy = tmp_path / "decoy"  # a package of the same name first on sys.path is never imported
    (decoy / RUNTIME_DIR).mkdir(parents=True)
    (decoy / RUNTIME_DIR / "__init__.py").write_text("raise SystemExit('the decoy was imported')\n")
    (decoy / "packer").mkdir()
    (decoy / "packer" / "__init__.py").write_text("raise SystemExit('an installed packer was imported')\n")
    env = {"PACKER_STARTUP_LOG": "off", "PACKER_BUNDLE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(decoy)}
    r = run_loader(d / LOADER_NAME, "--selftest", "--device", "cpu", env=env, block_packer=False)
    assert r.returncode == 0, r.stderr
    code = (f"import sys; sys.path[:0] = [{str(decoy)!r}, {str(d)!r}]; import packer_loader as P; "
            "print(sorted({m.__file__ for n, m in sys.modules.items() if n.startswith('_packer_runtime_')}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    assert {Path(f).parent for f in eval(r.stdout)} == {d / RUNTIME_DIR}
    assert not list((d / RUNTIME_DIR).rglob("__pycache__"))  # nothing beside the artifacts but what was built


def test_two_builds_in_one_process_each_use_their_own_runtime(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    emit_loader(a, {"name": "a", "runtime": {"device": "cpu", "warmup": []}})
    emit_loader(b, {"name": "b", "runtime": {"device": "cpu", "warmup": []}})
    ma, mb = import_emitted(a / LOADER_NAME), import_emitted(b / LOADER_NAME)
    assert (ma.manifest()["name"], mb.manifest()["name"]) == ("a", "b")
    assert Path(sys.modules[ma.LoadResult.__module__].__file__ or "").parent == a / RUNTIME_DIR
    assert Path(sys.modules[mb.LoadResult.__module__].__file__ or "").parent == b / RUNTIME_DIR
    again = import_emitted(a / LOADER_NAME)  # the same stub again: the same runtime, its own build
    assert again.LoadResult is ma.LoadResult and again.manifest() == ma.manifest()
    assert runtime_files().keys() == {p.relative_to(a / RUNTIME_DIR).as_posix() for p in (a / RUNTIME_DIR).glob("*.py")}
