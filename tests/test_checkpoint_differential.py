"""Differential test: packer's records + raw bytes == what torch.load(weights_only=True) returns.

Hypothesis draws state dicts (every savable dtype, shapes, views, ties, Parameters, nesting),
saves each in both torch formats, and checks every key, dtype, shape, stride, storage offset,
storage sharing and byte. torch's loader is the oracle, except for dtypes its own legacy
loader cannot read back (float8, uint16+ in legacy files), where the saved tensors are.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import given, settings

from packer.checkpoint import read_checkpoint
from tests.ckpt_factory import CODE_TO_TORCH, materialize, save, state_dicts, tensor_bytes

_LEGACY_LOADABLE = {
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8, torch.bool,
}


def _select(obj: object, key: str | None) -> dict:
    for part in key.split(".") if key else []:
        obj = obj[part]  # type: ignore[index]
    return obj  # type: ignore[return-value]


def _check(path: Path, key: str | None, expected: dict) -> None:
    got = read_checkpoint(path, key=key)
    tensors = {k: v for k, v in expected.items() if isinstance(v, torch.Tensor)}
    assert [r.name for r in got.tensors] == list(tensors)
    assert got.skipped == tuple(k for k in expected if k not in tensors)
    owners: dict[int, str] = {}
    ptrs: dict[str, int] = {}
    for rec in got.tensors:
        want = tensors[rec.name]
        assert CODE_TO_TORCH[rec.dtype] == want.dtype
        assert rec.shape == tuple(want.shape) and rec.stride == want.stride()
        assert rec.storage_offset == want.storage_offset()
        assert tensor_bytes(materialize(rec)) == tensor_bytes(want)
        ptr = want.untyped_storage().data_ptr()
        if want.untyped_storage().nbytes():  # storage sharing agrees both ways
            assert owners.setdefault(ptr, rec.storage.key) == rec.storage.key
            assert ptrs.setdefault(rec.storage.key, ptr) == ptr


@settings(max_examples=30)
@given(state_dicts())
def test_reader_agrees_with_torch_load(case: tuple[object, str | None, dict]) -> None:
    obj, key, flat = case
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("zip", "legacy"):
            path = save(obj, Path(tmp) / f"{fmt}.pt", fmt)
            dtypes = {v.dtype for v in flat.values() if isinstance(v, torch.Tensor)}
            if fmt == "zip" or dtypes <= _LEGACY_LOADABLE:
                expected = _select(torch.load(path, weights_only=True), key)
            else:
                expected = flat
            _check(path, key, expected)
