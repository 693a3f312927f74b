"""The safetensors ``__metadata__`` an output carries over from its inputs.

A library may keep state there that its tensors cannot hold: torchao's flattened form names
each quantized tensor's class and attributes (``{"_type": "Int8Tensor", ...}``) and lists the
tensor names; without them ``from_pretrained`` refuses the file. packer keeps the source's
keys beside its own (``format``, ``packer.aliases``, ``packer.torch_shapes``) in every output
shard, and refuses where it cannot carry them faithfully: two inputs disagreeing on a key, a
source key in packer's namespace, or renamed tensors the metadata may still name by their old
names. A source written by packer gives its ``packer.aliases`` back, so re-converting packer's
own output keeps its aliases.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from packer.checkpoint.records import TORCH_SHAPES_KEY, CheckpointContents, listing
from packer.errors import WeightsError
from packer.reading import JSON_DOC, parse_json

ALIASES_KEY = "packer.aliases"
_OURS = frozenset({"format", TORCH_SHAPES_KEY})  # written afresh from the records


@dataclass(frozen=True)
class CarriedMetadata:
    """The source keys every output shard carries, and the aliases a packer-written input held."""

    keys: tuple[tuple[str, str], ...] = ()  # sorted (key, value)
    aliases: tuple[tuple[str, str], ...] = ()  # (alias, kept name) in output names


def _input_aliases(c: CheckpointContents, raw: str) -> dict[str, str]:
    aliases = parse_json(raw, JSON_DOC, where=f"{c.path}: __metadata__ {ALIASES_KEY}", error=WeightsError)
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in aliases.items()):
        raise WeightsError(f"{c.path}: __metadata__ {ALIASES_KEY} is not a JSON object of names")
    return aliases


def carried_metadata(contents: Sequence[CheckpointContents], rename: Callable[[str], str],
                     kept: Sequence[str]) -> CarriedMetadata:
    """What the output's headers carry from the inputs' ``__metadata__``.

    Args:
        contents: the input files (only safetensors inputs have metadata).
        rename: the recipe's name mapping (``strip_prefixes``, ``renames``).
        kept: the output's tensor names.

    Raises:
        WeightsError: inputs that set one key to different values, a key in packer's
            ``packer.`` namespace other than its own, tensors renamed while metadata is
            carried, or ``packer.aliases`` naming a tensor the output does not hold.
    """
    keys: dict[str, tuple[str, CheckpointContents]] = {}
    aliases: dict[str, str] = {}
    names = set(kept)
    for c in contents:
        for key, value in c.metadata:
            if key == ALIASES_KEY:
                aliases.update({rename(a): rename(k) for a, k in _input_aliases(c, value).items()})
                continue
            if key in _OURS:
                continue
            if key.startswith("packer."):
                raise WeightsError(f"{c.path}: __metadata__ key {key!r} is in packer's own namespace "
                                   "(packer.*), which packer writes; remove it from the source")
            if not utf8_ok(key + value):
                raise WeightsError(f"{c.path}: __metadata__ key {key!r} holds a lone surrogate, which "
                                   "safetensors cannot store; fix the source's metadata")
            seen = keys.get(key)
            if seen is not None and seen[0] != value:
                raise WeightsError(
                    f"{seen[1].path.name} and {c.path.name} set __metadata__ {key!r} to different values; "
                    "packer writes one metadata for every output shard and cannot carry both: re-save the "
                    "model as one file (save_pretrained(..., max_shard_size=\"100GB\")) and build that")
            keys[key] = (value, c)
    if keys:
        _check_names_kept(contents, rename, sorted(keys))
    for alias, target in aliases.items():
        if target not in names or alias in names:
            what = "a tensor the output also holds" if alias in names else f"{target!r}, which the output lacks"
            raise WeightsError(f"__metadata__ {ALIASES_KEY}: alias {alias!r} names {what}; "
                               "convert the checkpoint packer read this one from instead")
    return CarriedMetadata(tuple(sorted((k, v) for k, (v, _c) in keys.items())), tuple(sorted(aliases.items())))


def utf8_ok(text: str) -> bool:
    """Whether ``text`` encodes to UTF-8 (it holds no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_names_kept(contents: Sequence[CheckpointContents], rename: Callable[[str], str],
                      keys: list[str]) -> None:
    for c in contents:
        if not c.metadata:
            continue
        for r in c.tensors:
            if rename(r.name) != r.name:
                raise WeightsError(
                    f"{c.path}: tensor {r.name!r} is renamed to {rename(r.name)!r}, but the file's "
                    f"__metadata__ ({listing(keys, 5)}) may name tensors by their old names and packer "
                    "cannot rewrite it; build without weights.strip_prefixes / renames")
