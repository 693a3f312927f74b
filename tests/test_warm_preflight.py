"""A recipe whose ``[warm]`` table cannot run is refused before the build starts: one line, exit 1,
OUT neither created nor touched (issue 49; round 5 found it only after the build, with OUT
published without its warm state).

The engine's interpreter is a stand-in that answers packer's device probe (``cpu``), as vLLM's
CPU build would; no vLLM is needed. A table that would run on another machine (the engine not
installed here) still builds, with the note saying so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hf_fixtures import llama
from tests.test_warm_state import without_vllm

REPO = Path(__file__).resolve().parents[1]


def engine_here(tmp: Path) -> Path:
    """An interpreter whose vLLM runs on ``cpu`` (it answers packer's probe; nothing else is asked here)."""
    python = tmp / "python-with-engine"
    python.write_text('#!/bin/sh\ncase "$2" in *current_platform*) echo cpu; exit 0;; esac\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python


def _build(tmp: Path, warm: str, out: Path) -> subprocess.CompletedProcess[str]:
    recipe = tmp / "recipe.toml"
    recipe.write_text(f'name = "m"\nversion = "1"\nsource = "{tmp / "hf"}"\n\n[warm]\n{warm}\n')
    return subprocess.run([sys.executable, "-m", "packer", "build", str(recipe), "-o", str(out)],
                          capture_output=True, text=True, timeout=300, check=False, cwd=tmp,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PACKER_BUNDLE_CACHE": str(tmp / "bundle")})


def _listing(top: Path) -> dict[str, bytes]:
    return {p.relative_to(top).as_posix(): (p.read_bytes() if p.is_file() else b"")
            for p in sorted(top.rglob("*"))}


@pytest.fixture()
def source(tmp_path: Path) -> Path:
    pytest.importorskip("transformers")
    llama(tmp_path / "hf")
    return tmp_path


@pytest.mark.parametrize("case", ["model_dir missing", "args name the model", "args positional"])
@pytest.mark.parametrize("prior", [False, True])
def test_a_warm_table_that_cannot_run_is_refused_before_anything_is_built(source: Path, case: str,
                                                                          prior: bool) -> None:
    python = engine_here(source)
    warm, said = {
        "model_dir missing": (f'engine = "vllm"\npython = "{python}"\nmodel_dir = "{source / "nowhere"}"',
                              f"--model-dir {source / 'nowhere'}: no such directory"),
        "args name the model": (f'engine = "vllm"\npython = "{python}"\nargs = ["--model=/srv/other"]',
                                "the engine flags may not name the model"),
        "args positional": (f'engine = "vllm"\npython = "{python}"\nargs = ["/srv/other"]',
                            "a positional argument names another model"),
    }[case]
    out = source / "out"
    if prior:  # a build published before: left byte for byte as it was
        out.mkdir()
        (out / "manifest.json").write_text("{}")
    before = _listing(source)
    r = _build(source, warm, out)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: the recipe's [warm] table") and said in lines[0], lines[0]
    assert lines[0].endswith("nothing was built")
    after = _listing(source)
    assert {k: v for k, v in after.items() if k != "recipe.toml"} == before  # no OUT, no staging, no scratch
    assert out.exists() == prior


def test_flags_naming_the_model_are_refused_even_where_the_engine_is_absent(source: Path) -> None:
    python = without_vllm(source)
    r = _build(source, f'engine = "vllm"\npython = "{python}"\nargs = ["--model", "x"]', source / "out")
    assert r.returncode == 1 and "the engine flags may not name the model" in r.stderr, r.stderr
    assert not (source / "out").exists()


def test_a_table_for_another_machine_still_builds_with_its_note(source: Path) -> None:
    python = without_vllm(source)
    out = source / "out"
    r = _build(source, f'engine = "vllm"\npython = "{python}"\nmodel_dir = "{source / "elsewhere"}"', out)
    assert r.returncode == 0, r.stderr
    assert f"[warm] skipped: vLLM is not installed in {python}" in r.stderr + r.stdout
    assert (out / "manifest.json").is_file() and not (out / "warm").exists()
