"""Read any supported checkpoint into tensor records; select a container; inspect.

The format is detected from content, not from the file name. Pickle formats yield a tree of
plain containers with :class:`TensorRef` leaves; here a flat dict of tensors is chosen from
it (``key`` selects a nested one) and each tensor is checked against its storage in exact
integer arithmetic before it becomes a :class:`TensorRecord`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from packer.checkpoint.dcp import read_dcp
from packer.checkpoint.dcp_meta import metadata_of
from packer.checkpoint.guidance import module_refusal
from packer.checkpoint.legacy import load_legacy
from packer.checkpoint.lightning import lightning_recipe
from packer.checkpoint.pickle_vm import policy_for
from packer.checkpoint.placeholders import find_placeholders, type_name
from packer.checkpoint.records import CheckpointContents, TensorRecord, listing
from packer.checkpoint.safetensors_in import looks_like_safetensors, read_safetensors
from packer.checkpoint.torch_zip import load_torch_zip
from packer.checkpoint.training import refusal as training_refusal
from packer.checkpoint.tree import TensorRef, children, named_walk, tensor_counts
from packer.checkpoint.views import make_record
from packer.errors import CheckpointError
from packer.reading import open_regular
from packer.util.formats import HEAD_BYTES, foreign_advice


def _detect(f: BinaryIO, path: Path, size: int) -> str:
    head = f.read(16)
    if head[:4] == b"PK\x03\x04":
        return "torch-zip"
    if looks_like_safetensors(head):
        return "safetensors"
    if head[:1] == b"\x80" or head[:1] == b"L":
        return "torch-legacy"
    f.seek(max(0, size - 22))
    if f.read(4) == b"PK\x05\x06":
        return "torch-zip"  # the zip parser names what precedes the archive
    if size >= 262:
        f.seek(257)
        if f.read(5) == b"ustar":
            raise CheckpointError(f"{path}: tar-based torch checkpoint (torch < 0.4) not supported")
    raise CheckpointError(f"{path}: not a torch zip, legacy torch or safetensors file (first bytes {head[:8]!r})")


def _open(path: Path, verify_crc: bool, allow_globals: Sequence[str] = (),
          region: tuple[int, int] | None = None) -> tuple[str, object]:
    """Return (format, root object) or (format, CheckpointContents) for safetensors; with
    ``region`` (offset, size), the safetensors file held at that place of ``path`` (a layer blob)."""
    try:
        f = open_regular(path, CheckpointError)  # a FIFO or device is refused, never waited on
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open: {e.strerror or e}") from e
    with f:
        size = os.fstat(f.fileno()).st_size
        if region is not None:
            offset, held = region
            if offset + held > size:
                raise CheckpointError(f"{path}: {size} bytes, too short for {held} bytes at offset {offset}")
            return "safetensors", read_safetensors(f, path, held, offset=offset)
        head = f.read(HEAD_BYTES)
        if what := foreign_advice(path, head):  # the answer build, convert and inspect all give
            raise CheckpointError(f"{path}: {what}")
        f.seek(0)
        fmt = _detect(f, path, size)
        if fmt == "safetensors":
            return fmt, read_safetensors(f, path, size)
        policy = policy_for(allow_globals)
        if fmt == "torch-zip":
            return fmt, load_torch_zip(f, path, size, verify_crc=verify_crc, policy=policy)
        return fmt, load_legacy(f, path, size, policy=policy)


def _resolve(node: object, dotted: str) -> tuple[object] | None:
    kids = children(node)
    if kids is None:
        return None
    names = dict(kids)
    if dotted in names:
        return (names[dotted],)
    for i, ch in enumerate(dotted):
        if ch == "." and dotted[:i] in names:
            found = _resolve(names[dotted[:i]], dotted[i + 1 :])
            if found is not None:
                return found
    return None


def _choose_key_error(path: Path, key: str | None, nested: list[tuple[str, int]]) -> CheckpointError:
    where = f"{path}: " if key is None else f"{path}: key {key}: "
    prefix = "" if key is None else f"{key}."
    listed = ", ".join(f"{prefix}{n} ({c} tensor{'s' if c != 1 else ''})" for n, c in nested[:20])
    more = f", and {len(nested) - 20} more" if len(nested) > 20 else ""
    return CheckpointError(f"{where}not a flat tensor dict; choose a key: {listed}{more}")


def select(path: Path, root: object, key: str | None) -> tuple[tuple[TensorRecord, ...], tuple[str, ...]]:
    """Pick the flat tensor dict (the root, or ``key``'s) and build its records.

    Args:
        path: the file, for messages.
        root: the unpickled tree.
        key: None for the root, else a dotted path such as ``state_dict`` or ``model.ema``;
            a key that itself contains dots is matched whole first.

    Returns:
        The records in the dict's order and the names of skipped non-tensor entries.

    Raises:
        CheckpointError: key not found, not a dict, or not flat (the message lists keys).
    """
    refusal = module_refusal(str(path), root if key is None else None)
    if refusal is not None:  # the user allowed its classes: still no state dict to convert
        raise CheckpointError(refusal)
    node = root
    if key is not None:
        found = _resolve(root, key)
        if found is None:
            top = ", ".join(n for n, _ in (children(root) or [])[:20])
            raise CheckpointError(f"{path}: key {key}: not found; top-level entries: {top or 'none'}")
        node = found[0]
        refusal = module_refusal(f"{path}: key {key}", node)
        if refusal is not None:
            raise CheckpointError(refusal)
    kids = children(node)
    if kids is None:
        kind = type_name(node)  # a placeholder is named by the class the pickle gave it
        what = "a single tensor" if isinstance(node, TensorRef) else \
            f"one {kind} object (no model weights)" if kind else type(node).__name__
        where = "top level" if key is None else f"key {key}"
        raise CheckpointError(f"{path}: {where}: holds {what}, not a dict of tensors")
    counts = tensor_counts(node)
    nested = [(n, counts.get(id(v), 0)) for n, v in kids if isinstance(v, dict | list | tuple)]
    nested = [(n, c) for n, c in nested if c]
    if nested and key is None and (recipe := lightning_recipe(root)) is not None:
        raise CheckpointError(f"{path}: {recipe.describe()}")  # the recipe, not a choice of optimizer keys
    if nested:
        raise _choose_key_error(path, key, nested)
    records, skipped, seen = [], [], set()
    for name, value in kids:
        if name in seen:
            raise CheckpointError(f"{path}: entry {name}: two keys with the same name")
        seen.add(name)
        if isinstance(value, TensorRef):
            records.append(make_record(path, name, value))
        else:
            skipped.append(name)
    return tuple(records), tuple(skipped)


def _notes(path: Path, found: Sequence[tuple[str, str]],
           tensors: Sequence[tuple[str, TensorRef]]) -> tuple[str, ...]:
    notes = []
    if found:
        notes.append(f"left as inert placeholders (not converted): {listing([f'{n} ({t})' for n, t in found])}")
    dropped = [f"{n} ({', '.join(ref.dropped)})" for n, ref in tensors if ref.dropped]
    if dropped:
        notes.append(f"Python attributes dropped from tensors (the tensors are kept): {listing(dropped)}")
    return tuple(notes)


def read_checkpoint(path: Path, *, key: str | None = None, verify_crc: bool = False,
                    allow_globals: Sequence[str] = ()) -> CheckpointContents:
    """Read a checkpoint's tensor records without executing or importing anything.

    Only the pickle and headers are read (storage bytes are not touched unless
    ``verify_crc``), so this costs O(metadata).

    Args:
        path: a torch zip, legacy torch or safetensors file (detected from content), or a
            ``torch.distributed.checkpoint`` folder (its ``.metadata`` or a ``.distcp`` file).
        key: dotted path of the nested dict to use (e.g. ``state_dict``); pickle and DCP only.
        verify_crc: for torch zips, also check every storage's CRC-32 (reads all bytes).
        allow_globals: ``module.Name`` patterns (fnmatch) of the user's plain-data classes,
            read as inert placeholders beside the built-in list (never imported or called).

    Returns:
        The records (name, dtype code, shape, stride, storage byte range, offset), the
        names of skipped non-tensor entries, with ``key`` the top-level entries beside it
        (optimizer state, counters...), which are not converted, and notes naming the
        placeholders left out and the tensor attributes dropped.

    Raises:
        UnsafeInputError: the file asks for code to run (a global outside the allowlist...).
        CheckpointError: malformed input, a lying record, a complex dtype, a bad key.
    """
    path = Path(path)
    if (meta := metadata_of(path)) is not None:  # a torch.distributed.checkpoint folder or one of its files
        return read_dcp(meta, key=key)
    if (said := training_refusal(str(path), path.name)) is not None:  # never offered as weights
        raise CheckpointError(said)
    fmt, loaded = _open(path, verify_crc, allow_globals)
    if isinstance(loaded, CheckpointContents):
        if key is not None:
            raise CheckpointError(f"{path}: key {key}: safetensors files have no nested dicts")
        return loaded
    tensors, skipped = select(path, loaded, key)
    left_out = () if key is None else tuple(
        n for n, _ in children(loaded) or [] if n != key and not key.startswith(f"{n}.")
    )
    node = loaded if key is None else (_resolve(loaded, key) or (None,))[0]
    refs = [(n, v) for n, v in children(node) or [] if isinstance(v, TensorRef)]
    found = find_placeholders(loaded, where=path)
    under = f"{key}." if key else ""  # skipped names are relative to the key's dict
    return CheckpointContents(path, fmt, tensors, skipped, left_out=left_out, notes=_notes(path, found, refs),
                              placeholders=tuple(n[len(under):] for n, _ in found if n.startswith(under)))


def walk(root: object, where: object) -> tuple[list[tuple[str, TensorRef]], list[str], list[tuple[str, int]]]:
    """All tensors and non-tensor leaves under dotted names, and containers with tensors.

    Each container is expanded once (the first path that reaches it), iteratively; only
    containers holding tensors are expanded. Linear in the tree, capped as
    :func:`packer.checkpoint.tree.named_walk` (``where`` names the file in its errors).
    """
    tensors: list[tuple[str, TensorRef]] = []
    leaves: list[str] = []
    containers: list[tuple[str, int]] = []
    counts = tensor_counts(root)
    for name, node, first in named_walk(root, lambda n: n is root or counts.get(id(n), 0) > 0, where=where):
        if isinstance(node, TensorRef):
            tensors.append((name, node))
        elif not isinstance(node, dict | list | tuple):  # what children() expands
            leaves.append(name)
        elif not first or not name:
            continue
        elif counts.get(id(node), 0):
            containers.append((name, counts[id(node)]))
        else:
            leaves.append(name)
    return tensors, leaves, containers
