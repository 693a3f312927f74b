"""The build's own re-read of each weight layer blob its sandboxed writer wrote.

The weights stage writes in a child process that parses untrusted checkpoints, so the build
believes nothing the child says about the bytes it wrote. This process maps each blob the child
names once and hashes, side by side on two threads (hashlib releases the GIL), the whole blob and
the safetensors file inside it:

- the blob must match the digest it is named by: the writer hashed the bytes it meant to write,
  so this proves that what landed is what was meant (and the name honest);
- the file's sha256, which the manifest, the emitted loader and the model signature pin, comes
  from these bytes, never from the child (which leaves it empty).

Each blob's :class:`Vouch` lets the final verification (:func:`packer.verify.verify`) take both
digests for the same file, not written since, instead of hashing it again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from packer.errors import WeightsError
from packer.fsutil import FileEntry, Identity, identity
from packer.idents import shown
from packer.reading import blob_path, map_readonly

CHUNK = 16 * 2**20
BLOBS = "image/blobs/sha256"


@dataclass(frozen=True)
class Vouch:
    """What this process read of one weight layer blob (uncompressed; one file inside it).

    Attributes:
        offset, size: where the safetensors file lies in the blob (bytes).
        sha256: the file's sha256 (hex), from this read.
        digest: the blob's sha256 (hex), from the same read: equal to its name.
        identity: the blob file read (:func:`~packer.fsutil.identity`: device, inode, size and
            mtime, the same before and after the read). A later reader holding a file of that
            identity takes both digests; stat shows no write since, which is what it can tell.
    """

    offset: int
    size: int
    sha256: str
    digest: str
    identity: Identity


Vouched = dict[str, Vouch]  # "sha256:<blob hex>" -> what was read of it


def _sha256(view: memoryview, start: int, end: int) -> str:
    h = hashlib.sha256()
    for at in range(start, end, CHUNK):
        h.update(view[at:min(end, at + CHUNK)])
    return h.hexdigest()


def _checked_place(root: Path, entry: FileEntry) -> Path:
    """The blob path of ``entry``, checked as a name before it is opened: ``image/blobs/sha256/<hex>``."""
    hexd = entry.blob.rsplit("/", 1)[-1]
    path = blob_path(root / "image", "sha256:" + hexd, where=f"the weights stage's reply for {shown(entry.path)}",
                     error=WeightsError)
    if entry.blob != f"{BLOBS}/{hexd}" or entry.offset < 0 or entry.size < 0:
        raise WeightsError(f"the weights stage's reply: {shown(entry.blob)} is not a layer blob place for "
                           f"{shown(entry.path)} (offset {shown(entry.offset)}, size {shown(entry.size)})")
    return path


def _read(path: Path, entry: FileEntry, pool: ThreadPoolExecutor) -> Vouch:
    fd, mm, size = map_readonly(path, WeightsError)
    try:
        before = identity(os.fstat(fd))
        if entry.offset + entry.size > size:
            raise WeightsError(f"{path}: {size} bytes, too short to hold {shown(entry.path)} at offset {entry.offset} "
                               f"({entry.size} bytes)")
        with memoryview(mm if mm is not None else b"") as view:
            blob = pool.submit(_sha256, view, 0, size)
            inside = pool.submit(_sha256, view, entry.offset, entry.offset + entry.size)
            digest, sha256 = blob.result(), inside.result()
        after = identity(os.fstat(fd))
    finally:
        if mm is not None:
            with contextlib.suppress(BufferError):  # a view held by a traceback: freed with it
                mm.close()
        os.close(fd)
    if digest != path.name:
        raise WeightsError(f"{path}: the layer blob does not match the digest it is named by (sha256 "
                           f"{digest[:16]}…): the weights stage wrote it wrong")
    if before != after:
        raise WeightsError(f"{path}: written while the build re-read it")
    return Vouch(entry.offset, entry.size, sha256, digest, after)


def reread_blobs(root: Path, files: tuple[FileEntry, ...]) -> tuple[tuple[FileEntry, ...], Vouched]:
    """Re-read every file of ``files`` held in a layer blob under ``root`` (the build's staging).

    Returns:
        ``files`` with each blob-held file's ``sha256`` from this read (any value the writer
        gave is replaced), and the :data:`Vouched` of each blob for the final verification.

    Raises:
        WeightsError: a blob place that is not ``image/blobs/sha256/<hex>`` with the file inside
            it, a blob that does not match its name, or one written during the read.
    """
    held = [(i, f, _checked_place(root, f)) for i, f in enumerate(files) if f.blob]
    if not held:
        return files, {}
    out = list(files)
    vouched: Vouched = {}
    at_once = min(len(held), os.cpu_count() or 1)  # blobs read at a time, each by two hashers
    with ThreadPoolExecutor(2 * at_once, thread_name_prefix="packer-reread") as hashers, \
            ThreadPoolExecutor(at_once, thread_name_prefix="packer-reread-blob") as blobs:
        reads: list[Any] = [(i, f, blobs.submit(_read, path, f, hashers)) for i, f, path in held]
        for i, f, read in reads:
            got = read.result()
            vouched["sha256:" + got.digest] = got
            out[i] = replace(f, sha256=got.sha256)
    return tuple(out), vouched
