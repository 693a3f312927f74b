"""Reading weights safely: tensor records and byte ranges, nothing imported or called."""

from packer.checkpoint.inspection import inspect_checkpoint
from packer.checkpoint.reader import read_checkpoint
from packer.checkpoint.records import (
    DTYPE_SIZES,
    CheckpointContents,
    StorageRange,
    TensorRecord,
)

__all__ = [
    "DTYPE_SIZES",
    "CheckpointContents",
    "StorageRange",
    "TensorRecord",
    "inspect_checkpoint",
    "read_checkpoint",
]
