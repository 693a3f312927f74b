"""The allowlist of a restricted pickle: the torch globals a checkpoint may name, and why.

A torch checkpoint's pickle names a handful of torch functions, classes and dtypes. Only those
listed here are read (as inert :class:`~packer.checkpoint.tree.Global` markers, never imported):
:data:`CALLABLES` may be ``REDUCE``d by the rules in :mod:`packer.checkpoint.tree`;
:data:`VALUE_GLOBALS` may appear as values (dtypes, storage types, tensor types). A user's own
plain-data classes come in only through ``--allow-global`` (:mod:`packer.checkpoint.placeholders`).
"""

from __future__ import annotations

# torch dtype name -> (safetensors code or None when safetensors cannot hold it, item size)
TORCH_DTYPES: dict[str, tuple[str | None, int]] = {
    "float64": ("F64", 8), "double": ("F64", 8), "float32": ("F32", 4), "float": ("F32", 4),
    "float16": ("F16", 2), "half": ("F16", 2), "bfloat16": ("BF16", 2),
    "float8_e4m3fn": ("F8_E4M3", 1), "float8_e5m2": ("F8_E5M2", 1),
    "float8_e4m3fnuz": ("F8_E4M3FNUZ", 1), "float8_e5m2fnuz": ("F8_E5M2FNUZ", 1),
    "float8_e8m0fnu": ("F8_E8M0", 1),
    "int64": ("I64", 8), "long": ("I64", 8), "int32": ("I32", 4), "int": ("I32", 4),
    "int16": ("I16", 2), "short": ("I16", 2), "int8": ("I8", 1),
    "uint8": ("U8", 1), "uint16": ("U16", 2), "uint32": ("U32", 4), "uint64": ("U64", 8),
    "bool": ("BOOL", 1), "complex64": ("C64", 8), "cfloat": ("C64", 8), "float4_e2m1fn_x2": ("F4", 1),
    "complex32": (None, 4), "chalf": (None, 4),
    "complex128": (None, 16), "cdouble": (None, 16),
    "qint8": (None, 1), "quint8": (None, 1), "qint32": (None, 4), "quint4x2": (None, 1),
    "quint2x4": (None, 1),
}

# typed storage class name -> torch dtype name of its elements
STORAGE_TYPES: dict[str, str] = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64", "QInt8Storage": "qint8", "QUInt8Storage": "quint8",
    "QInt32Storage": "qint32", "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
    "UntypedStorage": "uint8",
}

# modules a storage type may come from (a user's --allow-global could admit others: not storages)
STORAGE_MODULES = frozenset({"torch", "torch.storage"})


TORCH_UTILS = "torch._utils"  # where the tensor rebuild functions live
_U = TORCH_UTILS
CALLABLES: frozenset[tuple[str, str]] = frozenset({
    ("collections", "OrderedDict"),
    (_U, "_rebuild_tensor"), (_U, "_rebuild_tensor_v2"), (_U, "_rebuild_tensor_v3"),
    (_U, "_rebuild_parameter"), (_U, "_rebuild_parameter_with_state"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch", "Size"), ("_codecs", "encode"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytearray"),
    # protocol-2 pickles written by Python 3 spell builtins the Python 2 way
    ("__builtin__", "set"), ("__builtin__", "frozenset"), ("__builtin__", "bytearray"),
})
# The types _rebuild_from_type_v2 may name: a plain tensor or a parameter, nothing else.
TENSOR_TYPES: frozenset[tuple[str, str]] = frozenset({("torch", "Tensor"), ("torch.nn.parameter", "Parameter")})
VALUE_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {("torch", n) for n in STORAGE_TYPES} | {("torch.storage", "UntypedStorage")}
    | {("torch", n) for n in TORCH_DTYPES} | TENSOR_TYPES
)

# Tensors torch pickles through rebuild functions outside the allowlist: refused with what
# they are and what to save instead, never with an --allow-global hint (a placeholder would
# leave the tensor out).
_SPARSE = ("a sparse tensor, which packer does not convert: safetensors stores dense arrays only, and "
           "densifying here could multiply its size unseen; save tensor.to_dense() instead (or keep "
           "the indices and values as two dense tensors)")
_QUANTIZED = ("a quantized tensor (qint8/quint8/qint32), which packer does not convert: safetensors has no "
              "dtype that carries a scale and zero point; save tensor.dequantize(), or int_repr() with "
              "q_scale() and q_zero_point() as plain tensors")
_NESTED = ("a nested (ragged) tensor, which packer does not convert: safetensors stores rectangular arrays "
           "only; save its components (tensor.unbind()) as separate tensors")
UNCONVERTED: dict[tuple[str, str], str] = {
    **{(_U, n): _SPARSE for n in ("_rebuild_sparse_tensor", "_rebuild_sparse_csr_tensor")},
    **{("torch", n): _SPARSE for n in ("sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc")},
    ("torch.serialization", "_get_layout"): _SPARSE,
    (_U, "_rebuild_qtensor"): _QUANTIZED,
    **{("torch", n): _QUANTIZED for n in ("per_tensor_affine", "per_channel_affine",
                                           "per_channel_affine_float_qparams")},
    (_U, "_rebuild_nested_tensor"): _NESTED,
}
