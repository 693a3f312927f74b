"""What every build stage returns: the files it wrote and its manifest section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from packer.fsutil import FileEntry


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
