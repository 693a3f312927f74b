"""One way in (build side): every byte packer reads from an input enters through here.

An input is anything packer did not write in this process: a source directory or hub
snapshot, a recipe, a checkpoint's companion JSON files, an OUT handed to ``verify``, ``push``
or ``profile``, a base image layout, a public key, a cache. The rules, each in one place:

* **Regular files only**, checked before any blocking open (:func:`check_regular`,
  :func:`open_regular`): a FIFO, socket or device is refused, never waited on or read.
* **A size cap per kind of file** (:class:`Kind`: JSON documents, text, keys...), checked on
  the open descriptor before anything is read into memory, and again on what was read (a
  file that grows meanwhile).
* **JSON parsed with a depth cap** (:func:`parse_json`; Python's parser recurses, so a deep
  document would end in ``RecursionError``) and, where a shape is given, checked against it
  (:mod:`packer.util.jsonshape`).
* **Identifiers before paths**: a digest becomes a path only through :func:`blob_path` (the
  digest grammar), a name only through :func:`member` (the name grammar and the confinement
  check of :mod:`packer.util.idents`).

Weight bytes stay fast: :func:`map_readonly` hands out a descriptor and a read-only mmap of a
checked regular file, for the readers that ``pread`` or slice it.

Every function raises the caller's :class:`~packer.errors.PackerError` subclass; OSError
from a missing or unreadable file is the caller's to word, except where noted.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packer.errors import PackerError
from packer.runtime.env import ArtifactMismatchError
from packer.runtime.reading import MAX_TREE_DEPTH, too_deep  # the one nesting rule, shared with the runtime
from packer.runtime.reading import walk_tree as _walk_tree
from packer.util.idents import ErrorClass, check_rel_name, confined, digest_parts, is_commit, shown
from packer.util.jsonshape import Shape, check_shape

# a string, or an unterminated one up to the end: one left-to-right pass, whatever the input
MAX_REF_FILE = 4096  # a hub ref file holds 40 hex digits and a newline


@dataclass(frozen=True)
class Kind:
    """A kind of input file and its bounds.

    Attributes:
        name: how a message names it ("JSON document", "public key").
        max_bytes: the largest file read into memory.
        max_depth: how deep arrays and objects may nest (JSON kinds).
    """

    name: str
    max_bytes: int
    max_depth: int = 64


# layout files a library writes (model_index.json, modules.json, adapter_config.json): a few hundred bytes
MARKER = Kind("layout file", 1 << 20, 32)
# a checkpoint index, ties.json, config-like files: a weight_map of 100k tensors is ~10 MB
JSON_DOC = Kind("JSON document", 64 << 20, 64)
# OUT/manifest.json lists every file and tensor of a build
MANIFEST = Kind("manifest", 256 << 20, 64)
# OCI documents (index.json, image manifests, configs): the registries' manifest limit; they
# nest 5 deep, extensions get room, a parser bomb does not
OCI_DOC = Kind("OCI document", 4 << 20, 32)
# a Sigstore bundle or model signature: an envelope around a statement listing every file
SIGNATURE = Kind("signature file", 64 << 20, 32)
KEY = Kind("PEM key file", 64 << 10, 0)
TEXT = Kind("text file", 1 << 20, 0)
# one line of a child process's JSON report (the loader's stage table, the sandbox's reply)
REPORT = Kind("JSON report", 1 << 30, 64)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def file_kind(mode: int) -> str:
    """What ``mode`` (``st_mode``) describes, in words: ``"a regular file"``, ``"a FIFO (named pipe)"``..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def not_regular(path: str | Path, mode: int, error: ErrorClass) -> Exception:
    """The one-line refusal of an input that is not a regular file (``mode`` says what it is)."""
    return error(f"{path}: is {file_kind(mode)}, not a regular file; packer reads only regular files "
                 "(a FIFO, device or socket could block or never end): copy the data into a file")


def check_regular(path: str | Path, error: ErrorClass = PackerError) -> os.stat_result:
    """``os.stat(path)`` (links followed), refusing anything but a regular file before it is opened.

    Raises:
        error: ``path`` is a directory, FIFO, socket or device (:func:`not_regular`).
        OSError: ``path`` cannot be stat'ed (missing...).
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(path, st.st_mode, error)
    return st


def open_regular(path: str | Path, error: ErrorClass = PackerError) -> io.BufferedReader:
    """Open an input file for reading, refusing anything but a regular file without blocking.

    The type is checked before the open (a device is never opened), and again on the open
    descriptor: the open itself is non-blocking, so a FIFO swapped in between returns at once
    and is refused instead of waiting for a writer.

    Raises:
        error: not a regular file (:func:`not_regular`).
        OSError: missing or unreadable.
    """
    check_regular(path, error)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(path, mode, error)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def map_readonly(path: str | Path, error: ErrorClass = PackerError) -> tuple[int, mmap.mmap | None, int]:
    """``(fd, read-only mmap or None when empty, size)`` of the regular file ``path``.

    The caller owns both: it closes the mapping and the descriptor (``os.close``).

    Raises:
        error: not a regular file; OSError: missing or unreadable.
    """
    with open_regular(path, error) as f:
        fd = os.dup(f.fileno())
    try:
        size = os.fstat(fd).st_size
        return fd, (mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else None), size
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | Path, kind: Kind, *, error: ErrorClass, where: str | None = None,
               what: str = "") -> bytes:
    """The whole of the regular file ``path``, refused before reading when over ``kind``'s cap.

    Args:
        path: the file; ``kind``: its bounds; ``where``: how messages name it (default ``path``);
        what: what it is, for an unreadable file ("``key.pem: cannot read the signing key (...)``").

    Raises:
        error: not a regular file, larger than ``kind.max_bytes``, or unreadable (the message
            names the file and the reason).
    """
    where = str(path) if where is None else where
    try:
        with open_regular(path, error) as f:
            size = os.fstat(f.fileno()).st_size
            if size > kind.max_bytes:
                raise _too_large(where, size, kind, error)
            raw = f.read(kind.max_bytes + 1)
    except OSError as e:
        raise error(f"{where}: cannot read{' ' + what if what else ''} ({e.strerror or e})") from e
    if len(raw) > kind.max_bytes:  # it grew after the check
        raise _too_large(where, len(raw), kind, error)
    return raw


def _too_large(where: str, size: int, kind: Kind, error: ErrorClass) -> Exception:
    return error(f"{where}: {size} bytes, over the limit of {kind.max_bytes} for a {kind.name}")


def read_text(path: str | Path, kind: Kind = TEXT, *, error: ErrorClass, where: str | None = None) -> str:
    """:func:`read_bytes` decoded as UTF-8; bytes that are not UTF-8 are ``error``."""
    where = str(path) if where is None else where
    raw = read_bytes(path, kind, error=error, where=where)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text (byte {e.start})") from None


def read_json(path: str | Path, kind: Kind = JSON_DOC, *, error: ErrorClass, shape: Shape | None = None,
              where: str | None = None) -> Any:
    """The JSON document in ``path``: :func:`read_bytes`, :func:`parse_json`, then ``shape`` checked.

    Raises:
        error: see :func:`read_bytes` and :func:`parse_json`; a fault against ``shape``.
    """
    where = str(path) if where is None else where
    return parse_json(read_bytes(path, kind, error=error, where=where), kind, where=where, error=error,
                      shape=shape)


def parse_json(raw: bytes | str, kind: Kind | None = None, *, where: str, error: ErrorClass,
               max_bytes: int | None = None, max_depth: int | None = None, shape: Shape | None = None,
               object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
               parse_int: Callable[[str], Any] | None = None) -> Any:
    """Parse ``raw`` after checking its size and nesting depth, then check ``shape``.

    Args:
        raw: the document (bytes, or text already decoded).
        kind: its bounds; ``max_bytes`` / ``max_depth`` override them (one of the two is needed).
        where: how messages name the document; ``error``: the caller's error class.
        shape: when given, the document must have it (:func:`packer.util.jsonshape.check_shape`).
        object_pairs_hook, parse_int: passed to :func:`json.loads` (what they raise propagates).

    Raises:
        error: larger than the cap, nested deeper than the cap or unbalanced, not UTF-8 JSON,
            or not of ``shape``. Never ``RecursionError``.
    """
    limit = max_bytes if max_bytes is not None else kind.max_bytes if kind else None
    depth = max_depth if max_depth is not None else kind.max_depth if kind else None
    if limit is None or depth is None:
        raise TypeError("parse_json needs a kind or both max_bytes and max_depth")
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if len(data) > limit:
        raise error(f"{where}: {len(data)} bytes, over the limit of {limit} for this document")
    if too_deep(data, depth):
        raise error(f"{where}: arrays and objects nested deeper than {depth} levels (or unbalanced)")
    try:
        doc = json.loads(raw, object_pairs_hook=object_pairs_hook, parse_int=parse_int)
    except (ValueError, RecursionError) as e:
        raise error(f"{where}: not JSON: {e}") from None
    if shape is not None:
        check_shape(doc, shape, where=where, error=error)
    return doc


def blob_path(image_dir: Path, digest: object, *, where: object, error: ErrorClass,
              algorithms: Sequence[str] = ("sha256",)) -> Path:
    """``image_dir/blobs/<algorithm>/<hex>`` for a digest taken from a document.

    Args:
        image_dir: an OCI image layout directory.
        digest: the descriptor's ``digest`` value, unchecked.
        where: the document (and field) it came from, for the message.
        algorithms: the algorithms accepted (packer writes sha256 only).

    Raises:
        error: ``digest`` is not ``algorithm:hex`` of an accepted algorithm (``sha256:../../x``,
            a number, upper-case hex...): it never becomes a path.
    """
    parts = digest_parts(digest)
    if parts is None or parts[0] not in algorithms:
        raise error(f"{where}: {shown(digest)} is not a digest ({' or '.join(algorithms)}:<lowercase hex>)")
    return image_dir / "blobs" / parts[0] / parts[1]


def member(root: Path, name: object, *, where: object, error: ErrorClass,
           roots: Sequence[Path] | None = None) -> Path:
    """``root / name`` for a relative file name taken from a document, proven inside ``roots``.

    Args:
        root: the directory the name is relative to.
        name: the name as the document gives it (``unet/config.json``), unchecked.
        where: the document it came from, for the message.
        roots: where the joined path may lead once links are followed (default: ``root``).

    Raises:
        error: ``name`` is not a plain relative name (:func:`packer.util.idents.check_rel_name`), or
            the joined path leads outside ``roots`` (:func:`packer.util.idents.confined`).
    """
    rel = check_rel_name(name, where=str(where), error=error)
    path = root / rel
    confined(path, roots if roots is not None else (root,), error=error, what=f"{shown(name)} named in {where}",
             hint="name a file inside the directory")
    return path


def read_ref_file(path: Path, *, where: str, error: ErrorClass) -> str:
    """The commit hash a hub cache's ``refs/<name>`` file holds (surrounding whitespace allowed).

    Raises:
        error: the file is not a regular file, unreadable, too large, or holds anything but one
            commit hash (a path into another repository, an absolute path...); the message names the file.
    """
    try:
        with open_regular(path, error) as f:
            raw = f.read(MAX_REF_FILE + 1)
    except OSError as e:
        raise error(f"{where}: cannot read {path}: {e.strerror or e}") from e
    text = raw.decode("ascii", "replace").strip()
    if len(raw) > MAX_REF_FILE or not is_commit(text):
        raise error(f"{where}: {path} does not hold a commit hash (40 hex digits), got {shown(text)}; "
                    "delete it and download the model again")
    return text


def walk_tree(root: str | Path, *, error: ErrorClass, max_depth: int = MAX_TREE_DEPTH) -> list[tuple[str, Path, int]]:
    """Every entry below the folder ``root``: iterative (a deep tree cannot exhaust the stack),
    links never followed, at most ``max_depth`` folder levels.

    The runtime's walker (:func:`packer.runtime.reading.walk_tree`), so both sides walk by one rule.

    Args:
        root: the folder; error: the caller's error class; max_depth: the depth cap.

    Returns:
        ``(relative posix path, path, lstat mode)`` of each entry, sorted by path.

    Raises:
        error: a folder deeper than ``max_depth`` (one line naming it and the cap), or one
            that cannot be listed.
    """
    try:
        return _walk_tree(root, max_depth=max_depth)
    except ArtifactMismatchError as e:
        raise error(str(e)) from None


def irregular_entries(root: Path, error: ErrorClass = PackerError) -> list[Path]:
    """Entries under the directory ``root`` (links followed to their target's kind) that are
    neither directories nor regular files: what a reader of the tree could block on.

    Raises:
        error: the tree is deeper than the walk's cap or cannot be listed (:func:`walk_tree`).
    """
    found = []
    for _rel, path, mode in walk_tree(root, error=error):
        if stat.S_ISLNK(mode):
            try:
                mode = os.stat(path).st_mode
            except OSError:
                continue  # a dangling link: the reader names it missing
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            found.append(path)
    return sorted(found)
