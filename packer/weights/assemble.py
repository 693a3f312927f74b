"""A tensor assembled from shards (a distributed checkpoint's chunks), streamed in row blocks.

Shards split along the first dimension only (FSDP2's ``Shard(0)``, the common case) are the
tensor's bytes one after another: :func:`row_pieces` gives them in order, and the writer copies
each with the kernel as it copies any contiguous tensor. Any other tiling (``Shard(1)``, 2-D
meshes) is gathered here: the output is cut into row-major blocks of about ``CHUNK`` bytes (whole
rows, or runs of a row where one row is larger), and each block is filled from the pieces that
cross it (numpy views over the inputs' mappings), so memory stays at one block whatever the
tensor's shape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import product
from math import prod
from typing import Any

from packer.checkpoint.records import DTYPE_SIZES, TensorRecord
from packer.weights.plan import PlannedTensor, is_contiguous

CHUNK = 8 * 2**20


def row_pieces(r: TensorRecord) -> list[TensorRecord] | None:
    """The pieces in first-dimension order when each spans every other dimension whole and is
    contiguous (their bytes, one after another, are the tensor's); else None."""
    ordered = sorted(r.pieces, key=lambda p: p.offsets[:1])
    at = 0
    for p in ordered:
        if p.offsets[1:] != (0,) * (len(r.shape) - 1) or p.record.shape[1:] != r.shape[1:] or \
                p.offsets[:1] != (at,) or not is_contiguous(p.record):
            return None
        at += p.record.shape[0]
    return [p.record for p in ordered]


def piece_blocks(t: PlannedTensor, view_of: Callable[[TensorRecord], Any]) -> Iterator[Any]:
    """The assembled tensor as dense arrays of unsigned integers, in row-major blocks of at most
    about ``CHUNK`` bytes, whatever the shape.

    A block is a run of slices along one dimension ``k`` at one index of each dimension before
    it: ``k`` is the outermost dimension whose slices fit ``CHUNK`` (the first, for a matrix of
    ordinary rows; a later one when a single row holds more than ``CHUNK``). Each block is filled
    from the pieces that cross it.

    Args:
        t: the planned tensor whose record has pieces.
        view_of: a piece's record -> its elements as a numpy array (``uint_view`` over its file).
    """
    r = t.record
    size = DTYPE_SIZES[r.dtype]
    if not r.numel:
        return
    import numpy as np

    shape = r.shape
    if not shape:  # a scalar is one chunk: never pieces, but never a wrong block either
        yield np.ascontiguousarray(view_of(r.pieces[0].record))
        return
    k = 0
    while k < len(shape) - 1 and prod(shape[k + 1:]) * size > CHUNK:
        k += 1
    step = max(1, CHUNK // (prod(shape[k + 1:]) * size))
    for lead in product(*(range(n) for n in shape[:k])):
        for a in range(0, shape[k], step):
            box = (*((i, i + 1) for i in lead), (a, min(shape[k], a + step)), *((0, n) for n in shape[k + 1:]))
            out = np.empty([hi - lo for lo, hi in box], dtype=f"<u{size}")
            for p in r.pieces:
                cut = [(max(lo, o), min(hi, o + n)) for (lo, hi), o, n in zip(box, p.offsets, p.record.shape,
                                                                             strict=True)]
                if any(x >= y for x, y in cut):
                    continue
                dst = tuple(slice(x - lo, y - lo) for (x, y), (lo, _) in zip(cut, box, strict=True))
                src = tuple(slice(x - o, y - o) for (x, y), o in zip(cut, p.offsets, strict=True))
                out[dst] = view_of(p.record)[src]
            yield out
