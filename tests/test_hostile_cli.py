"""The attack corpus through the commands people run: exit 1, the reason named, nothing written.

The checkpoint corpus (tests/test_hostile_checkpoints.py) goes through `packer convert` in
process, a sample of it through the sandboxed child and through `packer build`; the archive
corpus goes through `packer unbundle` in tests/test_bundle_reader.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from packer.cli import main
from tests.test_bundle_reader import CLI_CORPUS
from tests.test_hostile_checkpoints import CASES

BY_NAME = {case: (reason, build) for case, reason, build in CASES}
# one of each kind: code via __reduce__, a hidden global, TorchScript, a zip lie, a legacy lie,
# a record that lies, a resource bomb
SAMPLE = ["reduce-protocol-2", "stack-global-dotted", "torchscript-archive", "bad-crc", "legacy-computed-magic",
          "extent-past-storage", "string-4gib"]


def _write(tmp_path: Path, case: str) -> tuple[Path, Path, str]:
    reason, build = BY_NAME[case]
    canary = tmp_path / "canary"
    path = tmp_path / "in" / "pytorch_model.bin"
    path.parent.mkdir()
    path.write_bytes(build(tmp_path, canary))
    return path, canary, reason


def _one_error_line(text: str, reason: str) -> None:
    lines = [line for line in text.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and reason in lines[0], text
    assert "Traceback" not in text


def test_corpus_spans_every_category() -> None:
    assert len(CASES) + len(CLI_CORPUS) >= 40
    assert len(SAMPLE) >= 5


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_convert_refuses(tmp_path: Path, case: str) -> None:
    path, canary, reason = _write(tmp_path, case)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", "--no-sandbox", str(path), "-o", str(out)])
    assert result.exit_code == 1
    _one_error_line(result.output, reason)
    assert not out.exists() and not canary.exists()


@pytest.mark.parametrize("case", SAMPLE)
def test_sandboxed_convert_and_build_refuse(tmp_path: Path, case: str) -> None:
    path, canary, reason = _write(tmp_path, case)
    for args in (["convert", str(path), "-o", str(tmp_path / "out")],
                 ["build", "-o", str(tmp_path / "out"), str(tmp_path / "r.toml")]):
        (tmp_path / "r.toml").write_text(f'name = "x"\nversion = "1"\nsource = "{path.parent}"\n')
        proc = subprocess.run([sys.executable, "-m", "packer", *args], capture_output=True, text=True, check=False)
        assert proc.returncode == 1, proc.stderr
        _one_error_line(proc.stderr, reason)
        assert not (tmp_path / "out").exists() and not canary.exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))]  # no staging left
