"""The build's stage seam: one context in, one :class:`StageOutput` out, one progress contract.

Every stage of ``packer build`` is a function ``stage(ctx: StageContext) -> StageOutput``
(:data:`STAGES`); :mod:`packer.build` only orders and times them. Each stage adapts the context
to its own module's public function (``convert_cli``, ``run_bundle``, ``emit_loader``,
``build_image``), which the commands and tests also call directly. Stage modules are imported
inside the stage functions, so importing this module stays cheap (no torch).

Progress, everywhere on the build side, is :data:`Progress`: called with the number of bytes
just written (an increment; the sum of the calls is what the stage wrote).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packer.fsutil import FileEntry

if TYPE_CHECKING:
    from packer.recipe import Recipe
    from packer.source import Snapshot

Progress = Callable[[int], None]
"""Called with the bytes just written (an increment, never a running total)."""

Early = dict[Path, "Future[tuple[int, str] | None]"]
"""Input files being hashed while the stages run: absolute path -> (size, sha256) or None."""


@dataclass(frozen=True)
class StageOutput:
    """The result of one stage.

    Attributes:
        files: every file the stage wrote, relative to the output directory.
        section: the stage's manifest section (JSON-able, deterministic: no timings).
        bytes_processed: bytes read or written, for the stage table's throughput column.
        notes: human-readable remarks for the build log (skipped entries and the like).
        digests: facts for later stages that are not part of the manifest section, e.g.
            ``{"layer:weights/model.safetensors": "sha256:…"}`` (a weight file's image layer).
    """

    files: tuple[FileEntry, ...] = ()
    section: dict[str, Any] = field(default_factory=dict)
    bytes_processed: int = 0
    notes: tuple[str, ...] = ()
    digests: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StageContext:
    """Everything a build stage may read.

    Attributes:
        recipe: the build's recipe.
        snap: the resolved source (local files).
        staging: the staging output directory every stage writes into.
        dry_run: plan only; stages write nothing.
        sandbox: read checkpoints in an isolated child process.
        progress: the weights stage's byte increments (see :data:`Progress`), or None.
        layer_digests: compute the weight layers' digests while converting.
        early: input hashes started before the stages (see :mod:`packer.build`).
        outputs: the earlier stages' outputs by stage name (``"weights"``, ``"bundle"``,
            ``"loader"``); the build adds each one as its stage ends.
    """

    recipe: Recipe
    snap: Snapshot
    staging: Path
    dry_run: bool = False
    sandbox: bool = True
    progress: Progress | None = None
    layer_digests: bool = False
    early: Early = field(default_factory=dict)
    outputs: dict[str, StageOutput] = field(default_factory=dict)

    def artifacts(self) -> list[FileEntry]:
        """The artifact files written so far (weights, bundle, loader), in that order."""
        return [f for name in ("weights", "bundle", "loader") if name in self.outputs
                for f in self.outputs[name].files]


def weights_stage(ctx: StageContext) -> StageOutput:
    """Convert the source's checkpoints into ``staging/weights`` (isolated unless ``ctx.sandbox`` is false)."""
    from packer.component_weights import convert_layout

    # With a third core, each weight file's own layer digest is computed while the file is
    # written (an extra hashing thread), and the image stage only copies it. On two cores both
    # are already busy during conversion (and the inputs' hashing): moving the hash there changed
    # the whole build by -0.3 % to +2.6 % in five runs (benchmarks/RESULTS.md).
    img = ctx.recipe.image
    layer_image = img if ctx.layer_digests and img.weights == "layer" and not img.single_layer else None
    return convert_layout(ctx.snap.weights, ctx.staging, ctx.recipe.weights, single_file=ctx.snap.single_file,
                          dry_run=ctx.dry_run, sandbox=ctx.sandbox, progress=ctx.progress, layer_image=layer_image)


def bundle_stage(ctx: StageContext) -> StageOutput:
    """Write ``staging/bundle.tar.zst`` from the source's tokenizer and config files."""
    from packer.bundle import run_bundle

    return run_bundle(ctx.snap.root, ctx.recipe.bundle, ctx.staging, rel_root=ctx.staging,
                      dry_run=ctx.dry_run)


def embedded_manifest(ctx: StageContext) -> dict[str, Any]:
    """The manifest the loader embeds: identity, the weights and bundle files and sections, runtime."""
    from packer.manifest import files_map

    weights, bundle = ctx.outputs["weights"], ctx.outputs.get("bundle")
    return {"name": ctx.recipe.name, "version": ctx.recipe.version,
            "files": files_map([*weights.files, *(bundle.files if bundle else ())]),
            "weights": weights.section, "bundle": bundle.section if bundle else None,
            "runtime": ctx.recipe.normalised()["runtime"]}


def loader_stage(ctx: StageContext) -> StageOutput:
    """Write ``staging/packer_loader.py`` with the embedded manifest."""
    from packer.stub import emit_loader

    return emit_loader(ctx.staging, embedded_manifest(ctx), rel_root=ctx.staging)


def _planned_files(ctx: StageContext) -> list[FileEntry]:
    """The artifact file names a dry run would write (sizes are not known yet)."""
    from packer.bundle import ARCHIVE_NAME
    from packer.components import artifact_files
    from packer.formats import LOADER_NAME

    names = [*artifact_files(ctx.outputs["weights"].section),
             *([ARCHIVE_NAME] if "bundle" in ctx.outputs else []), LOADER_NAME]
    return [FileEntry(p, 0, "") for p in names]


def image_stage(ctx: StageContext) -> StageOutput:
    """Write the OCI image and Dockerfile around the artifacts and ``staging/manifest.json``.

    A dry run plans the image from the planned file names. Otherwise the artifact manifest
    must already be in the staging directory; the build verifies the whole output once
    afterwards, so the image is not re-read here.
    """
    from packer.formats import MANIFEST_NAME
    from packer.oci import build_image

    common: dict[str, Any] = {"cfg": ctx.recipe.image, "name": ctx.recipe.name, "version": ctx.recipe.version,
                              "source": ctx.snap.identity()}
    if ctx.dry_run:
        return build_image(ctx.staging, **common, artifact_files=_planned_files(ctx), artifact_manifest=b"",
                           dry_run=True)
    return build_image(ctx.staging, **common, artifact_files=ctx.artifacts(),
                       artifact_manifest=(ctx.staging / MANIFEST_NAME).read_bytes(), verify=False,
                       known_digests=ctx.outputs["weights"].digests,
                       loader_paths=[f.path for f in ctx.outputs["loader"].files])


Stage = Callable[[StageContext], StageOutput]

STAGES: dict[str, Stage] = {"weights": weights_stage, "bundle": bundle_stage, "loader": loader_stage,
                            "image": image_stage}
"""The stages by name, in build order."""


def default_layer_digests() -> bool:
    """Whether to compute weight layer digests during conversion: with three cores or more."""
    return (os.cpu_count() or 1) >= 3
