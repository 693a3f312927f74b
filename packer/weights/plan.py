"""Plan a conversion: output names, exact-alias dedupe, casts, shards and headers.

:func:`plan_weights` is pure: it reads tensor records, never files, and returns a frozen
:class:`WeightsPlan` that fixes every output byte except the tensor data itself (headers,
offsets, shard names, the index). The writer only has to move bytes where the plan says.
"""

from __future__ import annotations

import heapq
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from packer.checkpoint.records import (
    DTYPE_SIZES,
    PACKED,
    TORCH_SHAPES_KEY,
    CheckpointContents,
    StorageRange,
    TensorRecord,
    stored_shape,
    torch_shape,
)
from packer.errors import WeightsError
from packer.recipe import WeightsConfig
from packer.util.formats import CAST_DTYPES
from packer.util.fsutil import canonical_json
from packer.weights.metadata import ALIASES_KEY, carried_metadata, utf8_ok
from packer.weights.ties import TieConfig, split_group

ALIGN = 64  # bytes: CPU kernels (oneDNN) take another, not bitwise equal, path below it
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
FLOAT_CODES = frozenset(CAST_DTYPES.values())


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor: its name, the record it comes from and where its bytes go."""

    name: str
    record: TensorRecord
    dtype: str  # output dtype code; differs from record.dtype when cast
    begin: int  # data offsets inside the shard's data section
    end: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape safetensors records (packed float4 counts single values)."""
        return stored_shape(self.dtype, self.record.shape)

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """The shape of the torch tensor (what a loader must give back)."""
        return self.record.shape

    @property
    def shape_recorded(self) -> bool:
        """True when the stored shape alone cannot give the torch shape back (0-d float4)."""
        return self.dtype in PACKED and torch_shape(self.dtype, self.shape) != self.torch_shape

    @property
    def cast(self) -> bool:
        return self.dtype != self.record.dtype

    @property
    def contiguous(self) -> bool:
        return is_contiguous(self.record)

    @property
    def source_offset(self) -> int:
        """Byte offset of the first element in the input file."""
        r = self.record
        return r.storage.offset + r.storage_offset * DTYPE_SIZES[r.dtype]


@dataclass(frozen=True)
class ShardPlan:
    """One output file: its name, the exact header bytes and its tensors in file order."""

    filename: str
    header: bytes  # 8-byte little-endian length + padded JSON
    tensors: tuple[PlannedTensor, ...]

    @property
    def data_size(self) -> int:
        return self.tensors[-1].end if self.tensors else 0

    @property
    def size(self) -> int:
        return len(self.header) + self.data_size


@dataclass(frozen=True)
class WeightsPlan:
    """The whole output: shards, the index (None for one file) and the alias map."""

    shards: tuple[ShardPlan, ...]
    index: bytes | None
    aliases: tuple[tuple[str, str], ...]  # (removed alias, kept name), sorted
    total_size: int
    metadata: tuple[tuple[str, str], ...] = ()  # the source's __metadata__ every shard carries

    @cached_property
    def tensors(self) -> dict[str, tuple[str, PlannedTensor]]:
        """Output name -> (shard filename, tensor)."""
        return {t.name: (s.filename, t) for s in self.shards for t in s.tensors}

    def section(self, prefix: str = "") -> dict[str, Any]:
        """The manifest section's file and tensor parts, paths prefixed with ``prefix``."""
        return {
            "files": [prefix + s.filename for s in self.shards],
            "index": prefix + INDEX_NAME if self.index is not None else None,
            "total_size": self.total_size,
            "tensors": {
                name: {"file": prefix + f, "dtype": t.dtype, "shape": list(t.shape),
                       "data_offsets": [t.begin, t.end],
                       **({"torch_shape": list(t.torch_shape)} if t.dtype in PACKED else {})}
                for name, (f, t) in sorted(self.tensors.items())
            },
            "aliases": dict(self.aliases),
        }


def is_contiguous(r: TensorRecord) -> bool:
    """True when the record's elements lie in row-major order with no gaps."""
    if 0 in r.shape:
        return True
    expected = 1
    for size, stride in zip(reversed(r.shape), reversed(r.stride), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def check_bounds(r: TensorRecord, where: Path | str) -> None:
    """Raise WeightsError unless every element of the view lies inside its storage.

    A view may hold more bytes than its storage (an expanded or overlapping view, stride 0);
    what that can make packer write is bounded for the whole checkpoint by
    :func:`check_expansion`, not per view.
    """
    size = DTYPE_SIZES.get(r.dtype)
    if size is None:
        raise WeightsError(f"{where}: tensor {r.name!r}: dtype {r.dtype} cannot be written")
    if len(r.shape) != len(r.stride) or min((*r.shape, *r.stride, r.storage_offset, 0)) < 0:
        raise WeightsError(f"{where}: tensor {r.name!r}: invalid shape {r.shape}/stride {r.stride}")
    if r.numel == 0:
        return
    last = r.storage_offset + sum((n - 1) * s for n, s in zip(r.shape, r.stride, strict=True))
    if (last + 1) * size > r.storage.nbytes:
        raise WeightsError(
            f"{where}: tensor {r.name!r}: view ends at byte {(last + 1) * size}, past its "
            f"storage {r.storage.key!r} of {r.storage.nbytes} bytes"
        )


EXPANSION_ALLOWANCE = 1 << 30  # bytes any checkpoint may add beyond the multiple of its input


def _storages(r: TensorRecord) -> list[StorageRange]:
    """The storages ``r``'s bytes are read from: its own, or those of the chunks it is assembled
    from (a distributed checkpoint's: the record's own storage then only names the whole)."""
    return [p.record.storage for p in r.pieces] if r.pieces else [r.storage]


def check_expansion(kept: dict[str, TensorRecord], cfg: WeightsConfig) -> None:
    """Raise WeightsError when the views would make packer write more than
    ``cfg.max_expansion`` times the bytes of their storages plus 1 GiB.

    Expanded views (stride 0) and overlapping views are materialized: each element is written.
    That is normal for ``tensor.expand`` at small sizes, but a 16-byte storage can describe
    terabytes, so the total (in input dtypes, after aliases are merged) is bounded before a
    byte is written. The message names the view that expands most and the recipe key.
    """
    storages = {(str(s.path), s.key): s.nbytes for r in kept.values() for s in _storages(r)}
    read, written = sum(storages.values()), sum(r.nbytes for r in kept.values())
    bound = int(cfg.max_expansion * read) + EXPANSION_ALLOWANCE
    if written <= bound:
        return
    name, r = max(kept.items(), key=lambda kv: (kv[1].nbytes - sum(s.nbytes for s in _storages(kv[1])), kv[0]))
    over = f"over the storages of its {len(r.pieces)} chunks, {sum(s.nbytes for s in _storages(r))} bytes" \
        if r.pieces else f"over its storage {r.storage.key!r} of {r.storage.nbytes} bytes"
    raise WeightsError(
        f"{r.storage.path}: tensor {r.name!r} (written as {name!r}): a view of shape {list(r.shape)} "
        f"stride {list(r.stride)} holds {r.nbytes} bytes {over}; with it the output would be "
        f"{written} bytes from {read} bytes of storage, more than weights.max_expansion = "
        f"{cfg.max_expansion:g} times that plus 1 GiB ({bound} bytes). packer writes every element of "
        "an expanded view: if this output size is meant, raise weights.max_expansion in the recipe "
        "(packer convert --max-expansion)"
    )


def map_name(name: str, cfg: WeightsConfig) -> str:
    """Strip each of ``strip_prefixes`` once (in any order), then apply ``renames`` in recipe order.

    Once, not repeatedly: a Lightning module's ``model.`` wraps a model whose own names start with
    ``model.`` (``model.model.embed_tokens.weight``), and only the outer one is the wrapper's.
    A prefix listed twice is stripped twice (``module.module.``)."""
    left = list(cfg.strip_prefixes)
    changed = True
    while changed:
        changed = False
        for i, prefix in enumerate(left):
            if prefix and name.startswith(prefix) and len(name) > len(prefix):
                name, changed = name[len(prefix):], True
                del left[i]
                break
    for rename in cfg.renames:
        name = re.sub(rename.pattern, rename.replace, name)
    return name


def _alias_key(r: TensorRecord) -> tuple[Any, ...]:
    return (str(r.storage.path), r.storage.key, r.storage.offset, r.storage_offset,
            r.shape, r.stride, r.dtype)


def _rename_all(
    contents: Sequence[CheckpointContents], cfg: WeightsConfig
) -> dict[str, TensorRecord]:
    out: dict[str, TensorRecord] = {}
    origin: dict[str, str] = {}
    for c in contents:
        for r in c.tensors:
            check_bounds(r, c.path)
            name = map_name(r.name, cfg)
            here = f"{c.path.name}:{r.name}"
            if not name or name == "__metadata__":
                raise WeightsError(f"{here}: tensor name {name!r} cannot be written to "
                                   "safetensors; rename it with weights.renames")
            if not utf8_ok(name):
                raise WeightsError(f"{here}: tensor name {name!r} is not valid UTF-8 (it holds a lone "
                                   "surrogate), which safetensors cannot store; rename it with weights.renames")
            if name in out:
                raise WeightsError(
                    f"tensor name collision: {origin[name]} and {here} both become {name!r}; "
                    "fix weights.renames / strip_prefixes or select one checkpoint"
                )
            out[name], origin[name] = r, here
    return out


def _dedupe(
    tensors: dict[str, TensorRecord], prefer: Sequence[str], ties: TieConfig
) -> tuple[dict[str, TensorRecord], dict[str, str]]:
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, r in tensors.items():
        # Empty tensors hold no bytes to share; keeping them all is simpler for loaders.
        key = _alias_key(r) if r.numel else ("empty", name)
        groups.setdefault(key, []).append(name)
    kept: dict[str, TensorRecord] = {}
    aliases: dict[str, str] = {}
    for names in groups.values():
        keep, own = split_group(names, prefer, ties)
        for n in (keep, *own):
            kept[n] = tensors[n]
        aliases.update({n: keep for n in names if n != keep and n not in own})
    return kept, aliases


def _out_dtype(r: TensorRecord, cfg: WeightsConfig) -> str:
    if cfg.dtype is None or r.dtype not in FLOAT_CODES:
        return r.dtype
    return CAST_DTYPES[cfg.dtype]


def _split(sizes: dict[str, int], max_shard_size: int) -> list[tuple[str, list[str]]]:
    from huggingface_hub import split_state_dict_into_shards_factory

    if not sizes:
        return [(SINGLE_NAME, [])]
    split = split_state_dict_into_shards_factory(
        sizes, get_storage_size=lambda n: n, filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_size,
    )
    return sorted((f, sorted(names)) for f, names in split.filename_to_tensors.items())


def _header(tensors: Sequence[PlannedTensor], aliases: dict[str, str],
            carried: Sequence[tuple[str, str]] = ()) -> bytes:
    meta = {**dict(carried), "format": "pt"}
    if aliases:
        meta[ALIASES_KEY] = canonical_json(aliases).decode().rstrip("\n")
    recorded = {t.name: list(t.torch_shape) for t in tensors if t.shape_recorded}
    if recorded:
        meta[TORCH_SHAPES_KEY] = canonical_json(recorded).decode().rstrip("\n")
    table: dict[str, Any] = {"__metadata__": meta}
    for t in tensors:
        table[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.begin, t.end]}
    text = json.dumps(table, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    # JSON may be followed by spaces (safetensors pads to 8): pad so data starts ALIGN-aligned,
    # and a mapping's page-aligned start makes every aligned file offset an aligned pointer
    text += b" " * (-(8 + len(text)) % ALIGN)
    return len(text).to_bytes(8, "little") + text


def file_order(names: Sequence[str], sizes: dict[str, int]) -> list[str]:
    """The order of ``names`` in their file that starts as many tensors as it can (the
    largest first) at an ``ALIGN``-byte data offset; safetensors allows no gaps between them.

    Sizes that are a multiple of ``ALIGN`` come first, in the given order, and keep each
    other aligned. The rest follow greedily: at an aligned offset the largest left (its
    copy at load would cost most); at a misaligned one the smallest that ends aligned
    again, else the smallest left. Ties go by name, so the order is deterministic.
    """
    order = [n for n in names if sizes[n] % ALIGN == 0]
    rest = [n for n in names if sizes[n] % ALIGN]
    largest = [(-sizes[n], n) for n in rest]
    smallest = [(sizes[n], n) for n in rest]
    by_residue: dict[int, list[tuple[int, str]]] = {}
    for n in rest:
        by_residue.setdefault(sizes[n] % ALIGN, []).append((sizes[n], n))
    for heap in (largest, smallest, *by_residue.values()):
        heapq.heapify(heap)
    placed: set[str] = set()

    def pop(heap: list[tuple[int, str]]) -> str | None:
        while heap and heap[0][1] in placed:
            heapq.heappop(heap)
        return heapq.heappop(heap)[1] if heap else None

    pos = 0
    while len(placed) < len(rest):
        need = -pos % ALIGN
        name = pop(largest) if not need else pop(by_residue.get(need, [])) or pop(smallest)
        assert name is not None
        placed.add(name)
        order.append(name)
        pos += sizes[name]
    return order


_UNTOLD = TieConfig()


def plan_weights(contents: Sequence[CheckpointContents], cfg: WeightsConfig, *,
                 ties: TieConfig = _UNTOLD) -> WeightsPlan:
    """Plan the safetensors output for the tensors of one or more input files.

    Args:
        contents: what the reader found in each input file (shards in order).
        cfg: names, tie preference, cast dtype and maximum shard size.
        ties: what the model's config.json says about tied weights (see :mod:`.ties`).

    Returns:
        The frozen plan: shards with exact headers, the index bytes when sharded, aliases.

    Raises:
        WeightsError: out-of-bounds views, views that expand past ``cfg.max_expansion``,
            unsupported dtypes, name collisions after renaming, source metadata that cannot be
            carried (see :func:`packer.weights.metadata.carried_metadata`).
    """
    kept, aliases = _dedupe(_rename_all(contents, cfg), cfg.tie_prefer, ties)
    check_expansion(kept, cfg)
    carried = carried_metadata(contents, lambda n: map_name(n, cfg), list(kept))
    aliases.update(carried.aliases)
    dtypes = {n: _out_dtype(r, cfg) for n, r in kept.items()}
    sizes = {n: kept[n].numel * DTYPE_SIZES[dtypes[n]] for n in sorted(kept)}
    shards = []
    for filename, names in _split(sizes, cfg.max_shard_size):
        planned, pos = [], 0
        for n in file_order(names, sizes):
            planned.append(PlannedTensor(n, kept[n], dtypes[n], pos, pos + sizes[n]))
            pos += sizes[n]
        mine = {a: k for a, k in aliases.items() if k in names}
        shards.append(ShardPlan(filename, _header(planned, mine, carried.keys), tuple(planned)))
    total = sum(sizes.values())
    index = None
    if len(shards) > 1:
        meta: dict[str, Any] = {"total_size": total}
        if aliases:
            meta[ALIASES_KEY] = dict(sorted(aliases.items()))
        weight_map = {t.name: s.filename for s in shards for t in s.tensors}
        index = canonical_json({"metadata": meta, "weight_map": dict(sorted(weight_map.items()))})
    return WeightsPlan(tuple(shards), index, tuple(sorted(aliases.items())), total, carried.keys)
