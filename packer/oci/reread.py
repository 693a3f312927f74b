"""The build's own re-read of each weight file its sandboxed writer wrote: a layer blob and its
name, or a plain file.

The weights stage writes in a child process that parses untrusted checkpoints, so the build
believes nothing the child says about the bytes it wrote. The child hashes nothing: it reads
each span back as it lands and compares it with its source (what landed is what was meant),
and leaves each blob at ``image/unnamed/<file path>``. This process reads each blob and
hashes, side by side on two threads (hashlib releases the GIL), the whole blob and the
safetensors file inside it, each thread reading its own bytes with ``pread`` (cheaper here
than sharing one mapping, whose page faults cost more than the copies):

- the tar framing around the file (headers, padding, end blocks) must be the bytes this build
  writes for it (:func:`packer.oci.plan.weight_layer_framing`, computed here), so the blob is
  what was meant outside the spans the child read back too, and reproducible;
- the blob's digest names it: it moves to ``image/blobs/sha256/<digest>``;
- the file's sha256, which the manifest, the emitted loader and the model signature pin, comes
  from these bytes, never from the child; so does the sha256 of each of its chunks (the chunk
  table, :mod:`packer.runtime.chunks`), hashed from the same buffers, cut where the file's own
  header puts its tensors and their ranks' row splits (the header's few KiB read once more, by
  the build side's one header reader, :mod:`packer.safetensors_header`).

A weight file written as a plain file (``image.weights = "external"``, ``image.single_layer``)
is re-read the same way by :func:`reread_files`: its sha256 and its chunks' from one read of
this process, the writer's value replaced.

Each :class:`Vouch` lets the final verification (:func:`packer.verifying.verify`) take the
digests for the same file, not written since, instead of hashing it again.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from packer.errors import WeightsError
from packer.hashing import sha256_chunked, sha256_range
from packer.place import BLOBS, blob_rel
from packer.reading import open_regular, walk_tree
from packer.runtime.chunks import tp_cuts
from packer.safetensors_header import read_header
from packer.util.formats import SAFETENSORS_SUFFIX, UNNAMED_BLOBS
from packer.util.fsutil import FileEntry, Identity, identity
from packer.util.idents import check_rel_name, shown


@dataclass(frozen=True)
class Vouch:
    """What this process read of one weight layer blob (uncompressed; one file inside it), or of
    one weight file written as a plain file.

    Attributes:
        offset, size: where the safetensors file lies in the blob (bytes); 0 and its size for
            a plain file.
        sha256: the file's sha256 (hex), from this read.
        digest: the blob's sha256 (hex), from the same read: its name ("" for a plain file).
        identity: the blob file read (:func:`~packer.util.fsutil.identity`: device, inode, size and
            mtime, the same before and after the read). A later reader holding a file of that
            identity takes both digests; stat shows no write since, which is what it can tell.
        chunk, chunks: the chunk size (bytes) and the file's chunk digests (hex), from the
            same read.
        cuts: where the file's chunks were cut besides the fixed grid (its offsets, from its
            own header: :func:`packer.runtime.chunks.header_cuts`).
    """

    offset: int
    size: int
    sha256: str
    digest: str
    identity: Identity
    chunk: int = 0
    chunks: tuple[str, ...] = ()
    cuts: tuple[int, ...] = ()


Vouched = dict[str, Vouch]  # "sha256:<blob hex>" (a blob) or "file:<path in OUT>" (a plain file) -> what was read
PLAIN = "file:"  # the key prefix of a plain file's vouch
Framing = Callable[[str, int], tuple[bytes, bytes]]  # (file path in OUT, size) -> (bytes before, after)
_T = TypeVar("_T")


def _unlinked(root: Path, rel: str, error_where: str) -> Path:
    """``root / rel``, proved to pass through no symlink below ``root`` (which the child could have made)."""
    path = root / rel
    if os.path.realpath(path) != os.path.join(os.path.realpath(root), rel):
        raise WeightsError(f"{path}: {error_where} passes through a symlink")
    return path


def _checked_place(root: Path, entry: FileEntry) -> Path:
    """Where the writer left the blob of ``entry``, checked before it is opened:
    ``image/unnamed/<the file's path>``, no symlink on the way, the file at a non-negative offset."""
    where = f"the weights stage's reply for {shown(entry.path)}"
    rel = check_rel_name(entry.path, where=where, error=WeightsError)
    counts = [type(n) is int and n >= 0 for n in (entry.offset, entry.size)]
    if entry.blob != f"{UNNAMED_BLOBS}/{rel}" or not all(counts):
        raise WeightsError(f"{where}: {shown(entry.blob)} is not where a layer blob of it is left "
                           f"(offset {shown(entry.offset)}, size {shown(entry.size)})")
    return _unlinked(root, f"{UNNAMED_BLOBS}/{rel}", "the layer blob's place")


def _remove_unnamed(root: Path) -> None:
    """Remove ``image/unnamed``, which must hold nothing but empty folders now."""
    top = root / UNNAMED_BLOBS
    try:
        entries = walk_tree(top, error=WeightsError) if top.is_dir() else []  # a tree the child made
        for _rel, path, mode in reversed(entries):  # a folder's contents sort after it: emptied first
            if not stat.S_ISDIR(mode):
                # a name the child chose: control characters escaped (repr without its quotes)
                raise OSError(f"{repr(str(path))[1:-1]} was not named by the weights stage")
            os.rmdir(path)
        top.rmdir()
    except OSError as e:
        raise WeightsError(f"{top}: holds more than the layer blobs the weights stage named "
                           f"({e.strerror or e})") from e


def _named_dir(root: Path) -> Path:
    """``root/image/blobs/sha256``, each level made here or found a folder (not a symlink)."""
    path = root
    for part in BLOBS.split("/"):
        path = path / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise WeightsError(f"{path}: not a folder (a symlink?): the layer blobs cannot be named there")
    return path


def _framing_matches(fd: int, size: int, prefix: bytes, suffix: bytes) -> bool:
    """The blob's first and last bytes are ``prefix`` and ``suffix`` (a short read is a mismatch)."""
    return os.pread(fd, len(prefix), 0) == prefix and os.pread(fd, len(suffix), size - len(suffix)) == suffix


def _reread(path: Path, what: str, wrong_size: Callable[[int], str | None],
            hash_fd: Callable[[BinaryIO, int], _T]) -> tuple[_T, Identity]:
    """Open ``path`` (a regular file of its own), check its size, hash it, and prove the read
    saw one unchanged file: ``(hash_fd(f, size), the file's identity)``.

    ``wrong_size(size)`` says what is wrong with that size (None: nothing); ``what`` names the
    file in the messages ("layer blob", "weight file").

    Raises:
        WeightsError: not a regular file, another link, the wrong size, cut short, unreadable,
            or written (its size, mtime or ctime moved) during the read; or from ``hash_fd``.
    """
    with open_regular(path, WeightsError) as f:
        fd = f.fileno()
        st = os.fstat(fd)
        before, size = identity(st), st.st_size
        if st.st_nlink != 1:  # a hard link would make a file outside staging part of OUT
            raise WeightsError(f"{path}: {st.st_nlink} hard links; a {what} must be a file of its own")
        if (why := wrong_size(size)) is not None:
            raise WeightsError(f"{path}: {why}")
        try:
            got = hash_fd(f, size)
        except EOFError as e:
            raise WeightsError(f"{path}: shrank while the build re-read it ({e})") from e
        except OSError as e:
            raise WeightsError(f"{path}: cannot re-read the {what}: {e.strerror or e}") from e
        end = os.fstat(fd)
    # ctime as well: a write whose mtime was put back (utime) still moves it; a blob's later
    # rename moves it too, so the vouch's identity leaves it out
    if before != identity(end) or st.st_ctime_ns != end.st_ctime_ns:
        raise WeightsError(f"{path}: written while the build re-read it")
    return got, before


def _cuts(f: BinaryIO, entry: FileEntry, offset: int, path: Path) -> tuple[int, ...]:
    """Where the chunks of the safetensors file at ``offset`` of ``f`` are cut (its data's start,
    its tensors' starts and ends, their ranks' row splits: :func:`packer.runtime.chunks.tp_cuts`),
    from its own header (the build side's one reader; its few KiB read twice, here and in the hash).

    Raises:
        WeightsError: a header that is not a safetensors header of the file's size.
    """
    if not entry.path.endswith(SAFETENSORS_SUFFIX):
        return ()
    header, start = read_header(f, path, entry.size, error=WeightsError, offset=offset)
    tensors = []
    for name, rec in header.items():
        if name == "__metadata__":
            continue
        offs, shape = (rec.get("data_offsets"), rec.get("shape")) if isinstance(rec, dict) else (None, None)
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(x) is int for x in offs)
                and isinstance(shape, list) and all(type(x) is int for x in shape)
                and 0 <= offs[0] <= offs[1] <= entry.size - start):
            raise WeightsError(f"{path}: {shown(entry.path)}: tensor {shown(str(name)[:80])} is not a header "
                               f"entry of a {entry.size}-byte file")
        tensors.append((offs[0], offs[1], shape))
    return tp_cuts(start, tensors, entry.size)


def _read(path: Path, entry: FileEntry, framing: Framing, pool: ThreadPoolExecutor, chunk: int) -> Vouch:
    prefix, suffix = framing(entry.path, entry.size)

    def wrong_size(size: int) -> str | None:
        if entry.offset == len(prefix) and size == len(prefix) + entry.size + len(suffix):
            return None
        return (f"{size} bytes, with {shown(entry.path)} at offset {entry.offset}: not its "
                f"layer ({len(prefix)} + {entry.size} + {len(suffix)} bytes)")

    def hashed(f: BinaryIO, size: int) -> tuple[str, tuple[str, tuple[str, ...]], tuple[int, ...]]:
        fd = f.fileno()
        if not _framing_matches(fd, size, prefix, suffix):
            raise WeightsError(f"{path}: the tar framing around {shown(entry.path)} is not what this "
                               "build writes: the weights stage wrote it wrong (or it shrank)")
        cuts = _cuts(f, entry, entry.offset, path)
        blob = pool.submit(sha256_range, fd, 0, size)  # the blob: its name
        inside = pool.submit(sha256_chunked, fd, entry.offset, entry.offset + entry.size, chunk, cuts)  # the file
        try:
            return blob.result(), inside.result(), cuts
        finally:
            hashers: list[Future[Any]] = [blob, inside]
            for h in hashers:  # neither hasher may outlive the descriptor it reads
                h.cancel()
            wait(hashers)

    (digest, (sha256, chunks), cuts), before = _reread(path, "layer blob", wrong_size, hashed)
    return Vouch(entry.offset, entry.size, sha256, digest, before, chunk, chunks, cuts)


def _read_plain(root: Path, entry: FileEntry, chunk: int) -> Vouch:
    """One weight file the writer left as a plain file at ``root/<its path>``, read and hashed
    whole and in chunks (no symlink on the way, a file of its own, the size the writer said)."""
    rel = check_rel_name(entry.path, where=f"the weights stage's reply for {shown(entry.path)}", error=WeightsError)
    path = _unlinked(root, str(rel), "the weight file's place")
    def hashed(f: BinaryIO, size: int) -> tuple[tuple[str, tuple[str, ...]], tuple[int, ...]]:
        cuts = _cuts(f, entry, 0, path)
        return sha256_chunked(f.fileno(), 0, size, chunk, cuts), cuts

    ((sha256, chunks), cuts), before = _reread(
        path, "weight file",
        lambda size: None if size == entry.size else f"{size} bytes; the weights stage wrote {shown(entry.size)}",
        hashed)
    return Vouch(0, entry.size, sha256, "", before, chunk, chunks, cuts)


def reread_files(root: Path, files: tuple[FileEntry, ...],
                 chunk: int = 1 << 20) -> tuple[tuple[FileEntry, ...], Vouched]:
    """Re-read every safetensors file of ``files`` that is not held in a layer blob (a plain
    file under ``root``, the build's staging): its sha256 and its ``chunk``-byte chunks' digests
    from one read, a few files at a time.

    Returns:
        ``files`` with each such file's ``sha256`` from this read (any value the writer gave
        is replaced), and its :class:`Vouch` under ``"file:<path>"`` for the chunk table and
        the final verification.

    Raises:
        WeightsError: a file that is a symlink or passes through one, has another link, is not
            the size the writer said, or was written, cut short or unreadable during the read.
    """
    plain = [(i, f) for i, f in enumerate(files) if not f.blob and f.path.endswith(SAFETENSORS_SUFFIX)]
    if not plain:
        return files, {}
    out = list(files)
    vouched: Vouched = {}
    with ThreadPoolExecutor(min(len(plain), os.cpu_count() or 1), thread_name_prefix="packer-reread-file") as pool:
        reads = [(i, f, pool.submit(_read_plain, root, f, chunk)) for i, f in plain]
        for i, f, read in reads:
            got = read.result()
            vouched[PLAIN + f.path] = got
            out[i] = replace(f, sha256=got.sha256)
    return tuple(out), vouched


def reread_blobs(root: Path, files: tuple[FileEntry, ...], framing: Framing | None,
                 chunk: int = 1 << 20) -> tuple[tuple[FileEntry, ...], Vouched]:
    """Re-read every file of ``files`` held in a layer blob under ``root`` (the build's staging),
    and move each blob to its name, ``image/blobs/sha256/<digest>``.

    ``framing`` gives the bytes before and after a file in its layer (what the build asked the
    writer to write around it); None where the build asked for no layer blob. ``chunk`` is the
    chunk size (bytes) of the files' chunk digests, hashed in the same read.

    Returns:
        ``files`` with each blob-held file's ``sha256`` from this read (any value the writer
        gave is replaced) and its ``blob`` at its name, and the :data:`Vouched` of each blob
        for the final verification, with each file's chunk digests.

    Raises:
        WeightsError: a blob place that is not ``image/unnamed/<file path>`` (no symlink on
            the way), a blob that is not a file of its own (one link) holding the file in the
            framing asked for, a blob written (its size, mtime or ctime moved), cut short or
            unreadable during the read, or anything else left in ``image/unnamed``.
    """
    held = [(i, f, _checked_place(root, f)) for i, f in enumerate(files) if f.blob]
    if not held:
        if os.path.lexists(root / UNNAMED_BLOBS):
            _remove_unnamed(root)
        return files, {}
    if framing is None:
        raise WeightsError(f"the weights stage's reply names layer blobs in {root / UNNAMED_BLOBS}; none was asked for")
    if len({path for _i, _f, path in held}) != len(held):
        raise WeightsError(f"the weights stage's reply names a layer blob in {root / UNNAMED_BLOBS} twice")
    out = list(files)
    vouched: Vouched = {}
    named = _named_dir(root)
    at_once = min(len(held), os.cpu_count() or 1)  # blobs read at a time, each by two hashers
    with ThreadPoolExecutor(2 * at_once, thread_name_prefix="packer-reread") as hashers, \
            ThreadPoolExecutor(at_once, thread_name_prefix="packer-reread-blob") as blobs:
        reads: list[Any] = [(i, f, path, blobs.submit(_read, path, f, framing, hashers, chunk)) for i, f, path in held]
        for i, f, path, read in reads:
            got = read.result()
            try:
                os.replace(path, named / got.digest)  # a rename: the identity read stays the blob's
            except OSError as e:
                raise WeightsError(f"{path}: cannot move the layer blob to its name: {e.strerror or e}") from e
            vouched["sha256:" + got.digest] = got
            out[i] = replace(f, sha256=got.sha256, blob=blob_rel(got.digest))
    _remove_unnamed(root)
    return tuple(out), vouched
