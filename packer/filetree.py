"""Helpers over files and trees that read what they are given: a link or copy of a file, a
tree's disk usage. Above :mod:`packer.reading`, whose checked open and bounded walk they use.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from packer.errors import PackerError
from packer.reading import open_regular, walk_tree
from packer.util.idents import ErrorClass

COPY_READ = 8 * 2**20  # a copy's read, when a link cannot be made


def link_or_copy(src: Path, dst: Path) -> None:
    """Make ``dst`` a hard link to ``src`` (a copy on another file system), atomically.

    The link or copy is made under a temporary name beside ``dst`` and renamed over it, so a
    reader never sees a partial ``dst``.
    """
    tmp = dst.with_name(f".{dst.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        os.link(src, tmp)
    except OSError:  # another file system, or links not allowed: copy instead
        with open_regular(src) as f, open(tmp, "xb") as out:
            shutil.copyfileobj(f, out, COPY_READ)
    os.replace(tmp, dst)


def disk_usage(root: Path, error: ErrorClass = PackerError) -> int:
    """Bytes ``root`` takes on disk, as ``du`` counts them: allocated blocks (sparse holes are free),
    each hard-linked file once, symlinks as links (never followed).

    Raises:
        error: the tree is deeper than the walk's cap or cannot be listed (:func:`walk_tree`).
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    for _rel, path, _mode in walk_tree(root, error=error):
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total + os.lstat(root).st_blocks * 512
