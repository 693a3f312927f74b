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

from packer.fsutil import canonical_json
from packer.stub import LOADER_NAME, StubError, amalgamate, emit_loader, import_block, render, runtime_modules
from tests.loader_fixtures import make_out

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    d = tmp_path_factory.mktemp("out")
    return d, make_out(d)


def run_loader(path: Path, *args: str, env: dict[str, str] | None = None,
               block_packer: bool = True) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """Run the emitted file as a script; ``import packer`` fails inside when ``block_packer``."""
    guard = "import sys; sys.modules['packer'] = None; " if block_packer else ""
    code = guard + (f"import runpy, sys; sys.argv = [{str(path)!r}, *{list(args)!r}]; "
                    "runpy.run_path(sys.argv[0], run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=path.parent.parent, env={**os.environ, **(env or {})})  # fmt: skip


def test_emit_is_deterministic_and_pins_the_manifest(out: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    d, m = out
    stage = emit_loader(tmp_path, m)
    again = emit_loader(tmp_path, json.loads(json.dumps(m)))
    body = (tmp_path / LOADER_NAME).read_bytes()
    assert body == (d / LOADER_NAME).read_bytes() and stage == again
    assert stage.section == {"file": LOADER_NAME,
                             "embedded_sha256": hashlib.sha256(canonical_json(m)).hexdigest()}  # fmt: skip
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
                       capture_output=True, text=True)  # fmt: skip
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
                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
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


def test_import_cost_beyond_torch_is_small(out: tuple[Path, dict[str, Any]]) -> None:
    d, _ = out
    code = textwrap.dedent(f"""
        import time, torch, importlib.util
        t = time.perf_counter()
        spec = importlib.util.spec_from_file_location("pl", {str(d / LOADER_NAME)!r})
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        print(time.perf_counter() - t)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout) < 0.1  # the budget is 30 ms; CI machines are noisy


def test_runtime_modules_join_in_dependency_order() -> None:
    mods = runtime_modules()
    names = [m.name for m in mods]
    assert names[-1] == "loader" and "bundle_reader" not in names and len(set(names)) == len(names)
    for i, m in enumerate(mods):
        assert set(m.deps) <= set(names[:i]), m.name  # every dependency comes first
        lines = (ROOT / "packer" / "runtime" / f"{m.name}.py").read_text().count("\n")
        assert lines <= 400, f"packer/runtime/{m.name}.py has {lines} lines (style: at most 400)"
    text = amalgamate()
    assert text == amalgamate() and text.count("from __future__ import annotations") == 1
    assert "from packer" not in text and "import packer" not in text
    assert text.startswith(mods[-1].doc_source)


def _fake_runtime(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    return tmp_path


LOADER_USES_A = """
    \"\"\"Entry.\"\"\"

    from __future__ import annotations

    from pathlib import PurePath

    from packer.runtime.a import (
        HELPER,
        helper,
    )

    VALUE = helper(PurePath("x"))
"""


def test_amalgamate_a_small_runtime(tmp_path: Path) -> None:
    a = """
        \"\"\"Module a.\"\"\"
        import os
        from pathlib import Path
        HELPER = 1
        def helper(p: object) -> str:
            return str(Path(os.fspath(str(p)))) + str(HELPER)
    """
    text = amalgamate(_fake_runtime(tmp_path, {"loader": LOADER_USES_A, "a": a}))
    assert text.startswith('"""Entry."""\n\nfrom __future__ import annotations\n\n'
                           "import os\nfrom pathlib import Path, PurePath\n\n\n# --- packer/runtime/a.py\n"
                           "# Module a.\nHELPER = 1\n")  # fmt: skip
    ns: dict[str, Any] = {}
    exec(compile(text, "amalgamated", "exec"), ns)
    assert ns["VALUE"] == "x1" and ns["__doc__"] == "Entry."


@pytest.mark.parametrize(("a", "error"), [
    ("import torch\nHELPER = 1\ndef helper(p): pass\n", "top-level import of 'torch'"),
    ("from . import b\n", "only 'from packer.runtime.<module> import <names>'"),
    ("from packer.fsutil import canonical_json\n", "only 'from packer.runtime.<module> import <names>'"),
    ("from packer.runtime.loader import VALUE\n", "import cycle loader -> a -> loader"),
    ("from packer.runtime.nowhere import x\n", "nowhere.py: not a runtime module"),
    ("from packer.runtime.bundle_reader import Bundle\n", "bundle_reader.py: not a runtime module"),
    ("HELPER = 1\nVALUE = 2\ndef helper(p): pass\n", "'VALUE' is bound by both a.py and loader.py"),
    ("HELPER = 1\ndef helper(p): pass\nclass PurePath: pass\n",
     "'PurePath' is bound by both a standard-library import and a.py"),
])  # fmt: skip
def test_amalgamate_refuses_what_one_file_cannot_hold(tmp_path: Path, a: str, error: str) -> None:
    (tmp_path / "bundle_reader.py").write_text("class Bundle: pass\n")
    with pytest.raises(StubError, match=error.replace(".", "[.]").replace("(", "[(]").replace(")", "[)]")):
        amalgamate(_fake_runtime(tmp_path, {"loader": LOADER_USES_A, "a": a}))


def test_import_block_merges_and_sorts_as_isort() -> None:
    pairs = [("", "sys"), ("typing", "Any"), ("", "os"), ("collections.abc", "Iterator"),
             ("collections.abc", "Callable"), ("typing", "Any"), ("", "os.path as osp"),
             ("os", "SEEK_SET"), ("os", "PathLike"), ("os", "fspath")]  # fmt: skip
    assert import_block(pairs) == ("import os\nimport os.path as osp\nimport sys\n"
                                   "from collections.abc import Callable, Iterator\n"
                                   "from os import SEEK_SET, PathLike, fspath\nfrom typing import Any\n")  # fmt: skip
    long = import_block([("typing", f"Name{i:03d}") for i in range(12)])
    assert long.startswith("from typing import (\n    Name000,\n") and long.endswith("    Name011,\n)\n")
