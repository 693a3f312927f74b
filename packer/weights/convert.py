"""The weights stage: find inputs, read records, plan, stream-write, verify, publish.

Nothing is renamed into place until every shard is written and verified; on any failure the
temporary files (and ``dest_dir``, when this call created it) are removed, so nothing is
left under the output names.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from packer.checkpoint.records import CheckpointContents, listing
from packer.errors import DependencyError, PackerError, WeightsError
from packer.recipe import WeightsConfig
from packer.stage import Progress, StageOutput
from packer.util.formats import UNNAMED_BLOBS
from packer.util.fsutil import FileEntry, quiet_cleanup, umask
from packer.weights.inputs import InputSet, check_index, find_inputs
from packer.weights.plan import INDEX_NAME, WeightsPlan, plan_weights
from packer.weights.ties import read_tie_config
from packer.weights.verify import verify_written
from packer.weights.writer import Sources, StagedFiles, write_shard


def read_inputs(inputs: InputSet, key: str | None, allow_globals: Sequence[str] = ()) -> list[CheckpointContents]:
    """Read every input file's records with the safe checkpoint reader.

    ``allow_globals`` are the user's plain-data classes, read as inert placeholders.

    Raises:
        CheckpointError: from the reader, naming the file.
    """
    from packer.checkpoint.reader import read_checkpoint

    return [read_checkpoint(path, key=key, allow_globals=allow_globals) for path in inputs.files]


def name_filter(contents: Sequence[CheckpointContents],
                cfg: WeightsConfig) -> tuple[list[CheckpointContents], list[str]]:
    """The tensors ``weights.include`` / ``weights.exclude`` keep (globs on the names as read: an EMA's
    ``n_averaged``, a teacher's ``online_model.*``), and a note naming what they left out.

    Raises:
        WeightsError: an ``include`` glob that matches no tensor (a typo would build nothing).
    """
    if not cfg.include and not cfg.exclude:
        return list(contents), []
    kept, dropped, used = [], [], set()
    for c in contents:
        keep = []
        for r in c.tensors:
            hit = [g for g in cfg.include if fnmatch.fnmatchcase(r.name, g)]
            used.update(hit)
            if (cfg.include and not hit) or any(fnmatch.fnmatchcase(r.name, g) for g in cfg.exclude):
                dropped.append(r.name)
            else:
                keep.append(r)
        kept.append(replace(c, tensors=tuple(keep)))
    unused = [g for g in cfg.include if g not in used]
    if unused:
        raise WeightsError(f"weights.include: {unused[0]!r} matches no tensor of {contents[0].path}")
    return kept, [f"left out by weights.include/exclude: {listing(dropped)}"] if dropped else []


def _notes(inputs: InputSet, contents: Sequence[CheckpointContents]) -> list[str]:
    notes = check_index(inputs, {c.path: [r.name for r in c.tensors] for c in contents})
    for c in contents:
        plain = [s for s in c.skipped if s not in c.placeholders]  # placeholders have their own note
        if plain:
            n = len(plain)
            notes.append(f"{inputs.rel(c.path)}: skipped {n} non-tensor entr{'y' if n == 1 else 'ies'}: "
                         f"{listing(plain)}")
        if c.left_out:
            notes.append(f"{inputs.rel(c.path)}: not converted (beside the selected key): "
                         f"{listing(c.left_out)}")
        notes.extend(f"{inputs.rel(c.path)}: {note}" for note in c.notes)
    return notes


def _nothing_to_write(inputs: InputSet, contents: Sequence[CheckpointContents]) -> str:
    """Why a conversion found no tensor: what the inputs held instead, and the way out."""
    skipped = sorted({s for c in contents for s in c.skipped})
    held = [n for c in contents for n in c.notes]
    if skipped or held:
        what = listing(skipped) if skipped else "; ".join(held)
        return (f"no tensors to write: the checkpoint holds {what} and no tensor, so it is not a model's "
                "weights and there is nothing to build")
    return (f"no tensors to write: {', '.join(inputs.rel(c.path) for c in contents)} hold"
            f"{'s' if len(contents) == 1 else ''} none; a checkpoint of zero tensors builds nothing a loader could use")


def _section(plan: WeightsPlan, prefix: str, inputs: InputSet,
             contents: Sequence[CheckpointContents]) -> dict[str, Any]:
    section = plan.section(prefix)
    section["skipped"] = sorted({s for c in contents for s in c.skipped})
    section["inputs"] = [{"path": inputs.rel(c.path), "format": c.format} for c in contents]
    section["inputs"] += [{"path": inputs.rel(p), "format": f"{c.format}-data"} for c in contents for p in c.data_files]
    if inputs.index is not None:  # it chose the shards: the manifest pins it with them
        section["inputs"].append({"path": inputs.rel(inputs.index), "format": "index"})
    return section


def _check_dest(dest_dir: Path, plan: WeightsPlan) -> None:
    ours = {s.filename for s in plan.shards} | {INDEX_NAME}
    stale = sorted(p.name for p in dest_dir.glob("model*.safetensors*") if p.name not in ours)
    if stale:
        raise WeightsError(f"{dest_dir}: holds {stale[0]} from another conversion; remove it "
                           "or choose an empty directory")


LayerFraming = Callable[[str, int], tuple[bytes, bytes]]


def _write_all(
    plan: WeightsPlan, dest_dir: Path, staged: StagedFiles, *, verify: bool,
    progress: Progress | None, framing: LayerFraming | None, prefix: str, blobs: Path | None,
) -> tuple[list[FileEntry], dict[str, str]]:
    """Write every shard (into its layer blob under ``blobs`` when given, unhashed) and the index."""
    written: list[FileEntry] = []
    framed: dict[str, str] = {}  # shard name -> sha256 of its framed bytes
    sources = Sources()
    try:
        paths: dict[str, Path] = {}
        bases: dict[str, int] = {}
        checked: set[str] = set()
        for shard in plan.shards:
            tmp = staged.temp_for(shard.filename)
            frame = framing(prefix + shard.filename, shard.size) if framing else None
            try:
                # a blob is for a caller that re-reads it: both digests are taken there
                out = write_shard(shard, tmp, sources, verify=verify or blobs is not None, progress=progress,
                                  framing=frame, blob=blobs is not None, hashed=blobs is None)
            except OSError as e:
                raise WeightsError(f"{dest_dir / shard.filename}: cannot write: "
                                   f"{e.strerror or e}") from e
            paths[shard.filename], bases[shard.filename], checked = tmp, out.base, checked | out.checked
            entry = FileEntry(prefix + shard.filename, out.size, out.sha256)
            if out.size != shard.size:  # the framing and the header were made for the planned size
                raise WeightsError(f"{dest_dir / shard.filename}: wrote {out.size} bytes, planned {shard.size}")
            if blobs is not None:  # the layer blob is the file's one copy; the re-read names it
                staged.retarget(tmp, blobs / shard.filename)
                entry = replace(entry, blob=f"{UNNAMED_BLOBS}/{entry.path}", offset=out.base)
            elif out.framed_sha256 is not None:
                framed[shard.filename] = out.framed_sha256
            written.append(entry)
        if verify:
            verify_written(plan, paths, sources, skip=checked, bases=bases)
    finally:
        sources.close()
    if plan.index is not None:
        tmp = staged.temp_for(INDEX_NAME)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 & ~umask())
        with os.fdopen(fd, "wb") as f:
            f.write(plan.index)
        written.append(FileEntry(prefix + INDEX_NAME, len(plan.index), hashlib.sha256(plan.index).hexdigest()))
    return written, framed


def convert(
    src: Path,
    dest_dir: Path,
    cfg: WeightsConfig,
    *,
    rel_root: Path | None = None,
    progress: Progress | None = None,
    dry_run: bool = False,
    verify: bool = True,
    layer_framing: LayerFraming | None = None,
    layer_blobs: bool = False,
) -> StageOutput:
    """Convert the checkpoint(s) in ``src`` to canonical safetensors in ``dest_dir``.

    Args:
        src: a checkpoint file or a directory (see :mod:`packer.weights.inputs`).
        dest_dir: where the shards and index go (created if missing).
        cfg: the recipe's weights section.
        rel_root: what file paths in the result are relative to (default ``dest_dir``).
        progress: called with the tensor bytes just written (increments, see
            :data:`packer.stage.Progress`).
        dry_run: plan only; ``section`` describes what would be written.
        verify: read each span back as it lands and compare it with its source (memcmp), and
            re-parse the outputs and compare every other tensor (a gather or a cast) with its
            source. False is for a caller that re-hashes what was written (``packer build``):
            a file it hashes is not read back, one written as its layer blob (unhashed) still is.
        layer_framing: given a shard's path relative to ``rel_root`` and its size, the bytes
            before and after it in its image layer (:func:`packer.oci.plan.weight_layer_framing`);
            each layer's sha256 is then computed while the shard is written (another thread).
        layer_blobs: with ``layer_framing``, write each shard as its layer blob (the tar
            framing around the safetensors bytes, which start at a page boundary) instead of a
            file in ``dest_dir``, and hash neither: ``rel_root/image/unnamed/<its path>``
            (:data:`~packer.util.formats.UNNAMED_BLOBS`), whose file entry keeps the safetensors'
            size, names the ``blob`` and the ``offset`` of the bytes in it, and has ``sha256``
            "": the caller re-reads it, hashes both and names it by its digest
            (:func:`packer.oci.reread.reread_blobs`; OUT then holds each weight byte once).

    Returns:
        The files written, the manifest section, bytes processed and notes; with
        ``layer_framing`` (and not ``layer_blobs``), ``digests`` maps ``"layer:<path>"`` to
        ``"sha256:<hex>"``.

    Raises:
        PackerError: WeightsError, CheckpointError or VerifyError with a one-line reason.
    """
    src, dest_dir = Path(src), Path(dest_dir)
    root = Path(rel_root) if rel_root is not None else dest_dir
    prefix = dest_dir.relative_to(root).as_posix() + "/" if dest_dir != root else ""
    inputs = find_inputs(src, cfg.files, pickles_first=cfg.key is not None)
    contents = read_inputs(inputs, cfg.key, cfg.allow_globals)
    contents, filtered = name_filter(contents, cfg)
    notes = _notes(inputs, contents) + filtered
    # the model's config.json: in the source directory, or beside a single checkpoint file
    # (as the build's bundle takes it); beside a file, an unreadable one is not the model's
    ties = read_tie_config(src) if src.is_dir() else read_tie_config(src.parent, strict=False)
    plan = plan_weights(contents, cfg, ties=ties)
    if not plan.tensors:
        raise WeightsError(f"{src}: {_nothing_to_write(inputs, contents)}")
    if plan.metadata:
        notes.append(f"kept the source's safetensors __metadata__ in every shard: "
                     f"{listing([k for k, _v in plan.metadata])}")
    section = _section(plan, prefix, inputs, contents)
    if dry_run:
        return StageOutput(section=section, notes=tuple(notes))
    created = not dest_dir.exists()
    staged = StagedFiles(dest_dir)
    blobs = root / UNNAMED_BLOBS / prefix if layer_blobs and layer_framing is not None else None
    try:
        dest_dir.mkdir(parents=True, exist_ok=True)
        _check_dest(dest_dir, plan)
        if blobs is not None:
            blobs.mkdir(parents=True, exist_ok=True)
        written, framed = _write_all(plan, dest_dir, staged, verify=verify, progress=progress,
                                     framing=layer_framing, prefix=prefix, blobs=blobs)
        staged.commit()
        if created and blobs is not None and not any(dest_dir.iterdir()):
            dest_dir.rmdir()  # every file went into a blob: no empty weights/ folder
    except BaseException as e:
        # removing what was staged must never raise over the error that caused it
        quiet_cleanup(e, staged.discard, *([dest_dir.rmdir] if created else []))
        if isinstance(e, OSError):
            raise WeightsError(f"{dest_dir}: cannot write: {e.strerror or e}") from e
        if isinstance(e, PackerError) and not isinstance(e, DependencyError) and not str(e).startswith(str(src)):
            raise e.with_context(f"converting {src}") from e.__cause__
        raise
    files = tuple(written)
    digests = {f"layer:{prefix}{name}": f"sha256:{hexd}" for name, hexd in framed.items()}
    return StageOutput(files=files, section=section, bytes_processed=sum(f.size for f in files),
                       notes=tuple(notes), digests=digests)
