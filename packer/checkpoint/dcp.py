"""A ``torch.distributed.checkpoint`` folder as tensor records: each chunk located, shards assembled.

Each chunk of a tensor is a small ``torch.save`` archive at the offset the metadata gives inside
a ``.distcp`` file; it is parsed in place (a window on the file, :func:`load_torch_zip`) into a
record whose storage range is absolute in that file. A tensor saved in one chunk is that record;
one saved in several (FSDP2 and DTensor shards) becomes a record with :class:`Piece` s that the
writer assembles, streamed, in row blocks. The pieces must tile the tensor exactly.

Which tensors are the model: a DCP folder holds the state dict the training loop saved, most
often ``{"model": ..., "optimizer": ...}`` flattened into dotted names. As for nested pickles,
``key`` names the part to convert; without one, a part named like the model (``model``,
``state_dict``...) is taken, or the unnamed root when every other part is training state
(``optimizer``, ``lr_scheduler``...), and what is left out is named in a note.
"""

from __future__ import annotations

import os
from array import array
from bisect import bisect_left
from dataclasses import replace
from itertools import product
from math import prod
from pathlib import Path
from typing import BinaryIO, cast

from packer.checkpoint.dcp_meta import DcpMeta, DcpTensor, read_metadata
from packer.checkpoint.records import CheckpointContents, Piece, StorageRange, TensorRecord, listing
from packer.checkpoint.torch_zip import load_torch_zip
from packer.checkpoint.tree import TensorRef
from packer.checkpoint.views import make_record
from packer.errors import CheckpointError
from packer.reading import open_regular
from packer.util.idents import check_rel_name, confined, link_roots, shown

# parts of a saved training state that hold the model (first found wins) and parts that never do
MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module", "ema", "net", "weights", "params")
TRAINING_KEYS = frozenset({"optimizer", "optim", "optimizers", "optimizer_state", "lr_scheduler", "scheduler",
                           "lr_schedulers", "dataloader", "train_state", "trainer_state", "rng", "rng_state",
                           "step", "epoch", "extra_state", "scaler", "grad_scaler"})
MAX_PIECES = 65536  # chunks of one tensor (ranks)
MAX_CELLS = 4 * MAX_PIECES  # blocks the chunks' edges cut one tensor into (the overlap check's work)


class _Window:
    """``length`` bytes of an open file at ``base``, read as a file of their own."""

    def __init__(self, f: BinaryIO, base: int, length: int) -> None:
        self.f, self.base, self.length, self.pos = f, base, length, 0

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        left = max(0, self.length - self.pos)
        n = left if n < 0 else min(n, left)
        if n == 0:  # past the window's end (a position from the input may be any number): no seek
            return b""
        self.f.seek(self.base + self.pos)
        data = self.f.read(n)
        self.pos += len(data)
        return data


class _Files:
    """The .distcp files of one folder, each opened once (regular files only, inside the folder
    once links are followed) with its size, and the byte ranges its chunks were read from."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.roots = folder, link_roots(folder)
        self.open: dict[str, tuple[BinaryIO, int]] = {}
        self.spans: list[tuple[str, int, int, str]] = []  # (file, start, end, tensor) of each chunk read

    def get(self, rel: str, where: str) -> tuple[Path, BinaryIO, int]:
        path = self.folder / check_rel_name(rel, where=where, error=CheckpointError)
        if rel not in self.open:
            # a link (or a linked folder on the way) may lead only where the folder's own files
            # may: a hub cache snapshot's blobs; the resolved path is what is opened
            real = confined(path, self.roots, error=CheckpointError, what=f"{shown(rel)} named in {where}",
                            hint="copy the file into the checkpoint's folder")
            try:
                f: BinaryIO = open_regular(real, CheckpointError)
            except OSError as e:
                raise CheckpointError(f"{where}: {path.name}: cannot open: {e.strerror or e}") from e
            self.open[rel] = (f, os.fstat(f.fileno()).st_size)
        f, size = self.open[rel]
        return path, f, size

    def claim(self, rel: str, start: int, length: int, fqn: str) -> None:
        """Note that a chunk of tensor ``fqn`` was read from bytes ``[start, start + length)`` of ``rel``."""
        if length:
            self.spans.append((rel, start, start + length, fqn))

    def check_disjoint(self) -> None:
        """Every chunk read has bytes of its own: DCP writes each chunk once, so two chunks whose
        bytes overlap (one tensor's twice, or another's inside it) are not a checkpoint DCP wrote,
        and would come out as silent copies of each other.

        Raises:
            CheckpointError: two chunks' byte ranges overlap; names the file, both tensors and ranges.
        """
        spans = sorted(self.spans)
        for (rel, a0, a1, fa), (rel_b, b0, b1, fb) in zip(spans, spans[1:], strict=False):
            if rel == rel_b and b0 < a1:
                raise CheckpointError(
                    f"{self.folder / rel}: the chunks of tensor {shown(fa)} (bytes [{a0}, {a1})) and of tensor "
                    f"{shown(fb)} (bytes [{b0}, {b1})) overlap; each chunk of a checkpoint has bytes of its own")

    def close(self) -> None:
        for f, _ in self.open.values():
            f.close()


def _chunk_record(files: _Files, meta_path: Path, t: DcpTensor, index: int) -> TensorRecord:
    c = t.chunks[index]
    where = f"{meta_path}: tensor {t.fqn}"
    path, f, size = files.get(c.file, where)
    if c.offset + c.length > size:
        raise CheckpointError(f"{path}: tensor {t.fqn}: {c.length} bytes at offset {c.offset} run past the "
                              f"file's {size} bytes (truncated?)")
    files.claim(c.file, c.offset, c.length, t.fqn)
    root = load_torch_zip(cast(BinaryIO, _Window(f, c.offset, c.length)), path, c.length)
    if not isinstance(root, TensorRef):
        raise CheckpointError(f"{path}: tensor {t.fqn}: the chunk at byte {c.offset} holds no tensor")
    rng = root.storage.range
    # the range is absolute in the .distcp file, its key unique across the folder's chunks
    root.storage.range = StorageRange(f"{c.file}@{c.offset}/{rng.key}", path, c.offset + rng.offset, rng.nbytes)
    rec = make_record(path, t.fqn, root)
    if rec.shape != c.sizes or root.dtype != t.dtype:
        raise CheckpointError(f"{path}: tensor {t.fqn}: the chunk at byte {c.offset} holds {root.dtype} "
                              f"{list(rec.shape)}, the metadata says {t.dtype} {list(c.sizes)}")
    return rec


def _check_tiling(where: str, t: DcpTensor) -> None:
    """The chunks cover the tensor exactly: volumes add up and no two overlap.

    The chunks lie inside the tensor (:func:`~packer.checkpoint.dcp_meta.read_metadata`), so
    with volumes that add up they tile it exactly when no two overlap. Every dimension is cut
    where a chunk starts or ends; a chunk then covers whole cells of that grid, each cell at
    most once. DTensor's placements shard a tensor on a grid, so the cells are about as many as
    the chunks; the work is linear in them, never pairwise (:data:`MAX_CELLS` bounds it).

    Raises:
        CheckpointError: too many chunks or cells, volumes that do not add up, or two chunks
            that overlap (named by their offsets).
    """
    if len(t.chunks) > MAX_PIECES:
        raise CheckpointError(f"{where}: {len(t.chunks)} chunks (at most {MAX_PIECES})")
    real = [c for c in t.chunks if prod(c.sizes)]
    if sum(prod(c.sizes) for c in real) != prod(t.size):
        raise CheckpointError(f"{where}: its chunks do not cover its {list(t.size)} elements exactly")
    cuts = [sorted({0, d, *(c.offsets[k] for c in real), *(c.offsets[k] + c.sizes[k] for c in real)})
            for k, d in enumerate(t.size)]
    cells = prod(len(edges) - 1 for edges in cuts)
    if cells > MAX_CELLS:
        raise CheckpointError(f"{where}: its {len(real)} chunks cut it into {cells} blocks (at most {MAX_CELLS}): "
                              "not the grid a sharded tensor's chunks make")
    steps = [prod(len(edges) - 1 for edges in cuts[k + 1:]) for k in range(len(cuts))]
    owner = array("l", [-1]) * cells
    for i, c in enumerate(real):
        spans = [range(bisect_left(edges, o), bisect_left(edges, o + n))
                 for edges, o, n in zip(cuts, c.offsets, c.sizes, strict=True)]
        for cell in product(*spans):
            at = sum(j * step for j, step in zip(cell, steps, strict=True))
            if owner[at] >= 0:
                raise CheckpointError(f"{where}: chunks at {list(real[owner[at]].offsets)} and "
                                      f"{list(c.offsets)} overlap")
            owner[at] = i


def tensor_record(files: _Files, meta_path: Path, t: DcpTensor, name: str) -> TensorRecord:
    """The record of one DCP tensor under ``name``: its one chunk's, or one assembled from pieces.

    Raises:
        CheckpointError: a chunk that is missing, truncated, not what the metadata says, or
            chunks that do not tile the tensor.
    """
    if len(t.chunks) == 1 and t.chunks[0].sizes == t.size:
        return replace(_chunk_record(files, meta_path, t, 0), name=name)
    where = f"{meta_path}: tensor {t.fqn}"
    _check_tiling(where, t)
    pieces = tuple(Piece(c.offsets, _chunk_record(files, meta_path, t, i))
                   for i, c in enumerate(t.chunks) if all(c.sizes))
    first = pieces[0].record if pieces else _chunk_record(files, meta_path, t, 0)
    stride: list[int] = []
    n = 1
    for d in reversed(t.size):
        stride.insert(0, n)
        n *= d
    whole = StorageRange(f"dcp:{t.fqn}", meta_path, 0, n * (first.nbytes // max(first.numel, 1) or 1))
    return TensorRecord(name, first.dtype, t.size, tuple(stride), whole, 0, pieces)


def _part(meta: DcpMeta, key: str | None, path: Path) -> tuple[str | None, list[str]]:
    """The part of the saved state to convert (None: the unnamed root) and the parts left out."""
    counts: dict[str, int] = {}
    for t in meta.tensors:
        if len(t.path) > 1:
            counts[t.path[0]] = counts.get(t.path[0], 0) + 1
    roots = sum(1 for t in meta.tensors if len(t.path) == 1)
    if key is not None:
        if key not in counts:
            listed = ", ".join(f"{k} ({n} tensors)" for k, n in counts.items()) or "none (a flat state dict)"
            raise CheckpointError(f"{path}: key {key}: not a part of this checkpoint; parts: {listed}")
        return key, [k for k in counts if k != key]
    if not counts:
        return None, []
    chosen = next((k for k in MODEL_KEYS if k in counts), None)
    if chosen is not None:
        return chosen, [k for k in counts if k != chosen]
    if all(k in TRAINING_KEYS for k in counts):
        if not roots:
            raise CheckpointError(
                f"{path}: a torch.distributed.checkpoint of training state only ({listing(sorted(counts))}): "
                "it holds no model weights; build the folder the model's state was saved to")
        return None, list(counts)
    listed = ", ".join(f"{k} ({n} tensor{'s' if n != 1 else ''})" for k, n in counts.items())
    raise CheckpointError(f"{path}: a torch.distributed.checkpoint of several parts; choose one with "
                          f"--key (weights.key): {listed}")


def read_dcp(path: Path, *, key: str | None = None) -> CheckpointContents:
    """Read a DCP folder (``path`` is its ``.metadata``) into records, nothing imported or called.

    Args:
        path: the folder's ``.metadata``.
        key: the top-level part of the saved state to convert (``model``); None chooses (module
            docstring).

    Returns:
        The records under their names inside the part, the non-tensor entries as skipped, the
        parts left out (``left_out``) and the ``.distcp`` files read (``data_files``).

    Raises:
        CheckpointError / UnsafeInputError: bad metadata, chunks, or no part to choose.
    """
    meta = read_metadata(path)
    part, others = _part(meta, key, path)
    files = _Files(path.parent)
    try:
        records = []
        for t in meta.tensors:
            inside = t.path[1:] if part is not None and t.path[0] == part and len(t.path) > 1 else None
            if part is None and len(t.path) == 1:
                inside = t.path
            if inside:
                records.append(tensor_record(files, path, t, ".".join(inside)))
        files.check_disjoint()
        data_files = tuple(sorted(path.parent / rel for rel in files.open))
    finally:
        files.close()
    skipped = tuple(".".join(p[1:] if part is not None else p) for p in meta.others
                    if (p[0] == part and len(p) > 1) or (part is None and len(p) == 1))
    # parts beside the chosen one, with or without tensors (an optimizer before its first step)
    # and the tensors and entries saved at the root beside a chosen part (a ``lm_head.weight``
    # next to ``model``): each named, never dropped without a word
    beside = [t.path[0] for t in meta.tensors if part is not None and len(t.path) == 1]
    left = list(dict.fromkeys([*others, *(p[0] for p in meta.others if part is not None and p[0] != part),
                               *beside]))
    training = [k for k in left if k in TRAINING_KEYS]
    notes = [f"torch.distributed.checkpoint: converted the part {part!r}" if part else
             "torch.distributed.checkpoint: converted the saved state dict"]
    if training:
        notes.append(f"left out as training state, not model weights: {listing(training)}")
    return CheckpointContents(path, "torch-dcp", tuple(records), skipped,
                              left_out=tuple(k for k in left if k not in TRAINING_KEYS),
                              notes=tuple(notes), data_files=data_files)


def describe_dcp(path: Path) -> dict[str, object]:
    """``packer inspect`` of a DCP folder: every tensor by its saved name, with its chunks.

    Raises:
        CheckpointError / UnsafeInputError: as :func:`read_dcp`.
    """
    meta = read_metadata(path)
    tensors: list[dict[str, object]] = []
    from packer.checkpoint.allowlist import TORCH_DTYPES

    for t in meta.tensors:
        code, item = TORCH_DTYPES[t.dtype]
        n = 1
        for d in t.size:
            n *= d
        tensors.append({"name": ".".join(t.path), "dtype": code or t.dtype, "shape": list(t.size),
                        "nbytes": n * item, "alias_group": None, "supported": code is not None,
                        "chunks": len(t.chunks)})
    parts: dict[str, int] = {}
    for t in meta.tensors:
        if len(t.path) > 1:
            parts[t.path[0]] = parts.get(t.path[0], 0) + 1
    return {"path": str(path), "format": "torch-dcp", "tensors": tensors, "alias_groups": [],
            "skipped": [".".join(p) for p in meta.others],
            "containers": [{"name": k, "tensors": n} for k, n in parts.items()],
            "metadata": {}, "placeholders": []}
