"""Find the checkpoint files in a source: one file, a directory, sharded checkpoints, globs.

Auto-detection in a directory, first match wins (safetensors first: they need no pickle
parsed at all and hold the same tensors when a repository ships both):

1. ``model.safetensors.index.json`` with its shards, 2. ``model.safetensors``,
3. ``pytorch_model.bin.index.json`` with its shards, 4. ``pytorch_model.bin``,
5. the one index of a sharded variant (``model.safetensors.index.fp16.json``),
6. a ``torch.distributed.checkpoint`` folder: ``.metadata`` beside ``*.distcp`` files,
7. the only ``*.safetensors`` / ``*.pt`` / ``*.pth`` / ``*.ckpt`` / ``*.bin`` file.

``WeightsConfig.files`` globs (relative to the source) replace auto-detection.

Every file found in a directory, and every shard an index names, must resolve inside the
source (:func:`packer.util.idents.link_roots`: a hub snapshot's links only into its own
repository's ``blobs/``), the rule the bundle applies to the same directory. A single file
named by the recipe or the command line is taken as named.
"""

from __future__ import annotations

import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from packer.checkpoint.dcp_meta import metadata_of
from packer.errors import WeightsError
from packer.reading import JSON_DOC, not_regular, read_json
from packer.util.formats import WEIGHT_PATTERNS, foreign_advice, variant_of
from packer.util.idents import check_rel_name, confined, link_roots
from packer.util.jsonshape import STR, MapOf, Obj

INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLES = ("model.safetensors", "pytorch_model.bin")
MAX_INDEX_BYTES = JSON_DOC.max_bytes  # real indexes are kilobytes to a few MB; this bounds the JSON parse
_VARIANT_INDEX = re.compile(r"\.index\.[A-Za-z0-9_]{1,32}\.json$")  # model.safetensors.index.fp16.json
_INDEX = Obj({"weight_map": MapOf(STR, expected="an object of tensor name -> shard file name")})


@dataclass(frozen=True)
class InputSet:
    """The checkpoint files to convert, in order, and the index that listed them (if any)."""

    root: Path  # what relative input paths start from (the source dir, or the file's dir)
    files: tuple[Path, ...]
    index: Path | None = None
    weight_map: tuple[tuple[str, str], ...] = ()  # (tensor name, shard file name) from the index

    def rel(self, path: Path) -> str:
        """``path`` relative to the source, for the manifest."""
        return path.relative_to(self.root).as_posix()


def _is_input(path: Path) -> bool:
    """True for a regular file, False for nothing or a directory; a FIFO, socket or device is
    refused here, before anything opens it (an open would block, a read might never end)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return stat.S_ISREG(mode)
    raise not_regular(path, mode, WeightsError)


def find_inputs(src: Path, globs: Sequence[str] = (), *, pickles_first: bool = False) -> InputSet:
    """Find the checkpoint files of ``src``.

    Args:
        src: a checkpoint file or a directory holding one or a sharded set.
        globs: recipe ``weights.files`` patterns relative to ``src``; replace auto-detection.
        pickles_first: prefer ``pytorch_model.bin`` files (a ``weights.key`` only means
            something for pickles).

    Returns:
        The input files in order (index order for shards, sorted for globs).

    Raises:
        WeightsError: nothing found, several candidates, a bad index, a missing shard, or a
            file that leads outside the source.
    """
    if not src.exists():
        raise WeightsError(f"{src}: no such file or directory")
    if not src.is_dir() and _is_input(src):
        if globs:
            raise WeightsError(f"{src}: weights.files needs a directory source, got a file")
        # one file of a torch.distributed.checkpoint folder stands for the folder
        return InputSet(src.parent, (metadata_of(src) or src,))
    found = _find(src, globs, pickles_first)
    roots = link_roots(src)
    for path in (*found.files, *([found.index] if found.index else [])):
        confined(path, roots, error=WeightsError, what=f"checkpoint {found.rel(path)!r}",
                 hint="copy the file into the model directory")
    return found


def _find(src: Path, globs: Sequence[str], pickles_first: bool) -> InputSet:
    if globs:
        return _from_globs(src, globs)
    order = -1 if pickles_first else 1
    for name in INDEXES[::order]:
        if _is_input(src / name):
            return _from_index(src, src / name)
    for name in SINGLES[::order]:
        if _is_input(src / name):
            return InputSet(src, (src / name,))
    if index := variant_index(src, ("model", "pytorch_model")[::order]):
        return _from_index(src, index)
    if (meta := metadata_of(src)) is not None:  # torch.distributed.checkpoint: its .metadata names the rest
        return InputSet(src, (meta,))
    candidates = sorted({p for pattern in WEIGHT_PATTERNS for p in src.glob(pattern) if _is_input(p)})
    if len(candidates) == 1:
        return InputSet(src, tuple(candidates))
    if not candidates:
        foreign = sorted(p for p in src.iterdir() if foreign_advice(p) and _is_input(p))  # by name: never opened
        if foreign:
            others = f" (and {len(foreign) - 1} more such file{'s' if len(foreign) > 2 else ''})" \
                if len(foreign) > 1 else ""
            raise WeightsError(f"{foreign[0]}{others}: {foreign_advice(foreign[0])}")
        raise WeightsError(f"{src}: no checkpoint found (looked for {', '.join(SINGLES)}, "
                           f"an index or a single {'/'.join(WEIGHT_PATTERNS)} file)")
    names = ", ".join(p.name for p in candidates[:6])
    raise WeightsError(f"{src}: several checkpoint files ({names}); choose with weights.files")


def variant_index(folder: Path, stems: Sequence[str]) -> Path | None:
    """The one index of a sharded variant in ``folder`` (``model.safetensors.index.fp16.json``, what
    ``save_pretrained(variant=...)`` writes), first stem first; None when there is none or several."""
    for stem in stems:
        found = sorted(p for p in folder.glob(f"{stem}.*.index.*.json")
                       if variant_of(p.name, (stem,)) and _is_input(p)) if folder.is_dir() else []
        if found:
            return found[0] if len(found) == 1 else None
    return None


def _from_globs(src: Path, globs: Sequence[str]) -> InputSet:
    found: set[Path] = set()
    for pattern in globs:
        matches = [p for p in src.glob(pattern) if _is_input(p)]
        if not matches:
            raise WeightsError(f"{src}: weights.files pattern {pattern!r} matches no file")
        found.update(matches)
    index = [p for p in found if p.name.endswith(".index.json") or _VARIANT_INDEX.search(p.name)]
    if len(index) == 1 and len(found) == 1:
        return _from_index(src, index[0])
    if index:
        raise WeightsError(f"{src}: weights.files selects an index with other files; "
                           "select the index alone or the shards alone")
    return InputSet(src, tuple(sorted(found)))


def _from_index(src: Path, index: Path) -> InputSet:
    data = read_json(index, JSON_DOC, error=WeightsError, shape=_INDEX, where=f"{index}: not a checkpoint index")
    weight_map = data["weight_map"]
    shards: list[Path] = []
    for name in dict.fromkeys(sorted(weight_map.values())):
        path = index.parent / check_rel_name(name, where=f"{index}: shard", error=WeightsError)
        if not _is_input(path):
            raise WeightsError(f"{index}: lists shard {name!r}, which does not exist")
        shards.append(path)
    return InputSet(src, tuple(shards), index, tuple(sorted(weight_map.items())))


def check_index(inputs: InputSet, found: Mapping[Path, Sequence[str]]) -> list[str]:
    """Check the tensors found in each shard against the index; return notes on extras.

    Args:
        inputs: the input set with its index.
        found: shard path -> names of the tensors the reader found in it.

    Returns:
        One note per shard holding tensors the index does not list (they are converted).

    Raises:
        WeightsError: an indexed tensor missing from the shard the index names.
    """
    if inputs.index is None:
        return []
    base = inputs.index.parent
    by_path = {p: set(names) for p, names in found.items()}
    listed: dict[Path, set[str]] = {}
    for tensor, shard in inputs.weight_map:
        listed.setdefault(base / shard, set()).add(tensor)
        if tensor not in by_path.get(base / shard, set()):
            raise WeightsError(f"{inputs.index}: tensor {tensor!r} is indexed in {shard!r}, "
                               "which does not hold it")
    notes = []
    for path, names in sorted(by_path.items()):
        extra = sorted(names - listed.get(path, set()))
        if extra:
            shown = ", ".join(extra[:5]) + (", ..." if len(extra) > 5 else "")
            notes.append(f"{path.name}: {len(extra)} tensors not in {inputs.index.name} "
                         f"(converted anyway): {shown}")
    return notes
