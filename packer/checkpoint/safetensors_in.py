"""Existing ``*.safetensors`` inputs: the header parsed and checked here, bytes left in place."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import BinaryIO

from packer.checkpoint.records import (
    DTYPE_SIZES,
    PACKED,
    TORCH_SHAPES_KEY,
    CheckpointContents,
    StorageRange,
    TensorRecord,
    torch_shape,
)
from packer.errors import CheckpointError
from packer.reading import JSON_DOC, parse_json
from packer.safetensors_header import read_header

_COMPLEX = {"C128", "C32"}


def _fail(path: Path, place: str, reason: str) -> CheckpointError:
    return CheckpointError(f"{path}: {place}: {reason}")


def looks_like_safetensors(head: bytes) -> bool:
    """True when the first bytes are a header length (checked later) followed by ``{``."""
    return len(head) >= 9 and head[8:9] == b"{"


def _metadata(path: Path, value: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise _fail(path, "__metadata__", "must map strings to strings")
    return tuple(sorted(value.items()))


def _record(path: Path, name: str, info: object, base: int) -> tuple[TensorRecord, int, int]:
    place = f"tensor {name}"
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise _fail(path, place, "entry must have exactly dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype in _COMPLEX:
        raise _fail(path, place, f"complex dtype {dtype} is not supported")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise _fail(path, place, f"unknown dtype {str(dtype)[:20]}")
    if not isinstance(shape, list) or len(shape) > 64 or not all(type(d) is int and 0 <= d < 2**63 for d in shape):
        raise _fail(path, place, "shape must be a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(type(o) is int and 0 <= o < 2**63 for o in offsets)):
        raise _fail(path, place, "data_offsets must be two non-negative integers")
    begin, end = offsets
    stored = tuple(shape)
    shape = torch_shape(dtype, stored)
    if shape is None:
        raise _fail(path, place, f"{dtype} shape {list(stored)} does not fill whole bytes in its last dimension")
    numel = 1
    for d in shape:
        numel *= d
    if end < begin or end - begin != numel * DTYPE_SIZES[dtype]:
        raise _fail(path, place, f"data_offsets {offsets} disagree with dtype and shape")
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    rng = StorageRange(name, path, base + begin, end - begin)
    rec = TensorRecord(name, dtype, shape, tuple(reversed(stride)), rng, 0)
    return rec, begin, end


def read_safetensors(f: BinaryIO, path: Path, size: int, *, offset: int = 0) -> CheckpointContents:
    """Parse and check a safetensors file's header; return one record per tensor.

    With ``offset`` the file is the ``size`` bytes at ``offset`` of ``f`` (a weight file inside
    its layer blob); the records' storage offsets then count from the start of ``f``.

    Offsets must tile the data area exactly (no gaps, overlaps or trailing bytes), as the
    safetensors library requires.

    Raises:
        CheckpointError: a malformed header, an unknown or complex dtype, bad offsets.
    """
    header, base = read_header(f, path, size, error=CheckpointError, offset=offset)
    meta: tuple[tuple[str, str], ...] = ()
    spans: list[tuple[int, int, TensorRecord]] = []
    for name, info in header.items():
        if name == "__metadata__":
            meta = _metadata(path, info)
            continue
        rec, begin, end = _record(path, name, info, offset + base)
        spans.append((begin, end, rec))
    spans.sort(key=lambda s: (s[0], s[1]))
    expected = 0
    for begin, end, rec in spans:
        if begin != expected:
            what = "overlaps another tensor" if begin < expected else f"leaves a gap at {expected}"
            raise _fail(path, f"tensor {rec.name}", what)
        expected = end
    if base + expected != size:
        raise _fail(path, "safetensors data", f"{size - base - expected} bytes not covered by tensors")
    shapes = _recorded_shapes(path, dict(meta))
    tensors = tuple(_recorded_shape(path, s[2], shapes) for s in spans)  # file order: sequential reads
    return CheckpointContents(path, "safetensors", tensors, (), meta)


def _recorded_shapes(path: Path, meta: dict[str, str]) -> dict[str, object]:
    """packer's own ``{name: torch shape}`` metadata (empty when the file has none)."""
    raw = meta.get(TORCH_SHAPES_KEY)
    if raw is None:
        return {}
    try:
        shapes = parse_json(raw, JSON_DOC, where=str(path), error=CheckpointError)
    except CheckpointError:
        raise _fail(path, f"__metadata__ {TORCH_SHAPES_KEY}", "not JSON") from None
    return shapes if isinstance(shapes, dict) else {}


def _recorded_shape(path: Path, rec: TensorRecord, shapes: dict[str, object]) -> TensorRecord:
    """A 0-d float4 stored as its one byte gets its recorded torch shape back (packer's own key)."""
    shape = shapes.get(rec.name) if rec.dtype in PACKED else None
    if shape is None:
        return rec
    if shape != [] or rec.shape != (1,):  # only the 0-d case is ever recorded
        raise _fail(path, f"tensor {rec.name}", f"recorded torch shape {shape} does not fit {list(rec.shape)}")
    return dataclasses.replace(rec, shape=(), stride=())
