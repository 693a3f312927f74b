"""``packer inspect``: what a checkpoint holds, as JSON-able data, converting nothing."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from packer.checkpoint.allowlist import TORCH_DTYPES
from packer.checkpoint.dcp import describe_dcp
from packer.checkpoint.dcp_meta import metadata_of
from packer.checkpoint.lightning import lightning_recipe
from packer.checkpoint.placeholders import find_placeholders
from packer.checkpoint.reader import _open, make_record, walk
from packer.checkpoint.records import CheckpointContents, TensorRecord
from packer.checkpoint.training import refusal
from packer.errors import CheckpointError


def _alias_key(r: TensorRecord) -> tuple[object, ...]:
    return (r.storage.path, r.storage.offset, r.storage_offset, r.shape, r.stride, r.dtype)


def _describe(
    records: list[tuple[TensorRecord | None, str, str, tuple[int, ...], int]],
) -> tuple[list[dict[str, object]], list[list[str]]]:
    groups: dict[tuple[object, ...], list[str]] = {}
    for rec, name, *_ in records:
        if rec is not None:
            groups.setdefault(_alias_key(rec), []).append(name)
    alias_groups = [names for names in groups.values() if len(names) > 1]
    group_of = {n: i for i, names in enumerate(alias_groups) for n in names}
    tensors: list[dict[str, object]] = [
        {"name": name, "dtype": dtype, "shape": list(shape), "nbytes": nbytes,
         "alias_group": group_of.get(name)}
        for _, name, dtype, shape, nbytes in records
    ]
    return tensors, alias_groups


def inspect_checkpoint(path: Path, *, allow_globals: Sequence[str] = (),
                       region: tuple[int, int] | None = None) -> dict[str, object]:
    """Describe a checkpoint: tensors, alias groups, non-tensor entries, containers.

    Tensors are listed under their full dotted names from the top of the pickle. A dtype
    safetensors cannot hold (complex...) is listed with its torch name and
    ``"supported": false`` rather than failing.

    Args:
        path: a torch zip, legacy torch or safetensors file.
        allow_globals: the user's plain-data classes (as :func:`read_checkpoint`).
        region: ``(offset, size)``: the safetensors file is those bytes of ``path`` (a build's
            weight file in its layer blob, :func:`packer.manifest.held_in_blob`).

    Returns:
        ``{"path", "format", "tensors": [{name, dtype, shape, nbytes, alias_group}],
        "alias_groups": [[names]], "skipped": [names], "containers": [{name, tensors}],
        "metadata": {...}, "placeholders": [{name, type}]}``, and for a Lightning checkpoint
        ``"hint"`` (the recipe in one sentence), ``"flags"`` (convert's) and ``"training_state"``
        (the top-level entries holding training state, not weights); alias groups are exact
        aliases (same storage, storage offset, shape, stride and dtype); a tensor whose
        Python attributes would be dropped lists them as ``dropped_attributes``.

    Raises:
        UnsafeInputError / CheckpointError: as :func:`read_checkpoint`.
    """
    path = Path(path)
    if region is None and (meta := metadata_of(path)) is not None:
        return describe_dcp(meta)
    if region is None and (said := refusal(str(path), path.name)) is not None:
        raise CheckpointError(said)
    fmt, loaded = _open(path, verify_crc=False, allow_globals=allow_globals, region=region)
    rows: list[tuple[TensorRecord | None, str, str, tuple[int, ...], int]] = []
    unsupported: list[str] = []
    dropped: dict[str, object] = {}
    placeholders: list[tuple[str, str]] = []
    hint: dict[str, object] = {}
    if isinstance(loaded, CheckpointContents):
        rows = [(r, r.name, r.dtype, r.shape, r.nbytes) for r in loaded.tensors]
        leaves: list[str] = []
        containers: list[tuple[str, int]] = []
        metadata = dict(loaded.metadata)
    else:
        refs, leaves, containers = walk(loaded, path)
        if (recipe := lightning_recipe(loaded)) is not None:
            hint = {"hint": recipe.describe(), "flags": recipe.flags(), "training_state": list(recipe.training)}
        placeholders = find_placeholders(loaded, where=path)
        metadata = {}
        for name, ref in refs:
            if ref.dropped:
                dropped[name] = list(ref.dropped)
            code, item = TORCH_DTYPES[ref.dtype]
            if code is None:
                numel = 1
                for d in ref.size:
                    numel *= d
                rows.append((None, name, ref.dtype, ref.size, numel * item))
                unsupported.append(name)
                continue
            rec = make_record(path, name, ref)
            rows.append((rec, name, rec.dtype, rec.shape, rec.nbytes))
    tensors, alias_groups = _describe(rows)
    unsupported_names = set(unsupported)
    for t in tensors:
        t["supported"] = t["name"] not in unsupported_names
        if t["name"] in dropped:
            t["dropped_attributes"] = dropped[str(t["name"])]
    return {
        "path": str(path),
        "format": fmt,
        "tensors": tensors,
        "alias_groups": alias_groups,
        "skipped": leaves,
        "containers": [{"name": n, "tensors": c} for n, c in containers],
        "metadata": metadata,
        "placeholders": [{"name": n, "type": k} for n, k in placeholders],
        **hint,
    }
