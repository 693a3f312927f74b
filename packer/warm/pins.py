"""The warm state's pins: ``OUT/warm/<name>/manifest.json`` over ``OUT/warm/<name>/files/``.

A state directory holds the files an engine wrote for its start-up, under fixed relative
paths (``files/<root>/<path>``, a root per cache directory the engine was given: ``vllm`` for
``VLLM_CACHE_ROOT``, ``inductor``, ``triton``, and on GPUs ``flashinfer``, ``deepgemm``,
``tilelang``, ``cutedsl``, ``cuda``; a root nothing wrote is absent), and one manifest:

``{"schema": 1, "name": ..., "key": {...}, "roots": [...], "files": {rel: {"size", "sha256"}}}``

and, when signed, ``state.sig`` over that manifest (:mod:`packer.warm.trust`).

Compile caches are code (pickles, generated Python, shared objects): nothing in a state is
used before :func:`verified_copy` has copied it, hashing each byte on the way, into a private
directory, so a file changed after the check is never the one the engine reads. A changed,
missing or unpinned file refuses the whole state.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from packer.errors import WarmStateError
from packer.reading import Kind, file_kind, open_regular, parse_json, read_bytes, walk_tree
from packer.util.formats import MANIFEST_NAME
from packer.util.fsutil import atomic_write_bytes, canonical_json, quiet_cleanup, remove_tree
from packer.util.idents import check_rel_name
from packer.util.jsonshape import SIZE, STR, ListOf, MapOf, Obj, leaf
from packer.util.show import show
from packer.warm.roots import ROOTS  # a root per cache directory (packer.warm.roots.CACHE_ROOTS)
from packer.warm.trust import SIGNATURE_NAME, build_digest, check_signature, statement

WARM_DIR = "warm"
MANIFEST = MANIFEST_NAME  # a state's own manifest, named as the build's
FILES = "files"
SCHEMA = 1
STATE_MANIFEST = Kind("warm-state manifest", 16 << 20, 16)
CHUNK = 1 << 20
_HEX64 = leaf("a sha256 (64 lowercase hex digits)",
              lambda v: isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v))
_SHAPE = Obj(required={"schema": leaf("1", lambda v: v == SCHEMA), "name": STR, "key": MapOf(leaf(
    "any value", lambda v: True)), "roots": ListOf(STR), "files": MapOf(Obj(required={"size": SIZE,
                                                                                         "sha256": _HEX64}))})
# what an engine leaves beside its caches that no later start reads: locks and half-written files
_SKIP_SUFFIXES = (".lock", ".tmp")


def state_dirs(out: Path) -> list[Path]:
    """Every warm state directory of a build output (``OUT/warm/*/``), sorted."""
    base = out / WARM_DIR
    if not base.is_dir() or base.is_symlink():
        return []
    return sorted(p for p in base.iterdir() if p.is_dir() and not p.is_symlink())


def verify_states(out: Path, *, public_key: str | None = None) -> tuple[set[str], int, list[str]]:
    """Check every warm state of ``out``: ``(its files relative to out, bytes hashed, state names)``.

    A state's ``state.sig``, where there is one, must sign its manifest for this build
    (:mod:`packer.warm.trust`); with ``public_key`` every state must have one that verifies.

    Raises:
        WarmStateError: the first changed, missing or unpinned file of any state, or a
            signature that does not cover it.
    """
    rels: set[str] = set()
    total = 0
    names = []
    for state in state_dirs(out):
        doc, digest = read_state(state)
        total += check_state(state, doc)[1]
        names.append(state.name)
        base = f"{WARM_DIR}/{state.name}"
        rels |= {f"{base}/{MANIFEST}", *(f"{base}/{FILES}/{rel}" for rel in doc["files"])}
        if public_key is not None or (state / SIGNATURE_NAME).exists():
            check_signature(state, digest, public_key=public_key, build_sha256=build_digest(out))
            rels.add(f"{base}/{SIGNATURE_NAME}")
    return rels, total, names


class Found(dict[str, Path]):
    """:func:`collect`'s answer, ``{rel: file}``, with each file's ``(st_dev, st_ino)`` as the walk
    found it in ``ids``: :func:`write_state` copies a file only from that very inode."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: dict[str, tuple[int, int]] = {}


MAX_STATE_FILES = 100_000  # files of one warm state (vLLM's compile caches: hundreds)
MAX_STATE_BYTES = 16 << 30  # their bytes (vLLM's compile caches: megabytes to a few GB)


def collect(roots: dict[str, Path], *, since_ns: int | None = None) -> Found:
    """``{rel: file}`` of every regular file under the cache ``roots`` worth shipping.

    Only what lies in a root's own directory tree is taken: no link (a root's own links are the
    caller's to refuse, :func:`packer.warm.capture.check_roots`; a link inside a root refuses the
    state), no file of another file system (a mount), no file with a hard link outside the
    roots (its other name lies elsewhere: the file was not written here), and with ``since_ns``
    no file whose inode was last changed before then (it existed before the engine's run).

    Raises:
        WarmStateError: a root name outside :data:`ROOTS`, a file refused as above, a name that is
            not printable UTF-8, or more than :data:`MAX_STATE_FILES` files or
            :data:`MAX_STATE_BYTES` bytes (sizes counted before anything is copied).
    """
    found = Found()
    links: dict[tuple[int, int], tuple[int, Path]] = {}
    skipped: Counter[tuple[int, int]] = Counter()  # inodes of the names not shipped (locks)
    total = 0
    for root, top in sorted(roots.items()):
        if root not in ROOTS:
            raise WarmStateError(f"{top}: unknown warm-state root {root!r} (known: {', '.join(ROOTS)})")
        if not top.is_dir() or top.is_symlink():
            continue
        dev = os.lstat(top).st_dev
        for _rel, path, mode in walk_tree(top, error=WarmStateError):
            if stat.S_ISLNK(mode):
                raise WarmStateError(f"{path}: a link in the engine's cache; a warm state holds plain files only")
            if stat.S_ISDIR(mode):
                continue
            st = os.lstat(path)
            if path.name.endswith(_SKIP_SUFFIXES):  # not shipped, yet a name inside the roots
                skipped[(st.st_dev, st.st_ino)] += 1
                continue
            _own_file(path, st, dev, since_ns)
            rel = f"{root}/{path.relative_to(top).as_posix()}"
            if not rel.isprintable():  # undecodable bytes come as lone surrogates, which are not printable
                raise WarmStateError(f"{show(str(path))}: a name that is not printable UTF-8 in the engine's cache; "
                                     "a warm state's manifest cannot hold it")
            total += st.st_size
            if len(found) >= MAX_STATE_FILES or total > MAX_STATE_BYTES:
                raise WarmStateError(f"{show(str(top))}: the engine's cache holds more than {MAX_STATE_FILES} files or "
                                     f"{MAX_STATE_BYTES >> 30} GiB (at {show(str(path))}); refused before anything "
                                     "is copied")
            found[rel], found.ids[rel] = path, (st.st_dev, st.st_ino)
            links[(st.st_dev, st.st_ino)] = (st.st_nlink, links.get((st.st_dev, st.st_ino), (0, path))[1])
    seen = Counter(found.ids.values()) + skipped
    for ident, (nlink, path) in links.items():
        if nlink > seen[ident]:  # a name of this file outside the roots: it was not written by the run
            raise WarmStateError(f"{show(str(path))}: has {nlink} hard links, {nlink - seen[ident]} of them outside "
                                 "the engine's cache directories; a warm state holds only files the engine wrote")
    return found


def _own_file(path: Path, st: os.stat_result, dev: int, since_ns: int | None) -> None:
    """Refuse an entry of a cache root that the engine's run did not write there itself."""
    if not stat.S_ISREG(st.st_mode):
        raise WarmStateError(f"{show(str(path))}: is {file_kind(st.st_mode)} in the engine's cache; a warm state "
                             "holds plain files only")
    if st.st_dev != dev:
        raise WarmStateError(f"{show(str(path))}: on another file system than its cache root (a mount); refused")
    if since_ns is not None and st.st_ctime_ns < since_ns:
        raise WarmStateError(f"{show(str(path))}: unchanged since before the engine's run (its inode's change "
                             "time precedes the cache root's creation); a warm state holds only what the run wrote")


def write_state(dest: Path, *, name: str, key: dict[str, Any], files: Mapping[str, Path],
                signer: Callable[[dict[str, Any]], bytes] | None = None, build: Path | None = None) -> dict[str, Any]:
    """Copy ``files`` into a new state directory ``dest`` with its manifest; replaces an old one whole.

    The state is assembled beside ``dest`` and renamed into place, so a reader sees the old
    state or the new one, never a mix. Nothing is written through a link: ``dest``'s parent
    and ``dest`` itself, where they exist, must be plain directories.

    Args:
        signer: makes ``state.sig`` from the statement (:func:`packer.warm.trust.statement`)
            over the manifest written; None: unsigned.
        build: the build output the state is signed for (default: ``dest``'s grandparent,
            ``OUT`` of ``OUT/warm/<name>``; ``packer warm`` stages the state elsewhere in OUT).

    Returns:
        the manifest written.

    Raises:
        WarmStateError: ``dest`` or its parent is a link or not a directory, or a file cannot be copied.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    plain_dir(dest.parent)
    if os.path.lexists(dest):
        plain_dir(dest)
    stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        pins = {}
        ids = files.ids if isinstance(files, Found) else {}
        for rel, src in sorted(files.items()):
            with open_regular(src, WarmStateError) as f:
                _same_file(src, f, ids.get(rel))
                pins[rel] = _copy_hashed(f, stage / FILES / rel)
        doc = {"schema": SCHEMA, "name": name, "key": key, "roots": sorted({r.split("/", 1)[0] for r in pins}),
               "files": pins}
        raw = canonical_json(doc)
        atomic_write_bytes(stage / MANIFEST, raw)
        if signer is not None:
            st = statement(name, hashlib.sha256(raw).hexdigest(), build_digest(build or dest.parent.parent))
            atomic_write_bytes(stage / SIGNATURE_NAME, signer(st))
        old = None
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old.", dir=dest.parent))
            os.replace(dest, old / "state")
        os.replace(stage, dest)
        if old is not None:
            remove_tree(old)
        return doc
    except BaseException as e:
        quiet_cleanup(e, lambda: remove_tree(stage, ignore_errors=True))
        raise


def _same_file(path: Path, f: BinaryIO, ident: tuple[int, int] | None) -> None:
    """Refuse an opened file that is not the inode :func:`collect` found (a folder on its path
    swapped for a link between the walk and the copy leads to another file)."""
    st = os.fstat(f.fileno())
    if ident is not None and (st.st_dev, st.st_ino) != ident:
        raise WarmStateError(f"{show(str(path))}: another file than the one found in the engine's cache (the "
                             "tree changed during the copy); refused")


def plain_dir(path: Path) -> None:
    """Refuse ``path`` unless it is a directory itself (``lstat``: a link to one is refused).

    Raises:
        WarmStateError: a link, a file or anything else, or missing; the message names ``path``.
    """
    _plain(path, stat.S_ISDIR, "a directory")


def plain_file(path: Path) -> None:
    """Refuse ``path`` unless it is a regular file itself (``lstat``: a link to one is refused).

    Raises:
        WarmStateError: a link, a directory, a FIFO, device or socket, or missing.
    """
    _plain(path, stat.S_ISREG, "a regular file")


def _plain(path: Path, test: Callable[[int], bool], what: str) -> None:
    try:
        mode = os.lstat(path).st_mode
    except OSError as e:
        raise WarmStateError(f"{show(str(path))}: unreadable ({e.strerror or e})") from None
    if not test(mode):
        kind = "a symbolic link" if stat.S_ISLNK(mode) else file_kind(mode)
        raise WarmStateError(f"{show(str(path))}: is {kind}, not {what}; a warm state holds plain files and "
                             "directories only, never a link")


def load_state(state: Path) -> dict[str, Any]:
    """The checked manifest of a state directory (shape, schema, every path a plain relative one).

    Raises:
        WarmStateError: missing, too large, not JSON, the wrong shape, or a path that leaves the state.
    """
    return read_state(state)[0]


def read_state(state: Path) -> tuple[dict[str, Any], str]:
    """:func:`load_state`, and the sha256 (hex) of the very bytes it parsed (what ``state.sig`` signs)."""
    where = state / MANIFEST
    plain_dir(state)
    plain_file(where)
    raw = read_bytes(where, STATE_MANIFEST, error=WarmStateError, what="the warm state's manifest")
    doc = parse_json(raw, STATE_MANIFEST, where=str(where), error=WarmStateError, shape=_SHAPE)
    for rel in doc["files"]:
        p = check_rel_name(rel, where=f"{where}: files", error=WarmStateError)
        if p.parts[0] not in ROOTS or len(p.parts) < 2:
            raise WarmStateError(f"{where}: files: {rel!r} is not under one of the roots {', '.join(ROOTS)}")
    return dict(doc), hashlib.sha256(raw).hexdigest()


def check_state(state: Path, doc: dict[str, Any] | None = None) -> tuple[dict[str, Any], int]:
    """Every pinned file of ``state`` against its pin, and nothing unpinned: ``(manifest, bytes)``.

    Args:
        doc: the manifest as :func:`read_state` read it (the check follows those pins); default: read here.

    Raises:
        WarmStateError: naming the first changed, missing or unpinned file.
    """
    doc = doc if doc is not None else load_state(state)
    _no_unpinned(state, doc)
    total = 0
    for rel, pin in sorted(doc["files"].items()):
        total += _check_one(state / FILES / rel, pin, sink=None)
    return doc, total


def verified_copy(state: Path, dest: Path, doc: dict[str, Any] | None = None) -> tuple[dict[str, Any], int]:
    """Copy the pinned files of ``state`` into the new directory ``dest`` (mode 0700), each checked.

    Each file is hashed as it is copied and compared with its pin: what lands in ``dest`` is
    what was pinned, whatever happens to ``state`` meanwhile. ``dest`` is left out on failure.

    Args:
        doc: the state's manifest as :func:`load_state` read it, when the caller already decided
            on it (the copy then follows exactly those pins); default: read here.

    Returns:
        ``(manifest, bytes copied)``.

    Raises:
        WarmStateError: the first changed, missing or unpinned file (``dest`` removed).
    """
    doc = doc if doc is not None else load_state(state)
    _no_unpinned(state, doc)
    dest.mkdir(mode=0o700)
    total = 0
    try:
        for rel, pin in sorted(doc["files"].items()):
            target = dest / PurePosixPath(rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            with _create(target) as sink:
                total += _check_one(state / FILES / rel, pin, sink=sink)
    except BaseException as e:
        quiet_cleanup(e, lambda: remove_tree(dest, ignore_errors=True))
        raise
    return doc, total


def _no_unpinned(state: Path, doc: dict[str, Any]) -> None:
    top = state / FILES
    if os.path.lexists(top):
        plain_dir(top)
    for _rel, path, mode in walk_tree(top, error=WarmStateError) if top.is_dir() else []:
        if stat.S_ISDIR(mode):
            continue
        if path.relative_to(top).as_posix() not in doc["files"]:
            raise WarmStateError(f"{path}: not pinned by {state / MANIFEST}")
        plain_file(path)  # pinned, but a link (to the pinned bytes elsewhere) proves nothing
    for path in sorted(state.iterdir()):
        if path.name not in (MANIFEST, FILES, SIGNATURE_NAME):
            raise WarmStateError(f"{path}: not part of a warm state (only {MANIFEST}, {SIGNATURE_NAME} and {FILES}/)")
    if os.path.lexists(state / SIGNATURE_NAME):
        plain_file(state / SIGNATURE_NAME)


def _check_one(path: Path, pin: dict[str, Any], sink: Any) -> int:
    h = hashlib.sha256()
    size = 0
    try:
        if os.path.lexists(path):
            plain_file(path)
        with open_regular(path, WarmStateError) as f:
            while chunk := f.read(CHUNK):
                size += len(chunk)
                if size > pin["size"]:
                    break
                h.update(chunk)
                if sink is not None:
                    sink.write(chunk)
    except OSError as e:
        raise WarmStateError(f"{path}: pinned but unreadable ({e.strerror or e})") from None
    if size != pin["size"]:
        raise WarmStateError(f"{path}: size differs from the pin's {pin['size']} bytes")
    if h.hexdigest() != pin["sha256"]:
        raise WarmStateError(f"{path}: sha256 {h.hexdigest()[:16]}… differs from the pin's {pin['sha256'][:16]}…")
    return size


def _copy_hashed(src: Any, dest: Path) -> dict[str, Any]:
    dest.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    size = 0
    with _create(dest) as sink:
        while chunk := src.read(CHUNK):
            h.update(chunk)
            sink.write(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def _create(path: Path) -> BinaryIO:
    """A new file for writing (never an existing one, never through a link)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    return os.fdopen(fd, "wb")
