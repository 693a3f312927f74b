"""A tensor assembled from shards (a distributed checkpoint's chunks), streamed in row blocks.

Shards split along the first dimension only (FSDP2's ``Shard(0)``, the common case) are the
tensor's bytes one after another: :func:`row_pieces` gives them in order, and the writer copies
each with the kernel as it copies any contiguous tensor. Any other tiling (``Shard(1)``, 2-D
meshes) is gathered here: the output is cut into blocks of whole rows of about ``CHUNK`` bytes,
and each block is filled from the pieces that cross it (numpy views over the inputs' mappings),
so memory stays at one block whatever the tensor's size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
    """The assembled tensor as dense arrays of unsigned integers, in row-major blocks.

    Args:
        t: the planned tensor whose record has pieces.
        view_of: a piece's record -> its elements as a numpy array (``uint_view`` over its file).
    """
    r = t.record
    size = DTYPE_SIZES[r.dtype]
    if not r.numel:
        return
    import numpy as np

    row = r.numel // r.shape[0] * size
    step = max(1, CHUNK // max(row, 1))
    for r0 in range(0, r.shape[0], step):
        r1 = min(r.shape[0], r0 + step)
        out = np.empty((r1 - r0, *r.shape[1:]), dtype=f"<u{size}")
        for p in r.pieces:
            a, b = max(r0, p.offsets[0]), min(r1, p.offsets[0] + p.record.shape[0])
            if a >= b:
                continue
            dst = (slice(a - r0, b - r0), *(slice(o, o + s) for o, s in zip(p.offsets[1:], p.record.shape[1:],
                                                                             strict=True)))
            out[dst] = view_of(p.record)[a - p.offsets[0]:b - p.offsets[0]]
        yield out
