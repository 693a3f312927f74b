"""Staging directories and the atomic publish of a finished build.

A build writes into a hidden staging directory beside OUT. Publishing swaps it with OUT in one
``renameat2(RENAME_EXCHANGE)`` where the kernel offers it, so at every instant OUT is either the
previous complete build or the new one; elsewhere it falls back to two renames, which leaves OUT
absent for an instant but never half-written. Staging directories of builds that died are
removed by the next build.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import tempfile
from pathlib import Path

from packer.util.fsutil import remove_tree, umask

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _staging_re(out: Path) -> re.Pattern[str]:
    return re.compile(rf"^\.{re.escape(out.name)}\.packer-(?:staging|old|scratch)-(\d+)-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(out: Path) -> None:
    """Remove staging directories beside ``out`` left by builds whose process is gone."""
    pattern = _staging_re(out)
    with contextlib.suppress(FileNotFoundError):
        for entry in out.parent.iterdir():
            m = pattern.match(entry.name)
            if m and not _alive(int(m.group(1))):
                with contextlib.suppress(OSError):
                    remove_tree(entry)


def make_staging(out: Path) -> Path:
    """Create a fresh staging directory beside ``out`` (same file system, so renames work)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.packer-staging-{os.getpid()}-", dir=out.parent))


def make_scratch(out: Path) -> Path:
    """A scratch directory beside ``out`` (the generated demo source) that :func:`remove_stale`
    removes if this process dies before removing it itself."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.packer-scratch-{os.getpid()}-", dir=out.parent))


def _exchange(a: Path, b: Path) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)  # the C library this process runs on
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def publish(staging: Path, out: Path) -> None:
    """Move the complete ``staging`` directory to ``out``, replacing a previous build."""
    os.chmod(staging, 0o777 & ~umask())
    if not out.exists():
        os.rename(staging, out)
    elif out.is_dir() and not out.is_symlink() and _exchange(staging, out):
        remove_tree(staging)  # now holds the previous build (whatever tree it held)
    else:
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.packer-old-{os.getpid()}-", dir=out.parent))
        os.rename(out, old / "out")
        os.rename(staging, out)
        remove_tree(old)
    _fsync_dir(out.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

