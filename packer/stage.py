"""The stage contract: one :class:`StageContext` in, one :class:`StageOutput` out, one progress type.

Every stage of ``packer build`` is a :data:`Stage`, a function ``stage(ctx) -> StageOutput``.
This module defines the contract and imports no stage: the stages (``weights``, ``bundle``,
``stub``, ``oci``, ``sandbox``) import it, and the list that composes them
(:mod:`packer.build_stages`) sits above them.

Progress, everywhere on the build side, is :data:`Progress`: called with the number of bytes
just written (an increment; the sum of the calls is what the stage wrote).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packer.util.fsutil import FileEntry

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
        vouched: what the stage re-read and hashed itself, for the final verification (the
            weights stage's blobs: :data:`packer.oci.reread.Vouched`).
    """

    files: tuple[FileEntry, ...] = ()
    section: dict[str, Any] = field(default_factory=dict)
    bytes_processed: int = 0
    notes: tuple[str, ...] = ()
    digests: dict[str, str] = field(default_factory=dict)
    vouched: dict[str, Any] = field(default_factory=dict)


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
        layer_digests: the weights stage writes each weight layer blob (one copy of the weights).
        early: input hashes started before the stages (see :mod:`packer.building`).
        outputs: the earlier stages' outputs by stage name (``"weights"``, ``"bundle"``,
            ``"loader"``...); the build adds each one as its stage ends.
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
        """The artifact files written so far (weights, bundle, loader, signature), in that order."""
        return [f for name in ("weights", "bundle", "loader", "sign") if name in self.outputs
                for f in self.outputs[name].files]


Stage = Callable[[StageContext], StageOutput]
"""One build stage."""
