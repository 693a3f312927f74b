"""The bundle's tar stream: ustar headers (a PAX ``path`` record only where ustar cannot hold
the name), member bytes hashed as they are copied, and the stream's exact size up front.

The zstd frame around it needs that size before the first byte (the frame records it), and
the plan's checks need it to refuse a bundle over the reader's cap before anything is written.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from packer.bundle.plan import BundleMember, BundlePlan
from packer.errors import BundleError
from packer.reading import open_regular
from packer.util import tarfmt

_CHUNK = 1 << 20

Headers = list[tuple[bytes, BundleMember | None]]
"""Every entry's header bytes in archive order, with its member (None for a directory)."""


@dataclass(frozen=True)
class MemberDigest:
    """A member as written: name, size, sha256 (hex)."""

    name: str
    size: int
    sha256: str


def ustar_header(name: str, *, size: int, mtime: int, is_dir: bool) -> bytes:
    """One ustar header, uid/gid 0; a name ustar cannot hold (over 100 bytes with no '/' to
    split at, or over 255) gets a PAX ``path`` record before it, as reproducible as the rest."""
    try:
        return tarfmt.header(name, size=size, mtime=mtime, is_dir=is_dir, pax=False)
    except ValueError:
        return tarfmt.header(name, size=size, mtime=mtime, is_dir=is_dir, pax=True)


def _padding(size: int) -> int:
    return len(tarfmt.padding(size))


def headers(plan: BundlePlan, mtime: int) -> Headers:
    """Every entry's header bytes, in archive order, computed before anything is written."""
    entries = sorted([(d + "/", None) for d in plan.dirs] + [(m.name, m) for m in plan.members], key=lambda e: e[0])
    out: Headers = []
    for name, member in entries:
        if member is None:
            out.append((ustar_header(name[:-1], size=0, mtime=mtime, is_dir=True), None))
        else:
            out.append((ustar_header(name, size=member.size, mtime=mtime, is_dir=False), member))
    return out


def tar_size(plan: BundlePlan, entries: Headers | None = None) -> int:
    """The exact tar stream size (header lengths do not depend on the mtime's value)."""
    entries = headers(plan, 0) if entries is None else entries
    return sum(len(h) for h, _ in entries) + sum(m.size + _padding(m.size) for m in plan.members) + 1024


def copy_member(member: BundleMember, out: Any) -> MemberDigest:
    """Copy one member's bytes and padding to ``out``, hashing them; its source must not change size."""
    h, left = hashlib.sha256(), member.size
    with open_regular(member.source, BundleError) as f:
        while left and (chunk := f.read(min(left, _CHUNK))):
            h.update(chunk)
            out.write(chunk)
            left -= len(chunk)
        if left or f.read(1):
            raise BundleError(f"{member.source}: changed size while being bundled; retry")
    out.write(bytes(_padding(member.size)))
    return MemberDigest(member.name, member.size, h.hexdigest())
