"""What a checkpoint reader yields: tensor records and the byte ranges of their storages.

Readers never build tensors. They describe where each tensor's bytes lie in the input file,
so the writer can copy them straight to the output. Element counts and offsets are in
elements of the record's dtype, as torch stores them; byte ranges are in bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# safetensors dtype code -> bytes per torch element: every dtype both torch and the
# safetensors library store (tests/test_dtypes.py checks this against safetensors.torch).
# F4 is torch's float4_e2m1fn_x2: one byte holds two values, and safetensors counts values.
DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "C64": 8,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "F8_E8M0": 1, "F4": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
# values packed into one torch element, for dtypes safetensors counts in single values
PACKED = {"F4": 2}
# __metadata__ key: JSON {name: torch shape} for packed tensors whose stored shape cannot
# give the torch shape back (a 0-d float4_e2m1fn_x2 is stored as its one byte, shape [2])
TORCH_SHAPES_KEY = "packer.torch_shapes"


def stored_shape(dtype: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape safetensors records for a torch tensor of ``dtype`` and ``shape``.

    A packed dtype (F4) counts single values: the last dimension is multiplied by the
    values per byte; a 0-d packed tensor becomes its one byte, shape ``(2,)``.
    """
    per = PACKED.get(dtype)
    if per is None:
        return shape
    return (*shape[:-1], shape[-1] * per) if shape else (per,)


def torch_shape(dtype: str, stored: tuple[int, ...]) -> tuple[int, ...] | None:
    """The torch shape of a stored safetensors shape; None when it cannot be expressed."""
    per = PACKED.get(dtype)
    if per is None:
        return stored
    if not stored or stored[-1] % per:
        return None
    return (*stored[:-1], stored[-1] // per)


def listing(names: Sequence[str], most: int = 10) -> str:
    """Names for a one-line note: the first ``most``, then how many more."""
    return ", ".join(names[:most]) + (f", and {len(names) - most} more" if len(names) > most else "")


@dataclass(frozen=True)
class StorageRange:
    """One storage's bytes in an input file: ``nbytes`` bytes starting at ``offset``."""

    key: str  # the storage key inside the checkpoint ("0", "data/0", a safetensors name...)
    path: Path
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Piece:
    """One shard of an assembled tensor: where it starts in the whole (elements per dimension)."""

    offsets: tuple[int, ...]
    record: TensorRecord


@dataclass(frozen=True)
class TensorRecord:
    """One tensor as a view of a storage: dtype code, shape, stride and offset in elements."""

    name: str
    dtype: str  # a key of DTYPE_SIZES
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage: StorageRange
    storage_offset: int = 0
    # a tensor assembled from shards (a distributed checkpoint): each piece's offsets in the
    # whole tensor and its own record; ``storage`` then only names the tensor, it holds no bytes
    pieces: tuple[Piece, ...] = ()

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class CheckpointContents:
    """Everything a reader found in one input file."""

    path: Path
    format: str  # "torch-zip" | "torch-legacy" | "safetensors" | "torch-dcp"
    tensors: tuple[TensorRecord, ...]
    skipped: tuple[str, ...] = ()  # names of non-tensor entries, reported, never fatal
    metadata: tuple[tuple[str, str], ...] = ()  # safetensors __metadata__ of an input
    left_out: tuple[str, ...] = ()  # top-level entries beside the selected key, reported
    notes: tuple[str, ...] = ()  # placeholders left out, tensor attributes dropped: reported
    placeholders: tuple[str, ...] = ()  # names of the placeholders the notes list (not again as skipped)
    data_files: tuple[Path, ...] = ()  # files the tensors' bytes lie in besides ``path`` (DCP's .distcp)
