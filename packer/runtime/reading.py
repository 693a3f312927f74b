"""The runtime's one way in: every byte the loader and the engine adapters read from a build.

A build on a serving node is input like any other: a mounted image, a shared cache, a
directory an engine was pointed at. So every read goes through here (``tests/
test_runtime_one_way_in.py`` fails on any other ``open``, ``json.load(s)`` or
``read_bytes``/``read_text`` under ``packer/runtime`` and ``packer/adapters``):

* regular files only, their type checked on the open descriptor before a byte is read; the open
  itself is non-blocking, so a FIFO is refused at once instead of waiting for a writer, and a
  link to ``/dev/zero`` is refused by type instead of read to the memory limit;
* a size cap per kind of file (:data:`CAPS`), checked on the descriptor before allocation;
* JSON with a depth cap checked before the parser runs (Python's parser recurses) and the top
  level's type checked;
* names and paths taken from a document checked against their grammar (:func:`check_rel`) and
  proven inside their root (:func:`inside`) before they are joined.

Every fault is an :class:`~packer.runtime.env.ArtifactMismatchError` naming the absolute path
and the reason. Standard library only: the runtime imports nothing from the build side (whose
own reading module has the same rules).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from .env import ArtifactMismatchError

KIB, MIB = 2**10, 2**20
CAPS = {
    "json": 64 * MIB,  # manifest.json, a safetensors index: a line per tensor at most
    "chunks": 256 * MIB,  # packer-chunks.json: 64 hex digits per MiB of weights (a 405B model: ~50 MB)
    "signature": 256 * MIB,  # model.sig, the provenance: a statement lists one line per file
    "key": 64 * KIB,  # a PEM public key
    "runtime": 4 * MIB,  # one packer_runtime/*.py file
    "stub": 512 * MIB,  # packer_loader.py: the manifest is embedded in it
}
MAX_DEPTH = 64  # JSON nesting: packer's documents use fewer than ten levels
_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
# a string, or an unterminated one up to the end: one left-to-right pass, whatever the input
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.S)  # unrolled: a long string in one run
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_BAD_NAME = re.compile(r"[\x00-\x1f\x7f\\]")


def _where(path: str | os.PathLike[str]) -> str:
    return os.path.abspath(os.fspath(path))


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of the regular file at ``path`` (links followed), type checked first.

    Weight files keep their ``mmap``/``pread`` fast path through this: the caller maps or reads
    the descriptor it returns.

    Raises:
        FileNotFoundError: nothing at ``path`` (the caller says where to look instead).
        ArtifactMismatchError: a FIFO, device, socket or directory, a link loop, or unreadable.
    """
    try:
        fd = os.open(path, _FLAGS)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ArtifactMismatchError(f"{_where(path)}: cannot be opened ({e.strerror or e})") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as e:
        os.close(fd)
        raise ArtifactMismatchError(f"{_where(path)}: cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ArtifactMismatchError(f"{_where(path)}: {_kind(mode)}; expected a regular file")
    return fd


class PositionalSource(Protocol):
    """Bytes read at a position from somewhere else than an open file (a registry blob,
    :class:`~packer.runtime.remote.RemoteFile`): each read is all of it, proven, or raises.

    A source may also have ``spans(at, n) -> [(start, length)]``: how a reader thread should cut
    a read of ``n`` bytes at ``at`` (starts relative to ``at``), where its reads have a cost of
    their own (one HTTP request each) and a grid (its chunks); :func:`pieces` uses it.
    """

    def read_at(self, view: memoryview, at: int) -> None: ...


def pieces(src: int | PositionalSource, at: int, n: int, piece: int) -> list[tuple[int, int]]:
    """``[(start, length)]`` (starts relative to ``at``) cutting a read of ``n`` bytes of ``src``
    for reader threads: the source's own ``spans`` where it has them, else ``piece`` bytes each."""
    spans = getattr(src, "spans", None)
    if spans is not None:
        return list(spans(at, n))
    return [(a, min(piece, n - a)) for a in range(0, n, piece)]


def read_at(src: int | PositionalSource, view: memoryview, at: int, where: str) -> None:
    """Fill ``view`` with the bytes at offset ``at`` of ``src``: an open file's descriptor
    (``os.preadv`` until full; it releases the GIL), or a :class:`PositionalSource`.

    Raises:
        ArtifactMismatchError: the file ends before ``at + len(view)`` (``<where>: truncated at
            byte N``); what a source raises.
    """
    if not isinstance(src, int):
        src.read_at(view, at)
        return
    got = 0
    while got < len(view):
        n = os.preadv(src, [view[got:]], at + got)
        if n <= 0:
            raise ArtifactMismatchError(f"{where}: truncated at byte {at + got}")
        got += n


def read_fd(fd: int, size: int, where: str) -> bytes:
    """Exactly ``size`` bytes from the start of the open file ``fd``."""
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = os.preadv(fd, [view[got:]], got)
        if n <= 0:
            raise ArtifactMismatchError(f"{where}: shrank to {got} bytes while being read")
        got += n
    return bytes(buf)


def read_bytes(path: str | os.PathLike[str], kind: str) -> bytes:
    """The whole regular file at ``path``, at most ``CAPS[kind]`` bytes, in one open.

    Raises:
        FileNotFoundError: nothing at ``path``.
        ArtifactMismatchError: not a regular file, over the cap, or unreadable.
    """
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > CAPS[kind]:
            raise ArtifactMismatchError(f"{_where(path)}: {size} bytes, over the cap of {CAPS[kind]} for a {kind} file")
        return read_fd(fd, size, _where(path))
    finally:
        os.close(fd)


def read_kernel_text(path: str, cap: int = 64 * 1024) -> str | None:
    """A kernel's text file (``/proc``, ``/sys``: their size says 0 or a page, so it is read to
    its end), at most ``cap`` bytes; None where it does not exist or cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        data = b""
        while len(data) < cap:
            piece = os.read(fd, cap - len(data))
            if not piece:
                break
            data += piece
        return data.decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def too_deep(data: bytes, max_depth: int) -> bool:
    """Whether JSON ``data`` nests arrays and objects deeper than ``max_depth`` (or is unbalanced).

    Strings do not count; linear in size x depth. The build side's ``packer.reading`` uses this
    same function (the runtime imports nothing from the build side; the build side may import it).
    """
    brackets = _STRINGS.sub(b"", data).translate(None, _NOT_BRACKETS)
    for _ in range(max_depth):  # each pass removes the innermost level: linear in size x depth
        if not brackets:
            break
        brackets = brackets.replace(b"[]", b"").replace(b"{}", b"")
    return bool(brackets)


def loads_json(raw: bytes | str, where: str, *, top: type = dict, max_depth: int = MAX_DEPTH) -> Any:
    """Parse JSON after checking its nesting depth (strings do not count), and its top level's type.

    Raises:
        ArtifactMismatchError: nested deeper than ``max_depth`` or unbalanced, not JSON, or
            its top level not a ``top``.
    """
    data = raw.encode() if isinstance(raw, str) else raw
    if too_deep(data, max_depth):
        raise ArtifactMismatchError(f"{where}: arrays and objects nested deeper than {max_depth} levels "
                                    "(or unbalanced)")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ArtifactMismatchError(f"{where}: not JSON ({e})") from None
    if not isinstance(doc, top):
        raise ArtifactMismatchError(f"{where}: expected a JSON {'object' if top is dict else top.__name__}, "
                                    f"got {type(doc).__name__}")
    return doc


def read_json(path: str | os.PathLike[str], kind: str = "json", *, top: type = dict) -> Any:
    """The JSON document at ``path``: :func:`read_bytes` then :func:`loads_json`."""
    return loads_json(read_bytes(path, kind), _where(path), top=top)


def sha256_regular(path: str | os.PathLike[str], bufsize: int = 8 * MIB) -> tuple[int, str]:
    """``(size, sha256 hex)`` of the regular file at ``path``, streamed (no cap: nothing is kept).

    Raises:
        FileNotFoundError: nothing at ``path``.
        ArtifactMismatchError: not a regular file, or unreadable.
    """
    fd = open_regular(path)
    try:
        size, h = os.fstat(fd).st_size, hashlib.sha256()
        buf = bytearray(min(bufsize, max(size, 1)))
        view, off = memoryview(buf), 0
        while off < size:
            n = os.preadv(fd, [view[: min(len(buf), size - off)]], off)
            if n <= 0:
                raise ArtifactMismatchError(f"{_where(path)}: shrank to {off} bytes while being read")
            h.update(view[:n])
            off += n
        return size, h.hexdigest()
    finally:
        os.close(fd)


def check_rel(name: Any, where: str) -> str:
    """``name`` (from a document) if it is a plain relative POSIX path inside its directory.

    Raises:
        ArtifactMismatchError: not a string, empty, absolute, with ``..``, ``.`` or empty
            parts, a backslash or a control character.
    """
    if not isinstance(name, str) or not name or _BAD_NAME.search(name):
        raise ArtifactMismatchError(f"{where}: {name!r} is not a plain relative path")
    p = PurePosixPath(name)
    if p.is_absolute() or p.as_posix() != name or any(part in ("..", ".") for part in p.parts):
        raise ArtifactMismatchError(f"{where}: {name!r} is not a relative path inside its directory")
    return name


def inside(root: str | os.PathLike[str], name: Any, where: str) -> Path:
    """``root / name`` for a ``name`` from a document, proven inside ``root`` once links are followed.

    Raises:
        ArtifactMismatchError: ``name`` fails :func:`check_rel`, or leads outside ``root``
            (through a link) or into a link loop.
    """
    rel = check_rel(name, where)
    path = Path(root) / rel
    try:
        top = os.path.realpath(root, strict=True)
        real = os.path.realpath(path)
    except OSError as e:
        raise ArtifactMismatchError(f"{where}: {_where(path)}: {e.strerror or e}") from None
    if os.path.commonpath([top, real]) != top:
        raise ArtifactMismatchError(f"{where}: {_where(path)} leads outside {top}")
    return path


def resolve(path: str | os.PathLike[str]) -> Path:
    """``path`` with every link followed, for a path found on disk (a weight link).

    Raises:
        FileNotFoundError: a dangling link.
        ArtifactMismatchError: a link loop or another fault.
    """
    try:
        return Path(os.path.realpath(path, strict=True))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ArtifactMismatchError(f"{_where(path)}: {e.strerror or e}") from None


def is_regular(path: str | os.PathLike[str]) -> bool:
    """Whether a regular file is at ``path`` (False: nothing there).

    Raises:
        ArtifactMismatchError: something else is there (a FIFO, a device, a link loop...).
    """
    try:
        os.close(open_regular(path))
    except FileNotFoundError:
        return False
    return True


def entry_kind(path: str | os.PathLike[str]) -> str:
    """What is at ``path`` once links are followed: ``file``, ``dir``, ``missing`` or ``other``.

    Raises:
        ArtifactMismatchError: a link loop or another fault than a missing target.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        raise ArtifactMismatchError(f"{_where(path)}: {e.strerror or e}") from None
    return "file" if stat.S_ISREG(mode) else "dir" if stat.S_ISDIR(mode) else "other"


MAX_TREE_DEPTH = 64  # folders below a root: a bundle's reader allows fewer; a hostile tree has 1,100


def walk_tree(root: str | os.PathLike[str], *, max_depth: int = MAX_TREE_DEPTH) -> list[tuple[str, Path, int]]:
    """Every entry below the folder ``root``, iteratively (no recursion), links never followed.

    Args:
        root: the folder; max_depth: how many folder levels below it may hold entries.

    Returns:
        ``(relative posix path, path, lstat mode)`` of each entry, sorted by path; a folder's
        contents follow it; a link (to a folder too) is one entry, never entered.

    Raises:
        ArtifactMismatchError: a folder deeper than ``max_depth`` (one line naming it and the
            cap), or a folder that cannot be listed.
    """
    top = Path(root)
    out: list[tuple[str, Path, int]] = []
    stack: list[tuple[str, Path, int]] = [("", top, 0)]
    while stack:
        rel_dir, folder, depth = stack.pop()
        if depth > max_depth:
            raise ArtifactMismatchError(f"{_where(folder)}: folders nested deeper than {max_depth} levels "
                                        f"below {_where(top)}; remove the tree or point at another folder")
        try:
            with os.scandir(folder) as it:
                entries = [(e.name, e.stat(follow_symlinks=False).st_mode) for e in it]
        except OSError as e:
            raise ArtifactMismatchError(f"{_where(folder)}: cannot be listed ({e.strerror or e})") from None
        for name, mode in entries:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            out.append((rel, folder / name, mode))
            if stat.S_ISDIR(mode):
                stack.append((rel, folder / name, depth + 1))
    return sorted(out)
