"""``packer unbundle``: a bundle's files extracted into a new directory, all or nothing.

The archive is read and every member written by the runtime reader
(:meth:`packer.runtime.bundle_reader.Bundle.extract`, the emitted loader's own code) into a
temporary directory beside the destination, renamed into place only when complete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from packer.errors import BundleError
from packer.reading import check_regular
from packer.runtime import bundle_reader as reader
from packer.util.fsutil import umask
from packer.util.tarfmt import DIR_MODE


def unbundle(archive: Path, dest: Path) -> list[str]:
    """``packer unbundle ARCHIVE -o DIR``: validate, extract beside DIR, rename into place.

    Args:
        archive: a bundle archive.
        dest: a directory that does not exist or is empty.

    Returns:
        the extracted file names, sorted.

    Raises:
        BundleError: the archive is malformed, hostile or over a cap, or ``dest`` is not empty.
    """
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or dest.is_symlink() or any(dest.iterdir())):
        raise BundleError(f"{dest}: exists and is not an empty directory; choose a new -o")
    try:
        check_regular(archive, BundleError)
        bundle = reader.Bundle.open(archive)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    except reader.BundleFormatError as e:
        raise BundleError(str(e)) from e
    except OSError as e:
        raise BundleError(f"{archive}: {e.strerror or e}") from e
    try:
        bundle.extract(tmp)
        os.chmod(tmp, DIR_MODE & ~umask())
        os.rename(tmp, dest)  # replaces an empty directory, fails on a non-empty one
    except OSError as e:
        raise BundleError(f"{dest}: cannot extract {archive}: {e.strerror or e}") from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return bundle.names()
