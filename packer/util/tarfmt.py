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

BLOCK = 512
FILE_MODE = 0o644
EXEC_MODE = 0o755
DIR_MODE = 0o755


def source_date_epoch(error: type[Exception]) -> int:
    """``SOURCE_DATE_EPOCH`` as an int, 0 when unset; the caller's ``error`` class when it is not one."""
    raw = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if not raw:
        return 0
    if not raw.isdigit() or int(raw) >= 8**11:
        raise error(f"SOURCE_DATE_EPOCH: expected a non-negative integer of seconds, got {raw!r}")
    return int(raw)


PAD_KEY = "comment"  # the PAX record that pads a header: readers ignore comments (POSIX)


def header(name: str, *, size: int, mtime: int, is_dir: bool = False, mode: int | None = None,
           uid: int = 0, gid: int = 0, pax: bool = True, align: int = 0, at: int = 0) -> bytes:
    """The header block(s) of one regular file or directory.

    With ``align`` (a multiple of :data:`BLOCK`), a PAX ``comment`` record of dots pads the
    header so that the member's data starts at a multiple of ``align`` in the stream, given
    that the header starts at byte ``at``: the data can then be mapped in place.

    Raises:
        ValueError: ``pax`` is false and ustar cannot hold the name or size, or a bad ``align``.
    """
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    info.size = 0 if is_dir else size
    info.mode = mode if mode is not None else (DIR_MODE if is_dir else FILE_MODE)
    info.uid, info.gid = uid, gid
    info.uname = info.gname = ""
    info.mtime = mtime
    if not align:
        return info.tobuf(tarfile.PAX_FORMAT if pax else tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")
    if not pax or align % BLOCK or at % BLOCK:
        raise ValueError(f"tar header alignment {align} at {at}: needs PAX and whole blocks")
    return _padded(info, align, at)


def _padded(info: tarfile.TarInfo, align: int, at: int) -> bytes:
    """``info``'s PAX header whose end lies at a multiple of ``align`` (counting from ``at``).

    The length grows in whole blocks as the comment grows: the shortest comment that reaches
    the smallest such end is found by bisection, so the bytes are the same on every run.
    """

    def buf(n: int) -> bytes:
        info.pax_headers = {PAD_KEY: "." * n}
        return info.tobuf(tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")

    least = len(buf(0))
    target = least + (-(at + least) % align)
    lo, hi = 0, target
    while lo < hi:  # the smallest n whose header is at least ``target`` long
        mid = (lo + hi) // 2
        if len(buf(mid)) < target:
            lo = mid + 1
        else:
            hi = mid
    out = buf(lo)
    info.pax_headers = {}
    if len(out) != target:  # cannot happen: each length in blocks is reached by some n
        raise ValueError(f"tar header of {info.name!r}: cannot pad to {align}")
    return out


def padding(size: int) -> bytes:
    """Zero bytes that round ``size`` up to a whole tar block."""
    return b"\0" * (-size % BLOCK)
