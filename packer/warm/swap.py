"""Renames that publish a staged warm state into OUT, undone in reverse when one fails.

``packer warm`` builds the new state and its image's blobs in a staging directory inside
OUT (the same file system, so every step is a rename), then moves them in with a
:class:`Renames` journal: a failure anywhere puts back every path it had moved, and OUT is
as it was. Nothing is moved through a link: :func:`packer.warm.pins.plain_dir` first.
"""

from __future__ import annotations

import os
from pathlib import Path

from packer.errors import WarmStateError
from packer.util.show import show


class Renames:
    """A journal of renames (and new directories), each undone in reverse by :meth:`undo`."""

    def __init__(self) -> None:
        self._done: list[tuple[str, Path, Path]] = []

    def mkdir(self, path: Path) -> None:
        """Make the new directory ``path`` (undone: removed, when still empty)."""
        os.mkdir(path)
        self._done.append(("mkdir", path, path))

    def move(self, src: Path, dst: Path) -> None:
        """Rename ``src`` to ``dst``, which must not exist.

        Raises:
            WarmStateError: ``dst`` exists (appeared since it was checked).
        """
        if os.path.lexists(dst):
            raise WarmStateError(f"{show(str(dst))}: appeared while packer warm was publishing; nothing was changed")
        os.rename(src, dst)
        self._done.append(("move", src, dst))

    def replace(self, src: Path, dst: Path, keep: Path) -> None:
        """Replace the file ``dst`` by ``src`` in one rename, the old one kept (hard-linked) as ``keep``."""
        os.link(dst, keep, follow_symlinks=False)
        os.replace(src, dst)
        self._done.append(("replace", keep, dst))

    def undo(self) -> None:
        """Put back every path changed, the last first."""
        while self._done:
            kind, src, dst = self._done.pop()
            if kind == "mkdir":
                os.rmdir(dst)
            elif kind == "move":
                os.rename(dst, src)
            else:
                os.replace(src, dst)
