"""Reproducible tar primitives shared by the bundle and the image layers.

Both write sorted entries with integer mtimes, uid/gid from the caller with empty names and
fixed modes; only the header format differs: the bundle writes ustar and falls back to a PAX
``path`` record only for a name ustar cannot hold (its reader accepts ``path`` for such names
alone), image layers use PAX where ustar cannot hold a field (paths over 100 bytes or not
ASCII, sizes of 8 GiB or more).
"""

from __future__ import annotations

import os
import tarfile

from packer.errors import PackerError

BLOCK = 512
FILE_MODE = 0o644
EXEC_MODE = 0o755
DIR_MODE = 0o755


def source_date_epoch(error: type[PackerError] = PackerError) -> int:
    """``SOURCE_DATE_EPOCH`` as an int, 0 when unset; ``error`` when it is not one."""
    raw = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if not raw:
        return 0
    if not raw.isdigit() or int(raw) >= 8**11:
        raise error(f"SOURCE_DATE_EPOCH: expected a non-negative integer of seconds, got {raw!r}")
    return int(raw)


def header(name: str, *, size: int, mtime: int, is_dir: bool = False, mode: int | None = None,
           uid: int = 0, gid: int = 0, pax: bool = True) -> bytes:
    """The header block(s) of one regular file or directory.

    Raises:
        ValueError: ``pax`` is false and ustar cannot hold the name or size.
    """
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    info.size = 0 if is_dir else size
    info.mode = mode if mode is not None else (DIR_MODE if is_dir else FILE_MODE)
    info.uid, info.gid = uid, gid
    info.uname = info.gname = ""
    info.mtime = mtime
    return info.tobuf(tarfile.PAX_FORMAT if pax else tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")


def padding(size: int) -> bytes:
    """Zero bytes that round ``size`` up to a whole tar block."""
    return b"\0" * (-size % BLOCK)
