"""Reproducible layer tar: PAX headers, sorted entries, fixed owner, modes and times.

Reproducibility is one explicit step here: :func:`tar_members` turns a list of files into
sorted members with every parent directory, fixed modes and owners; :func:`tar_pieces` turns
members into the byte stream, as header bytes plus :class:`FileRange` pieces that the layer
writer copies straight from disk (so file contents are never read whole into memory).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from packer.errors import ImageError
from packer.util.tarfmt import BLOCK, DIR_MODE, EXEC_MODE, FILE_MODE, PAD_KEY, header, padding

# PAX records packer may emit: long paths, sizes over 8 GiB and the comment of dots that
# aligns a weight file's data. Anything else (mtime, atime, ctime, xattrs, uname) would mean
# a non-reproducible field slipped in.
ALLOWED_PAX = frozenset({"path", "size", PAD_KEY})


@dataclass(frozen=True)
class Owner:
    """Numeric owner of every entry; names are always empty."""

    uid: int = 0
    gid: int = 0

    @classmethod
    def parse(cls, text: str) -> Owner:
        """Parse ``"uid:gid"`` (the recipe's ``image.owner``)."""
        uid, _, gid = text.partition(":")
        if not (uid.isdigit() and gid.isdigit()):
            raise ImageError(f"image.owner: expected a numeric 'uid:gid', got {text!r}")
        return cls(int(uid), int(gid))

    def __str__(self) -> str:
        return f"{self.uid}:{self.gid}"


@dataclass(frozen=True)
class TarMember:
    """One entry: a regular file (``source`` path or in-memory ``data``) or a directory."""

    name: str  # relative POSIX path inside the image, no leading or trailing slash
    is_dir: bool = False
    size: int = 0
    mode: int = FILE_MODE
    owner: Owner = Owner()
    source: Path | None = None
    data: bytes | None = None
    align: int = 0  # the data starts at a multiple of this in the layer (0: anywhere)


@dataclass(frozen=True)
class FileRange:
    """A piece of the tar stream that is ``size`` bytes of ``path`` (from offset 0)."""

    path: Path
    size: int


@dataclass(frozen=True)
class SourceFile:
    """What the plan puts in a layer: a destination path and where its bytes come from."""

    dest: str  # absolute path in the image, e.g. /opt/model/weights/model.safetensors
    size: int
    source: Path | None = None
    data: bytes | None = None
    executable: bool = False
    align: int = 0  # see TarMember.align


def tar_members(files: Sequence[SourceFile], *, owner: Owner, prefix: str) -> list[TarMember]:
    """Sorted members for ``files`` with every parent directory.

    Directories at or below ``prefix`` belong to ``owner``; the ones above it (``/opt``)
    stay ``0:0`` so a layer never changes the ownership of a base image's system dirs.

    Raises:
        ImageError: a path is not absolute, has ``..`` or appears twice.
    """
    prefix_parts = PurePosixPath(prefix).parts[1:]
    entries: dict[str, TarMember] = {}
    for f in files:
        p = PurePosixPath(f.dest)
        if not p.is_absolute() or ".." in p.parts or len(p.parts) < 2:
            raise ImageError(f"layer entry {f.dest!r}: expected an absolute path without '..'")
        name = p.relative_to("/").as_posix()
        if name in entries:
            raise ImageError(f"layer entry {f.dest!r}: appears twice")
        mode = EXEC_MODE if f.executable else FILE_MODE
        entries[name] = TarMember(name, False, f.size, mode, owner, f.source, f.data, f.align)
        for parent in p.relative_to("/").parents:
            key = parent.as_posix()
            if key == "." or key in entries:
                continue
            in_prefix = parent.parts[: len(prefix_parts)] == prefix_parts
            entries[key] = TarMember(key, True, 0, DIR_MODE, owner if in_prefix else Owner())
    return [entries[k] for k in sorted(entries)]


def encode_header(member: TarMember, *, mtime: int, at: int = 0) -> bytes:
    """The PAX header block(s) for ``member``, which start at byte ``at`` of the stream.

    A PAX extended header appears only when a field does not fit ustar (a path longer
    than ustar allows, a size of 8 GiB or more) or the member's data must be aligned
    (``member.align``). ``mtime`` must be an int: a float would silently add an ``mtime``
    PAX record.
    """
    if not isinstance(mtime, int) or mtime < 0:
        raise ImageError(f"tar mtime: expected a non-negative integer, got {mtime!r}")
    return header(member.name, size=member.size, mtime=mtime, is_dir=member.is_dir, mode=member.mode,
                  uid=member.owner.uid, gid=member.owner.gid, align=member.align, at=at)


def tar_pieces(members: Sequence[TarMember], *, mtime: int) -> Iterator[bytes | FileRange]:
    """The tar stream for ``members``: header bytes, file ranges, padding, end marker."""
    pos = 0
    for m in members:
        head = encode_header(m, mtime=mtime, at=pos)
        yield head
        pos += len(head)
        if m.is_dir or m.size == 0:
            continue
        pos += m.size + len(padding(m.size))
        if m.data is not None:
            yield m.data + padding(m.size)
        elif m.source is not None:
            yield FileRange(m.source, m.size)
            if pad := padding(m.size):
                yield pad
        else:
            raise ImageError(f"layer entry /{m.name}: no source for a {m.size}-byte file")
    yield b"\0" * (2 * BLOCK)


def tar_size(members: Sequence[TarMember], *, mtime: int) -> int:
    """Exact size of the uncompressed tar, computed without reading file contents."""
    total = 0
    for m in members:
        total += len(encode_header(m, mtime=mtime, at=total))
        if not m.is_dir:
            total += m.size + len(padding(m.size))
    return total + 2 * BLOCK
