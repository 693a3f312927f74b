"""Where extracted bundles live: a content-addressed cache, one folder per archive's sha256.

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
    """``/dev/shm/packer-bundles-<uid>`` (tmpfs) when usable, else under the temp dir.

    Raises:
        PermissionError: the folder exists but is not a private directory of this user, or
            no writable place was found.
    """
    uid = os.getuid()
    for parent in ("/dev/shm", tempfile.gettempdir()):
        base = Path(parent) / f"packer-bundles-{uid}"
        try:
            os.mkdir(base, 0o700)
        except FileExistsError:
            pass
        except OSError:
            continue
        st = os.lstat(base)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o022:
            raise PermissionError(f"{base}: not a private directory of uid {uid}; pass root=")
        return base
    raise PermissionError("no writable /dev/shm or temp directory for bundles; pass root=")


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
