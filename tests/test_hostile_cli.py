"""The attack corpus through the commands people run: exit 1, the reason named, nothing written.

The checkpoint corpus (tests/test_hostile_checkpoints.py) goes through `packer convert` in
process, a sample of it through the sandboxed child and through `packer build`; the archive
corpus goes through `packer unbundle` in tests/test_bundle_reader.py. A FIFO goes through every
command that opens an input.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
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


def _hub_build(tmp_path: Path, ref_text: str) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    """`packer build` of hf://acme/tiny-model@main from an offline cache whose refs/main holds ``ref_text``."""
    import torch

    from tests.hf_cache import populate_cache

    def checkpoint(value: float) -> bytes:
        torch.save({"w": torch.full((4,), value)}, tmp_path / "ck.bin")
        return (tmp_path / "ck.bin").read_bytes()

    cache = tmp_path / "hub"
    populate_cache(cache, "acme/tiny-model", {"pytorch_model.bin": checkpoint(1.0), "config.json": b"{}"})
    other = populate_cache(cache, "evil/other", {"pytorch_model.bin": checkpoint(666.0), "config.json": b"{}"},
                           commit="f" * 40)
    ref = cache / "models--acme--tiny-model" / "refs" / "main"
    ref.write_text(ref_text.format(other=other))
    (tmp_path / "r.toml").write_text('name = "x"\nversion = "1"\nsource = "hf://acme/tiny-model@main"\n')
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "packer", "build", "-q", "-o", str(tmp_path / "out"),
                           str(tmp_path / "r.toml")], capture_output=True, text=True, env=env, check=False)
    return proc, ref, tmp_path / "out"


@pytest.mark.parametrize("ref_text", ["../../models--evil--other/snapshots/" + "f" * 40, "{other}"])
def test_hub_ref_naming_another_repo_is_refused(tmp_path: Path, ref_text: str) -> None:
    """Round 3: such a ref built the other model under this one's name, and `packer verify` passed."""
    proc, ref, out = _hub_build(tmp_path, ref_text)
    assert proc.returncode == 1, proc.stderr
    _one_error_line(proc.stderr, f"{ref} does not hold a commit hash")
    assert not out.exists() and not [p for p in tmp_path.iterdir() if "staging" in p.name]


def test_hub_ref_with_a_trailing_newline_builds(tmp_path: Path) -> None:
    """A cache copied between machines: refs/main is '<commit>\\n' (was 'not in the local cache')."""
    proc, _, out = _hub_build(tmp_path, "0123456789abcdef0123456789abcdef01234567\n")
    assert proc.returncode == 0, proc.stderr
    source = json.loads((out / "manifest.json").read_bytes())["source"]
    assert source["uri"] == "hf://acme/tiny-model@main"
    assert source["revision"] == "0123456789abcdef0123456789abcdef01234567"


def _fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def _model_dir(tmp_path: Path, fifo_name: str) -> Path:
    src = tmp_path / "model"
    src.mkdir()
    torch.save({"w": torch.ones(2)}, src / "pytorch_model.bin")
    (src / "config.json").write_text("{}")
    if fifo_name in ("pytorch_model.bin", "config.json"):
        (src / fifo_name).unlink()
    _fifo(src / fifo_name)
    return src


def _recipe(tmp_path: Path, source: Path) -> str:
    (tmp_path / "r.toml").write_text(f'name = "x"\nversion = "1"\nsource = "{source}"\n')
    return str(tmp_path / "r.toml")


# every command that opens an input, with a FIFO where the input (or a file in it) belongs
FIFO_CASES: list[tuple[str, Callable[[Path], list[str]], str]] = [
    ("inspect", lambda t: ["inspect", str(_fifo(t / "ckpt.bin"))], "ckpt.bin: is a FIFO"),
    ("convert", lambda t: ["convert", str(_fifo(t / "ckpt.bin")), "-o", str(t / "out")], "ckpt.bin: is a FIFO"),
    ("convert-no-sandbox", lambda t: ["convert", "--no-sandbox", str(_fifo(t / "ckpt.bin")), "-o", str(t / "out")],
     "ckpt.bin: is a FIFO"),
    ("convert-dir", lambda t: ["convert", str(_model_dir(t, "pytorch_model.bin")), "-o", str(t / "out")],
     "pytorch_model.bin: is a FIFO"),
    ("unbundle", lambda t: ["unbundle", str(_fifo(t / "b.tar.zst")), "-o", str(t / "out")], "b.tar.zst: is a FIFO"),
    ("build-recipe", lambda t: ["build", str(_fifo(t / "r.toml")), "-o", str(t / "out")], "r.toml: is a FIFO"),
    ("build-source", lambda t: ["build", _recipe(t, _fifo(t / "ckpt.bin")), "-o", str(t / "out")],
     "ckpt.bin is a FIFO"),
    ("build-checkpoint", lambda t: ["build", _recipe(t, _model_dir(t, "pytorch_model.bin")), "-o", str(t / "out")],
     "pytorch_model.bin: is a FIFO"),
    ("build-config", lambda t: ["build", _recipe(t, _model_dir(t, "config.json")), "-o", str(t / "out")],
     "config.json: is a FIFO"),
    ("bundle", lambda t: ["bundle", str(_model_dir(t, "tokenizer.json")), "-o", str(t / "out")],
     "tokenizer.json: is a FIFO"),
]


@pytest.mark.parametrize(("case", "args", "reason"), FIFO_CASES, ids=[c[0] for c in FIFO_CASES])
def test_a_fifo_is_refused_before_it_is_opened(tmp_path: Path, case: str, args: Callable[[Path], list[str]],
                                               reason: str) -> None:
    # nothing ever writes to the FIFO: a blocking open would hang until the guard kills it
    proc = subprocess.run([sys.executable, "-m", "packer", *args(tmp_path)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 1, proc.stderr
    _one_error_line(proc.stderr, reason)
    assert "not a regular file" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_the_library_refuses_a_fifo_and_a_device_too(tmp_path: Path) -> None:
    from packer.bundle import unbundle
    from packer.checkpoint import inspect_checkpoint, read_checkpoint
    from packer.errors import BundleError, CheckpointError

    fifo = _fifo(tmp_path / "f")
    for call, error in ((read_checkpoint, CheckpointError), (inspect_checkpoint, CheckpointError),
                        (lambda p: unbundle(p, tmp_path / "out"), BundleError)):
        with pytest.raises(error, match="is a FIFO"):
            call(fifo)
    with pytest.raises(CheckpointError, match="/dev/zero: is a character device"):
        read_checkpoint(Path("/dev/zero"))
