"""``packer build``: order the stages, time them, verify the result and publish it atomically.

source → weights → bundle → loader → inputs (the artifact manifest) → image → manifest → verify
→ publish. Each stage is a function of one :class:`~packer.stage.StageContext` returning a
:class:`~packer.stage.StageOutput`; this module runs the one list of them,
:data:`packer.build_stages.STAGES`, in order and times them, so it knows nothing of their internals.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from packer.build_stages import STAGES, BuildStage, default_layer_digests, final_manifest
from packer.errors import PackerError
from packer.filetree import disk_usage
from packer.hashing import sha256_file_or_none
from packer.manifest import TIMINGS
from packer.publish import make_scratch, make_staging, publish
from packer.recipe import Recipe
from packer.source import Snapshot, resolve_source
from packer.stage import Early, Progress, StageContext
from packer.util.formats import MANIFEST_NAME
from packer.util.fsutil import atomic_write_bytes, canonical_json, remove_tree
from packer.util.timing import StageTimer
from packer.verifying import verify
from packer.warm_step import check_warm_table, warm_after_build


@dataclass
class BuildResult:
    """What a build produced (or, for a dry run, planned)."""

    out: Path
    manifest: dict[str, Any]
    timer: StageTimer
    notes: list[str] = field(default_factory=list)
    dry_run: bool = False
    checked: dict[str, Any] = field(default_factory=dict)  # the final verification's summary
    disk_bytes: int = 0  # OUT on disk, as du counts it (hard links once)
    warm: dict[str, Any] | None = None  # the [warm] table's state (packer.warm_step), if one was made

    def summary(self) -> dict[str, Any]:
        """The ``--json`` summary: ``files`` and ``bytes`` as ``packer verify`` counts them (every
        file it checks, manifest.json included), OUT's size on disk, the image's digests; a dry
        run adds the whole ``plan``."""
        image = self.manifest.get("image") or {}
        out: dict[str, Any] = {
            "out": str(self.out), "dry_run": self.dry_run, "files": self.checked.get("files", 0),
            "bytes": self.checked.get("bytes", 0), "disk_bytes": self.disk_bytes,
            "stages": self.timer.as_json(), "notes": self.notes,
            "left_out": (self.manifest.get("weights") or {}).get("left_out", []),
            "image": {k: image[k] for k in ("tag", "index_digest", "manifest_digest", "config_digest")
                      if k in image},
        }
        if self.warm is not None:
            out["warm"] = self.warm
        if self.dry_run:
            out["plan"] = self.manifest
        return out


def _check_out(out: Path) -> None:
    if out.exists() and not (out.is_dir() and ((out / MANIFEST_NAME).is_file() or not any(out.iterdir()))):
        raise PackerError(f"{out}: exists and is not a packer build output; remove it or choose another -o")


def _hash_inputs_early(snap: Snapshot, recipe: Recipe, pool: ThreadPoolExecutor,
                       stop: threading.Event) -> Early:
    """Start hashing the checkpoint files the weights stage will read, while it converts them.

    The manifest records every input's sha256; hashing the checkpoints after conversion
    would be a second full pass on one core. The list comes from the same search the weights
    stage makes (names and the index only; no checkpoint is opened here); anything it gets
    wrong is simply hashed again later.
    """
    from packer.weights.inputs import find_inputs

    try:
        found = find_inputs(snap.weights, recipe.weights.files, pickles_first=recipe.weights.key is not None)
        files = sorted([*found.files, *([found.index] if found.index else [])], key=lambda f: -f.stat().st_size)
    except (PackerError, OSError):
        return {}  # the weights stage reports it
    return {f.absolute(): pool.submit(sha256_file_or_none, f, stop) for f in files}


def _run_stage(ctx: StageContext, timer: StageTimer, stage: BuildStage) -> None:
    """Run ``stage`` under its timer and record its output in the context."""
    with timer.stage(stage.name) as t:
        out = stage.run(ctx)
        t.nbytes = out.bytes_processed
    ctx.outputs[stage.name] = out


def _run_stages(ctx: StageContext, timer: StageTimer) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    stop = threading.Event()
    pool = ThreadPoolExecutor(max(1, (os.cpu_count() or 1) - 1), thread_name_prefix="packer-inputs")
    try:
        early = {} if ctx.dry_run else _hash_inputs_early(ctx.snap, ctx.recipe, pool, stop)
        return _stages(replace(ctx, early=early), timer)
    finally:
        stop.set()  # a failed stage need not wait for the inputs to be hashed
        pool.shutdown(wait=True, cancel_futures=True)


def _stages(ctx: StageContext, timer: StageTimer) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    """Run every stage; return the manifest, the notes and what the weights stage re-read
    itself (its ``vouched``, for the final verification)."""
    for stage in STAGES:
        if stage.runs_when(ctx):
            _run_stage(ctx, timer, stage)
    out = ctx.outputs
    image = out["image"]
    if ctx.dry_run:  # the plan: nothing was written, no input hashed
        bundle = out.get("bundle")
        manifest = {"recipe": ctx.recipe.normalised(), "source": ctx.snap.identity(),
                    "weights": out["weights"].section, "bundle": bundle.section if bundle else None,
                    "image": image.section}
    else:
        manifest = final_manifest(ctx)
        atomic_write_bytes(ctx.staging / MANIFEST_NAME, canonical_json(manifest))
    return manifest, [note for o in out.values() for note in o.notes], out["weights"].vouched


def build(recipe: Recipe, out: str | Path, *, dry_run: bool = False, sandbox: bool = True,
          cache_dir: Path | None = None, progress: Progress | None = None,
          layer_digests: bool | None = None) -> BuildResult:
    """Build ``recipe`` into ``out``.

    The weights stage, which reads untrusted checkpoints, runs in an isolated child process
    unless ``sandbox`` is false; ``progress`` receives the weight bytes as they are written (increments, see
    :data:`packer.stage.Progress`), with or without the sandbox.
    ``layer_digests`` computes the weight layers' digests during conversion (default: when
    there are three cores or more; the output is the same either way). The
    build runs in a staging directory beside ``out`` and is renamed into place only when every
    stage and the final verification passed; a failed or killed build leaves ``out`` as it was.

    With a signing key (``recipe.sign_key()``) the build also writes ``model.sig`` and the
    signed provenance (:mod:`packer.sign`); the key is read before any stage.

    With a ``[warm]`` table, the published build is then warmed (:func:`packer.warm_step.
    warm_after_build`) where the engine is installed on the device kind named; elsewhere a
    note says why not. What the table needs no build for (its engine flags, the engine's
    interpreter and device kind, its model directory) is checked before the first stage
    (:func:`packer.warm_step.check_warm_table`): a table that cannot run is refused with ``out``
    untouched. A failed warm run raises after ``out`` was published.

    Raises:
        PackerError: any stage failed (SignError: the key cannot be used; DependencyError:
            the ``sign`` extra is missing); ``out`` is untouched.
    """
    out = Path(out).absolute()
    timer = StageTimer()
    # what the [warm] table needs no build for is checked before anything is built or out touched
    warm_check = check_warm_table(recipe, out) if recipe.warm.engine and not dry_run else None
    if not dry_run:
        _check_out(out)
    if recipe.sign_key():  # a bad key fails now, not after the weights are converted
        from packer.sign.keys import load_signing_key

        with timer.stage("key"):  # the signing libraries' import: a stage, so the table adds up
            load_signing_key(recipe.sign_key() or "")
    staging = make_staging(out)
    try:
        with contextlib.ExitStack() as stack:
            with timer.stage("source"):
                # the demo goes to a scratch directory beside out, which a later build removes
                # if this one is killed (a temporary directory elsewhere would stay forever)
                scratch = make_scratch(out) if recipe.source == "demo" else None
                snap = stack.enter_context(resolve_source(recipe, cache_dir=cache_dir, scratch=scratch))
            ctx = StageContext(recipe, snap, staging, dry_run=dry_run, sandbox=sandbox, progress=progress,
                               layer_digests=default_layer_digests() if layer_digests is None else layer_digests)
            manifest, notes, vouched = _run_stages(ctx, timer)
            notes = [*snap.notes, *notes]  # a cached commit built instead of the hub's is said first
        if dry_run:
            return BuildResult(out, manifest, timer, notes, dry_run=True)
        with timer.stage("verify") as t:
            checked = verify(staging, vouched=vouched)  # the weight blobs' hashes: the weights stage's re-read
            t.nbytes = checked["bytes"]
        atomic_write_bytes(staging / TIMINGS, canonical_json({"stages": timer.as_json()}))
        on_disk = disk_usage(staging)  # with the timings: what OUT takes once published
        publish(staging, out)
    finally:
        with contextlib.suppress(OSError):  # at any depth (the weights child writes in it)
            remove_tree(staging)
    warm = None
    if recipe.warm.engine:  # after the publish: the state lies beside the build, pinned apart
        with timer.stage("warm"):
            warm, more = warm_after_build(out, recipe, checked=warm_check)
        notes = [*notes, *more]
        on_disk = disk_usage(out)  # the state and its image layer count too
    return BuildResult(out, manifest, timer, notes, checked=checked, disk_bytes=on_disk, warm=warm)
