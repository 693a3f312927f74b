"""Expanded and overlapping views: written out element by element, the total bounded.

``torch.ones(4).expand(3, 4)`` is a stride-0 view over a 16-byte storage, and torch saves it
as such. packer materializes it (bitwise what ``torch.load(weights_only=True)`` gives); what a
checkpoint can make packer write in all is bounded by ``weights.max_expansion``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from packer.cli import main
from tests.ckpt_factory import FakeStorage, simple_tensor_dict, tensor_bytes, tensor_pickle, torch_zip


def _views() -> dict[str, torch.Tensor]:
    base = torch.arange(12, dtype=torch.float32)
    return {
        "expanded": torch.ones(4).expand(3, 4),
        "broadcast": torch.tensor([1.5, -2.0]).unsqueeze(1).expand(2, 5),
        "overlapping": base.as_strided((4, 6), (2, 1)),  # rows share elements
        "bf16_expanded": torch.tensor([3.0], dtype=torch.bfloat16).expand(7, 3),
    }


def _convert(src: Path, out: Path, *extra: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["convert", "--no-sandbox", str(src), "-o", str(out), *extra])
    return result.exit_code, result.output


def test_expanded_views_convert_bitwise(tmp_path: Path) -> None:
    src = tmp_path / "pytorch_model.bin"
    torch.save(_views(), src)
    code, output = _convert(src, tmp_path / "out")
    assert code == 0, output
    want = torch.load(src, weights_only=True)
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].shape == t.shape and got[name].dtype == t.dtype
        assert tensor_bytes(got[name]) == tensor_bytes(t), name


def _stride0(size: tuple[int, ...]) -> bytes:
    """A torch zip whose one tensor ``w`` is a stride-0 view of ``size`` over 4 floats (16 bytes)."""
    pkl = tensor_pickle(simple_tensor_dict(FakeStorage("0", 4), 0, size, (0,) * len(size)))
    return torch_zip(pkl, {"0": bytes(range(16))})


def test_the_total_is_bounded_before_a_byte_is_written(tmp_path: Path) -> None:
    src = tmp_path / "in" / "pytorch_model.bin"
    src.parent.mkdir()
    src.write_bytes(_stride0((2**40,)))  # 4 TiB from 16 bytes
    out = tmp_path / "out"
    code, output = _convert(src, out)
    assert code == 1 and not out.exists()
    lines = output.strip().splitlines()
    assert len(lines) == 1, output
    line = lines[0]
    assert f"{src}: tensor 'w'" in line
    assert "holds 4398046511104 bytes over its storage 'data/0' of 16 bytes" in line
    assert "weights.max_expansion = 4 times" in line and "--max-expansion" in line


def test_the_bound_follows_the_recipe_key(tmp_path: Path) -> None:
    src = tmp_path / "in" / "pytorch_model.bin"
    src.parent.mkdir()
    size = (1 << 30) // 4 + 64  # just over the 1 GiB allowance
    src.write_bytes(_stride0((size,)))
    code, output = _convert(src, tmp_path / "a", "--dry-run")
    assert code == 1 and "weights.max_expansion" in output
    from packer.recipe import recipe_from_dict
    from packer.weights.convert import convert

    rec = recipe_from_dict({"name": "x", "version": "1", "source": str(src.parent),
                            "weights": {"max_expansion": 1e9}})
    result = convert(src.parent, tmp_path / "b", rec.weights, dry_run=True)
    assert result.section["tensors"]["w"]["shape"] == [size]
    with pytest.raises(Exception, match="weights.max_expansion: expected a positive number"):
        recipe_from_dict({"name": "x", "version": "1", "source": ".", "weights": {"max_expansion": 0}})


def test_the_sandboxed_convert_refuses_too(tmp_path: Path) -> None:
    import subprocess
    import sys

    src = tmp_path / "in" / "pytorch_model.bin"
    src.parent.mkdir()
    src.write_bytes(_stride0((1024, 2**30)))
    proc = subprocess.run([sys.executable, "-m", "packer", "convert", str(src), "-o", str(tmp_path / "out")],
                          capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 1 and "weights.max_expansion" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
