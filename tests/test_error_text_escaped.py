"""Every entry point prints an error's text as a terminal shows it safely: a path or message
carrying ESC, BEL, CR/LF or a bidi override arrives as visible escapes, on one line.

The CLI (packer/util/show.py on every line), the emitted loader's command line (its generic
failure line, packer/runtime/loader.py ``_why``) and the vLLM adapter's errors and lines.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from packer.adapters import vllm_format
from packer.errors import EngineAdapterError
from tests.built import build_dir

REPO = Path(__file__).resolve().parents[1]
HOSTILE = "evil\x1b]0;pwned\x07\x1b[2J\r\nerror: forged\u202e"
RAW = ("\x1b", "\x07", "\r", "\u202e")


def _clean(text: str) -> None:
    assert not any(c in text for c in RAW), repr(text)


def test_the_cli_escapes_an_error_naming_a_hostile_path(tmp_path: Path) -> None:
    out = tmp_path / HOSTILE
    out.mkdir()
    for cmd in (["verify", str(out)], ["warm", str(out)]):
        r = subprocess.run([sys.executable, "-m", "packer", *cmd], capture_output=True, text=True, timeout=120,
                           check=False, env={**os.environ, "PYTHONPATH": str(REPO)})
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
        _clean(r.stderr)
        assert "\\x1b]0;pwned\\x07" in lines[0] and "\\r\\n" in lines[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from tests.hf_fixtures import llama

    tmp = tmp_path_factory.mktemp("escaped")
    llama(tmp / "hf")
    build_dir(tmp / "hf", tmp / "out")
    return tmp / "out"


@pytest.mark.parametrize("flag", [["--selftest", "--device", "cpu"], ["--model-dir"]])
def test_the_loaders_failure_line_is_escaped(built: Path, tmp_path: Path, flag: list[str]) -> None:
    root = tmp_path / HOSTILE
    root.mkdir()
    r = subprocess.run([sys.executable, str(built / "packer_loader.py"), *flag, "--root", str(root)],
                       capture_output=True, text=True, timeout=120, check=False,
                       env={**os.environ, "PACKER_BUNDLE_CACHE": str(tmp_path / "bundle")})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("packer_loader: "), r.stderr
    _clean(r.stderr)
    assert "\\x1b]0;pwned\\x07" in lines[0]


def test_the_loaders_failure_line_escapes_the_message_itself() -> None:
    from packer.runtime.loader import _why

    line = _why(ValueError(f"bad member {HOSTILE}\ud800"), None)
    _clean(line)
    assert "\\ud800" in line and "\\u202e" in line and line.isprintable()


def test_the_vllm_adapters_errors_are_escaped(tmp_path: Path) -> None:
    model = tmp_path / HOSTILE
    model.mkdir()
    with pytest.raises(EngineAdapterError) as e:
        vllm_format.find_loader(model)
    _clean(str(e.value))
    with pytest.raises(EngineAdapterError) as e:
        vllm_format.find_loader(model, artifacts=model)
    _clean(str(e.value))
    assert "\\x1b]0;pwned\\x07" in str(e.value)
    with pytest.raises(EngineAdapterError) as e:
        vllm_format.options({"device": HOSTILE})
    _clean(str(e.value))
    assert str(EngineAdapterError(HOSTILE)).isprintable()


def test_the_runtimes_errors_reach_an_engine_escaped() -> None:
    """vLLM prints a load's ArtifactMismatchError (and its RegistryError) itself, in its traceback:
    the message is escaped when it is made, and stays so through a worker's pickle."""
    import pickle

    from packer.runtime.env import ArtifactMismatchError
    from packer.runtime.registry import RegistryError

    for cls in (ArtifactMismatchError, RegistryError):
        error = cls(f"weights/{HOSTILE}: chunk 3 does not match")
        _clean(str(error))
        assert str(pickle.loads(pickle.dumps(error))) == str(error)
