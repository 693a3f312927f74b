"""A pickled tensor checked against its storage, in exact integers, into a :class:`TensorRecord`."""

from __future__ import annotations

from pathlib import Path

from packer.checkpoint.allowlist import TORCH_DTYPES
from packer.checkpoint.records import TensorRecord
from packer.checkpoint.tree import TensorRef
from packer.errors import CheckpointError

_I64 = 2**63
_COMPLEX = {"complex32", "chalf", "complex64", "cfloat", "complex128", "cdouble"}


def make_record(path: Path, name: str, ref: TensorRef) -> TensorRecord:
    """Check one tensor against its storage (exact integers) and return its record.

    Raises:
        CheckpointError: an unsupported dtype or a view that does not fit its storage.
    """
    place = f"{path}: tensor {name}"
    code, item = TORCH_DTYPES[ref.dtype]
    if code is None:
        kind = "complex " if ref.dtype in _COMPLEX else ""
        raise CheckpointError(f"{place}: {kind}dtype {ref.dtype} cannot be stored in safetensors")
    size, stride, offset = ref.size, ref.stride, ref.offset
    if len(size) != len(stride):
        raise CheckpointError(f"{place}: shape {size} and stride {stride} differ in rank")
    if any(d < 0 for d in size) or offset < 0:
        raise CheckpointError(f"{place}: negative shape {size} or storage offset {offset}")
    if any(s < 0 for s in stride):
        raise CheckpointError(f"{place}: negative stride {stride} not supported")
    numel = 1
    for d in size:
        numel *= d
    nbytes = ref.storage.range.nbytes
    if numel * item >= _I64 or offset * item >= _I64 or any(s >= _I64 for s in stride):
        raise CheckpointError(f"{place}: shape {size} / offset overflow int64")
    if numel == 0:
        end = offset * item
    else:
        last = offset + sum((d - 1) * s for d, s in zip(size, stride, strict=True))
        if last * item >= _I64:
            raise CheckpointError(f"{place}: extent of shape {size} stride {stride} overflows int64")
        end = (last + 1) * item
    if end > nbytes:
        raise CheckpointError(
            f"{place}: view ends at byte {end} past the end of its {nbytes}-byte storage {ref.storage.key}"
        )
    return TensorRecord(name, code, size, stride, ref.storage.range, offset)
