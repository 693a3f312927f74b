"""The bundle plan: which files go into the archive under which names (a frozen value, no I/O).

:func:`packer.bundle.select.plan_bundle` makes it; the tar and zstd writers consume it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from packer.util import tarfmt

FILE_MODE, DIR_MODE = tarfmt.FILE_MODE, tarfmt.DIR_MODE


@dataclass(frozen=True)
class BundleMember:
    """One file of the plan: its archive name, the real file it comes from, size and mode."""

    name: str
    source: Path
    size: int
    mode: int = FILE_MODE


@dataclass(frozen=True)
class BundlePlan:
    """What goes into the bundle, sorted by name, and what was left out and why."""

    src: Path
    members: tuple[BundleMember, ...]
    skipped: tuple[tuple[str, str], ...] = ()
    code: tuple[str, ...] = ()  # members carried because auto_map names them (never run by packer)
    code_elsewhere: tuple[str, ...] = ()  # auto_map references to code in other repositories
    code_left_out: bool = False  # bundle.remote_code = false left named code files out

    @property
    def dirs(self) -> tuple[str, ...]:
        """Every parent directory of a member, sorted (each is written to the archive)."""
        found = {"/".join(m.name.split("/")[:i]) for m in self.members for i in range(1, m.name.count("/") + 1)}
        return tuple(sorted(found))

    @property
    def total_size(self) -> int:
        return sum(m.size for m in self.members)
