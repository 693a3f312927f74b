"""A ``torch.distributed.checkpoint`` folder's ``.metadata``, read by the restricted pickle VM.

DCP (what FSDP2, torchtitan, torchtune's distributed recipes and accelerate's sharded FSDP state
write) keeps one pickle of plain dataclasses beside ``__<rank>_<n>.distcp`` data files: per
tensor its dtype, size and chunks (the shards each rank wrote), and per chunk the file, offset
and length of its bytes. Those dataclasses are read here as inert placeholders from a list of
their own (never imported, never called, and admitted for this file only); what they hold is
checked field by field into :class:`DcpMeta`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from packer.checkpoint.allowlist import CALLABLES, TORCH_DTYPES, VALUE_GLOBALS
from packer.checkpoint.pickle_vm import run_pickle
from packer.checkpoint.placeholders import PLACEHOLDER_TYPES, GlobalPolicy, Placeholder
from packer.checkpoint.tree import Global, short
from packer.errors import CheckpointError
from packer.reading import open_regular

METADATA = ".metadata"
DATA_SUFFIX = ".distcp"
MAX_METADATA_BYTES = 256 << 20  # a 70B model's metadata over 1024 ranks is tens of MB
_MOD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
# DCP's plain dataclasses and the two small encodings inside TensorProperties (the layout by
# name, the memory format by number): placeholders in a .metadata pickle, nowhere else
DCP_TYPES: frozenset[tuple[str, str]] = frozenset(
    {(_MOD, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                         "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    | {(_FS, "_StorageInfo"), ("torch.serialization", "_get_layout")}
)
DCP_POLICY = GlobalPolicy(callables=CALLABLES, values=VALUE_GLOBALS, placeholder_types=PLACEHOLDER_TYPES | DCP_TYPES)


@dataclass(frozen=True)
class Chunk:
    """One shard of a tensor: its place in the whole and where its saved bytes lie."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the folder, checked as a plain name
    offset: int
    length: int


@dataclass(frozen=True)
class DcpTensor:
    """One tensor of the checkpoint: its path in the saved state dict, dtype, size and chunks."""

    fqn: str
    path: tuple[str, ...]  # the nested keys it was saved under (("model", "0.weight"))
    dtype: str  # torch dtype name
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class DcpMeta:
    """What a ``.metadata`` says: the tensors and the non-tensor entries (by saved path)."""

    tensors: tuple[DcpTensor, ...]
    others: tuple[tuple[str, ...], ...]


def metadata_of(path: Path) -> Path | None:
    """The ``.metadata`` of the DCP checkpoint ``path`` belongs to: the folder itself, its
    ``.metadata`` or one of its ``.distcp`` files (when a ``.metadata`` lies beside it); else None."""
    folder = path if path.is_dir() else path.parent
    if path.is_dir() or path.name == METADATA or path.name.endswith(DATA_SUFFIX):
        meta = folder / METADATA
        if meta.is_file() and (path.name == METADATA or any(folder.glob(f"*{DATA_SUFFIX}"))):
            return meta
    return None


def _fail(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: torch.distributed.checkpoint metadata: {what}")


def _state(path: Path, value: object, name: str) -> dict[object, object]:
    if not isinstance(value, Placeholder) or value.type.key != (_FS if name == "_StorageInfo" else _MOD, name) \
            or not isinstance(value.state, dict):
        raise _fail(path, f"expected a {name}, found {short(value)}")
    return value.state


def _ints(path: Path, value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or len(value) > 64 or any(type(v) is not int or v < 0 for v in value):
        raise _fail(path, f"{what} is not a tuple of sizes: {short(value)}")
    return value


def _dtype(path: Path, fqn: str, props: object) -> str:
    """The dtype name of a TensorProperties (state a tuple, or a dict in older torch); strided only."""
    if not isinstance(props, Placeholder) or props.type.key != (_MOD, "TensorProperties"):
        raise _fail(path, f"{fqn}: properties are {short(props)}")
    state = props.state
    dtype, layout = (state[0], state[1]) if isinstance(state, tuple) and len(state) >= 2 else \
        (state.get("dtype"), state.get("layout")) if isinstance(state, dict) else (None, None)
    if not isinstance(dtype, Global) or dtype.module != "torch" or dtype.name not in TORCH_DTYPES:
        raise _fail(path, f"{fqn}: dtype {short(dtype)} is not a torch dtype")
    strided = layout is None or (isinstance(layout, Placeholder) and layout.args == ("torch.strided",))
    if not strided:
        raise CheckpointError(f"{path}: tensor {fqn}: layout {short(getattr(layout, 'args', layout))} is not "
                              "strided (a sparse tensor); packer converts dense tensors only")
    return dtype.name


def _storage_map(path: Path, raw: object) -> dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]]:
    if not isinstance(raw, dict):
        raise _fail(path, "storage_data is not a dict")
    out: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    for index, info in raw.items():
        idx, st = _state(path, index, "MetadataIndex"), _state(path, info, "_StorageInfo")
        fqn, offset = idx.get("fqn"), idx.get("offset")
        rel, at, length = st.get("relative_path"), st.get("offset"), st.get("length")
        if not isinstance(fqn, str) or not isinstance(rel, str) or type(at) is not int or type(length) is not int \
                or at < 0 or length < 0:
            raise _fail(path, f"malformed storage entry {short(idx)} -> {short(st)}")
        if st.get("transform_descriptors"):
            raise CheckpointError(
                f"{path}: tensor {fqn}: saved through DCP extensions {short(st['transform_descriptors'])} "
                "(compression), which packer does not read; save again without extensions, or load it "
                "with torch.distributed.checkpoint and save the model's state dict with safetensors")
        key = (fqn, None if offset is None else _ints(path, offset, f"{fqn}: index offset"))
        out[key] = (rel, at, length)
    return out


def _paths(planner: object) -> dict[str, tuple[str, ...]]:
    """fqn -> the nested keys it was saved under (DCP's planner_data), where given as plain strings/ints."""
    out: dict[str, tuple[str, ...]] = {}
    if isinstance(planner, dict):
        for fqn, keys in planner.items():
            if isinstance(fqn, str) and isinstance(keys, tuple) and keys and \
                    all(isinstance(k, str | int) and not isinstance(k, bool) for k in keys):
                out[fqn] = tuple(str(k) for k in keys)
    return out


def _tensor(path: Path, fqn: str, state: dict[object, object], keys: tuple[str, ...],
            storage: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]]) -> DcpTensor:
    dtype = _dtype(path, fqn, state.get("properties"))
    size = _ints(path, state.get("size"), f"{fqn}: size")
    raw_chunks = state.get("chunks")
    if not isinstance(raw_chunks, list) or not raw_chunks:
        raise _fail(path, f"{fqn}: no chunks")
    chunks = []
    for raw in raw_chunks:
        cs = _state(path, raw, "ChunkStorageMetadata")
        offsets = _ints(path, cs.get("offsets"), f"{fqn}: chunk offsets")
        sizes = _ints(path, cs.get("sizes"), f"{fqn}: chunk sizes")
        if len(offsets) != len(size) or len(sizes) != len(size) or \
                any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)):
            raise _fail(path, f"{fqn}: chunk at {list(offsets)} of {list(sizes)} outside the tensor's {list(size)}")
        place = storage.get((fqn, offsets))
        if place is None:
            raise _fail(path, f"{fqn}: the chunk at {list(offsets)} has no storage entry")
        chunks.append(Chunk(offsets, sizes, *place))
    return DcpTensor(fqn, keys, dtype, size, tuple(chunks))


def read_metadata(path: Path) -> DcpMeta:
    """Run ``path`` (a DCP ``.metadata``) through the restricted VM and check what it holds.

    Raises:
        UnsafeInputError: a global outside the DCP and plain-data lists.
        CheckpointError: unreadable, over the cap, or not DCP metadata.
    """
    try:
        with open_regular(path, CheckpointError) as f:
            if os.fstat(f.fileno()).st_size > MAX_METADATA_BYTES:
                raise _fail(path, f"over the cap of {MAX_METADATA_BYTES} bytes")
            data = f.read(MAX_METADATA_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from e
    root, _ = run_pickle(data, where=str(path), policy=DCP_POLICY)
    meta = _state(path, root, "Metadata")
    sd_meta = meta.get("state_dict_metadata")
    if not isinstance(sd_meta, dict):
        raise _fail(path, "state_dict_metadata is not a dict")
    storage = _storage_map(path, meta.get("storage_data"))
    keys = _paths(meta.get("planner_data"))
    tensors, others = [], []
    for fqn, entry in sd_meta.items():
        if not isinstance(fqn, str):
            raise _fail(path, f"a key is {short(fqn)}, not a name")
        saved = keys.get(fqn) or (fqn,)
        if isinstance(entry, Placeholder) and entry.type.key == (_MOD, "BytesStorageMetadata"):
            others.append(saved)
            continue
        tensors.append(_tensor(path, fqn, _state(path, entry, "TensorStorageMetadata"), saved, storage))
    return DcpMeta(tuple(tensors), tuple(others))
