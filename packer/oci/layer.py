"""Layers: write a tar stream once, hashing diff_id and blob digest in the same pass.

Uncompressed file ranges are copied with ``copy_file_range`` (in a worker thread) while the
calling thread hashes the same bytes through ``mmap``: both release the GIL, so copying and
hashing overlap and no user-space copy is made. One SHA-256 stream runs on one core, so
:func:`write_layers` writes several layers at once (one weight file each). Compressed layers
read file ranges in large chunks into one reused buffer. gzip uses zlib with ``wbits=31``:
mtime 0, no file name, so output depends only on the zlib version (and is several times
slower than zstd: single-threaded deflate); zstd uses multi-threaded python-zstandard,
whose output does not depend on the number of worker threads. Blobs are not fsynced one by
one: the build syncs the staging directory once before publishing it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import threading
import zlib
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, cast

from packer.errors import ImageError
from packer.oci.tar_writer import FileRange
from packer.reading import map_readonly, open_regular
from packer.util.fsutil import TempFile

CHUNK = 16 * 2**20
HASH_CHUNK = 64 * 2**20
GZIP_LEVEL = 6
ZSTD_LEVEL = 3
MEDIA_TYPES = {
    "none": "application/vnd.oci.image.layer.v1.tar",
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
}
COMPRESSION_OF = {v: k for k, v in MEDIA_TYPES.items()}
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Layer:
    """A stored layer blob: what a manifest descriptor and the config's diff_ids need."""

    digest: str  # "sha256:…" of the stored (maybe compressed) blob
    diff_id: str  # "sha256:…" of the uncompressed tar
    size: int
    media_type: str
    path: Path

    def descriptor(self) -> dict[str, Any]:
        """The OCI descriptor of this blob."""
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


class _Sink(Protocol):
    def write(self, data: bytes | memoryview) -> Any: ...


class _NoHash:
    """Stands in for a hasher whose bytes another hasher already sees."""

    def update(self, data: bytes | memoryview) -> None:
        pass


class _HashingFile:
    """Writes to a file descriptor, hashing (unless told not to) and counting what passes."""

    def __init__(self, fd: int, *, hashing: bool = True) -> None:
        self.fd = fd
        self.hashing = hashing
        self.hash: Any = hashlib.sha256() if hashing else _NoHash()
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data)
        self.hash.update(view)
        self.size += len(view)
        while view:
            view = view[os.write(self.fd, view) :]
        return len(data)

    def copy_range(self, src: Path, size: int) -> None:
        """Append ``size`` bytes of ``src`` by kernel copy, hashed alongside unless not hashing."""
        if self.hashing and size:  # (an empty file cannot be mapped, and has nothing to hash)
            _copy_range_fast(src, size, self)
            return
        with open_regular(src, ImageError) as f:
            _check_size(f.fileno(), src, size)
            _copy_fd(f.fileno(), self.fd, size, src)
        self.size += size


class _Gzip:
    def __init__(self, out: _HashingFile) -> None:
        self.out = out
        self.z = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)

    def write(self, data: bytes | memoryview) -> int:
        if chunk := self.z.compress(data):
            self.out.write(chunk)
        return len(data)

    def close(self) -> None:
        self.out.write(self.z.flush())


def _compressor(kind: str, out: _HashingFile) -> tuple[_Sink, Callable[[], None]]:
    if kind == "none":
        return out, lambda: None
    if kind == "gzip":
        g = _Gzip(out)
        return g, g.close
    if kind == "zstd":
        import zstandard  # lazy: only zstd layers need it

        cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1)
        writer = cctx.stream_writer(cast(IO[bytes], out), write_return_read=True, closefd=False)
        return writer, writer.close
    raise ImageError(f"image.compression: unknown compression {kind!r}")


def _copy_range_fast(src: Path, size: int, out: _HashingFile) -> None:
    """Kernel copy of ``src`` to ``out.fd`` overlapped with hashing it via mmap.

    Only for uncompressed layers, where the blob digest is the diff_id: one hash.
    """
    fd, mm, _ = map_readonly(src, ImageError)
    with os.fdopen(fd, "rb") as f:
        _check_size(f.fileno(), src, size)
        assert mm is not None  # size > 0 (the caller copies empty files the plain way)
        error: list[BaseException] = []

        def copy() -> None:
            try:
                _copy_fd(f.fileno(), out.fd, size, src)
            except BaseException as e:  # re-raised in the caller's thread
                error.append(e)

        worker = threading.Thread(target=copy, name="packer-layer-copy")
        worker.start()
        view = memoryview(mm)
        try:
            for off in range(0, size, HASH_CHUNK):
                with view[off : off + HASH_CHUNK] as piece:
                    out.hash.update(piece)
        finally:
            worker.join()
            view.release()
            mm.close()
        if error:
            raise error[0]
        out.size += size


def _copy_fd(src_fd: int, dst_fd: int, size: int, src: Path) -> None:
    """Copy ``size`` bytes from offset 0 of ``src_fd`` to ``dst_fd``'s position, in-kernel
    where the file systems allow it, else through a buffer."""
    done, kernel = 0, True
    while done < size:
        if kernel:
            try:
                n = os.copy_file_range(src_fd, dst_fd, size - done, done)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                kernel = False
                continue
        else:
            data = memoryview(os.pread(src_fd, min(CHUNK, size - done), done))
            n = len(data)
            while data:
                data = data[os.write(dst_fd, data) :]
        if n == 0:
            raise ImageError(f"{src}: file shrank while writing its layer")
        done += n


def _copy_range(src: Path, size: int, sink: _Sink, diff: Any, buf: bytearray) -> None:
    view = memoryview(buf)
    left = size
    with open_regular(src, ImageError) as f:
        _check_size(f.fileno(), src, size)
        while left:
            n = f.readinto(view[: min(left, len(buf))])
            if not n:
                raise ImageError(f"{src}: file shrank while writing its layer")
            diff.update(view[:n])
            sink.write(view[:n])
            left -= n


def _check_size(fd: int, src: Path, size: int) -> None:
    if (actual := os.fstat(fd).st_size) != size:
        raise ImageError(f"{src}: is {actual} bytes, the plan expected {size}; rebuild")


def write_layer(
    pieces: Iterable[bytes | FileRange],
    blobs_dir: Path,
    *,
    compression: str,
    tee: Path | None = None,
    digest: str | None = None,
) -> Layer:
    """Write a tar stream as a blob under ``blobs_dir``, named by its digest.

    Args:
        pieces: the tar stream from :func:`packer.oci.tar_writer.tar_pieces`.
        blobs_dir: ``…/blobs/sha256``; the blob goes to a temp name, then is renamed.
        compression: ``"none"``, ``"gzip"`` or ``"zstd"``.
        tee: also write the uncompressed tar here (atomically), in the same pass.
        digest: the ``"sha256:…"`` of an uncompressed stream, computed earlier (while the
            weights were written): the bytes are only copied, not hashed. Trusted here; the
            build's final verification re-hashes every blob before anything is published.

    Returns:
        The :class:`Layer` with digest, diff_id, size and media type.

    Raises:
        ImageError: unknown compression, or a source file changed size while read.
    """
    if digest is not None:
        if compression != "none" or tee is not None:
            raise ImageError("a known layer digest needs an uncompressed layer without a tee")
        if not _DIGEST.fullmatch(digest):  # it names a file: never a path
            raise ImageError(f"known layer digest {digest!r}: expected sha256:<64 hex digits>")
    with contextlib.ExitStack() as stack:
        blob = stack.enter_context(TempFile(blobs_dir / "blob", 0o644, buffering=0))  # named by its digest
        teed = stack.enter_context(TempFile(tee, 0o644, buffering=0)) if tee is not None else None
        out = _HashingFile(blob.fd, hashing=digest is None)
        sink, close = _compressor(compression, out)
        # uncompressed: the blob hash is the diff_id, so hash once
        diff: Any = _NoHash() if compression == "none" else hashlib.sha256()
        target: _Sink = _Tee(sink, _HashingFile(teed.fd, hashing=False)) if teed else sink
        buf = bytearray(CHUNK)
        for piece in pieces:
            if not isinstance(piece, FileRange):
                diff.update(piece)
                target.write(piece)
            elif target is out:  # the blob is the tar itself: a kernel copy
                out.copy_range(piece.path, piece.size)
            else:
                _copy_range(piece.path, piece.size, target, diff, buf)
        close()
        digest = digest or "sha256:" + out.hash.hexdigest()
        path = blobs_dir / digest.removeprefix("sha256:")
        # not synced one by one: the build syncs the staging directory once before publishing it
        blob.commit(path, fsync=False)
        if teed is not None:
            teed.commit(fsync=False)
    diff_id = digest if compression == "none" else "sha256:" + diff.hexdigest()
    return Layer(digest, diff_id, out.size, MEDIA_TYPES[compression], path)


@dataclass(frozen=True)
class LayerJob:
    """One layer to write: its tar stream, compression and optional uncompressed copy."""

    pieces: Iterable[bytes | FileRange]
    compression: str
    tee: Path | None = None
    digest: str | None = None  # known uncompressed digest: copy without hashing


def write_layers(
    jobs: Sequence[LayerJob],
    blobs_dir: Path,
    *,
    workers: int | None = None,
    on_done: Callable[[int], None] | None = None,
) -> list[Layer]:
    """Write several layers concurrently (hashing releases the GIL); results in job order.

    SHA-256 of one stream cannot be split, so the only way to hash faster than one core
    is to hash several layers at once: the weight layers, one per file, give the
    parallelism.

    Args:
        jobs: the layers to write.
        blobs_dir: ``…/blobs/sha256``.
        workers: concurrent layers (default: the CPU count).
        on_done: called in the caller's thread with each finished job's index.

    Returns:
        The layers, in the order of ``jobs``.
    """
    workers = max(1, min(len(jobs), workers or os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="packer-layer") as pool:
        futures = {
            pool.submit(write_layer, j.pieces, blobs_dir, compression=j.compression, tee=j.tee,
                        digest=j.digest): i
            for i, j in enumerate(jobs)
        }
        results: dict[int, Layer] = {}
        try:
            for fut in as_completed(futures):
                results[futures[fut]] = fut.result()
                if on_done:
                    on_done(futures[fut])
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
        return [results[i] for i in range(len(jobs))]


class _Tee:
    def __init__(self, a: _Sink, b: _HashingFile) -> None:
        self.a, self.b = a, b

    def write(self, data: bytes | memoryview) -> int:
        self.a.write(data)
        self.b.write(data)
        return len(data)
