"""Where each tensor of a shard goes in its device buffer: ``ALIGN``-byte aligned offsets.

Tensors keep their file order; a run of tensors whose file offsets are already aligned once
shifted stays one contiguous segment (one read, one copy per chunk: the aligned majority pays
nothing), and the shift grows only at a tensor that would otherwise start misaligned, by less
than ``ALIGN`` bytes. Segments cover the whole data section, gaps included, so a verified
load still hashes every byte of the file in order.
"""

from __future__ import annotations

from .engines import ALIGN
from .shards import TensorEntry


class Layout:
    """One shard's device layout.

    Attributes:
        nbytes: size of the device buffer.
        segments: ``(offset in the data section, offset in the device buffer, nbytes)``,
            in file order, covering the data section exactly once.
        offsets: device buffer offset of each tensor, by name.
    """

    def __init__(self, nbytes: int, segments: list[tuple[int, int, int]], offsets: dict[str, int]) -> None:
        self.nbytes, self.segments, self.offsets = nbytes, segments, offsets


def plan_layout(tensors: list[TensorEntry], data_len: int,
                align: int = ALIGN) -> Layout:
    """Device offsets for ``tensors`` (sorted by begin).

    An empty tensor never splits a segment; neither does a tensor that overlaps the one
    before it (not produced by safetensors; it keeps the shift and may then be copied).
    """
    starts: list[tuple[int, int]] = [(0, 0)]  # (file offset, shift) where a segment begins
    shift, seen_end, offsets = 0, 0, {}
    for name, _, _, begin, end in tensors:
        if end > begin and (begin + shift) % align and begin >= seen_end:
            shift += -(begin + shift) % align
            if starts[-1][0] == begin:
                starts[-1] = (begin, shift)
            else:
                starts.append((begin, shift))
        offsets[name] = begin + shift
        seen_end = max(seen_end, end)
    bounds = [f for f, _ in starts[1:]] + [data_len]
    segments = [(f, f + sh, b - f) for (f, sh), b in zip(starts, bounds, strict=True) if b > f]
    return Layout(data_len + shift, segments, offsets)

