"""Where extracted bundles live: a content-addressed cache, one folder per archive's sha256
(and, beside them, the model directories ``model_dir()`` makes).

A folder appears there only through a rename, complete (``bundle_reader.extract_cached``
writes it), so every start after the first finds its bundle here with a ``stat`` and never imports
the reader (nor zstandard): the stub compiles every runtime module it imports from its checked
source at each start. What the folder holds is checked by ``served.check_extracted``.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def cache_root(root: str | os.PathLike[str] | None) -> Path:
    """The cache directory ``root`` (default :func:`private_root`), made when missing.

    Raises:
        OSError: it cannot be made; PermissionError: the default one is not private.
    """
    base = Path(root) if root is not None else private_root()
    base.mkdir(parents=True, exist_ok=True)
    return base


def private_root() -> Path:
    """``$XDG_CACHE_HOME/packer/bundles-<uid>`` (``~/.cache`` by default): on disk, where a build
    usually lies too; else ``/dev/shm/packer-bundles-<uid>``, else the temp directory's.

    The model directory (``model_dir()``) is made beside the extracted bundles, and a weight file
    a build holds only inside its layer blob is materialized there: on disk it costs disk, not
    memory (tmpfs is RAM), and on the build's own btrfs or XFS the kernel shares its extents (no
    second copy). The first candidate that can be made is used (a container's read-only home
    falls through to ``/dev/shm``); wherever it is, a folder found there is trusted only as a
    private directory of this user, and what it holds is checked by ``served``.

    Raises:
        PermissionError: the folder exists but is not a private directory of this user (or its
            parent can be changed by another), or no writable place was found.
    """
    uid = os.getuid()
    for parent, name in _candidates():
        base = parent / f"{name}-{uid}"
        try:
            parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.mkdir(base, 0o700)
        except FileExistsError:
            pass
        except OSError:
            continue
        _check_private(base, uid)
        return base
    raise PermissionError("no writable cache, /dev/shm or temp directory for bundles; pass root=")


def _candidates() -> list[tuple[Path, str]]:
    """``(folder, name)`` in order of preference; the folder is made when missing."""
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    first = [(Path(home) / "packer", "bundles")] if os.path.isabs(home) else []  # "~" unresolved: no home
    return [*first, (Path("/dev/shm"), "packer-bundles"), (Path(tempfile.gettempdir()), "packer-bundles")]


def _check_private(base: Path, uid: int) -> None:
    """``base`` is a directory (not a link) of ``uid`` that no one else can write, in a parent
    that no one else can change (theirs or root's, not writable by others unless sticky)."""
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o022:
        raise PermissionError(f"{base}: not a private directory of uid {uid}; pass root=")
    up = os.stat(base.parent)
    if up.st_uid not in (uid, 0) or (up.st_mode & 0o022 and not up.st_mode & stat.S_ISVTX):
        raise PermissionError(f"{base.parent}: can be changed by another user; pass root=")


def cached(base: Path, sha256: str) -> Path | None:
    """The extracted folder of the archive whose digest is ``sha256`` in ``base``, if there."""
    final = base / sha256.lower()
    return final if is_dir(final) else None


def is_dir(path: Path) -> bool:
    """A directory itself, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False
