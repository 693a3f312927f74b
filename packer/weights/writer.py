"""Stream a planned shard to disk: kernel copies for contiguous tensors, hashing on a 2nd core.

The main thread moves bytes: ``os.copy_file_range`` from the input file for contiguous tensors
(falling back to ``pread``/``pwrite``), a numpy strided gather over an mmap for other views,
and a chunked torch cast only when a dtype cast is asked for (torch is imported there and
nowhere else). With ``verify`` each span is read back from the output right after it lands
and compared bytewise (memcmp) with what it should hold; a hasher thread follows behind in
file order, so the sha256 runs on the second core while the first copies (hashlib releases
the GIL). Memory stays bounded by a few chunks.

With a layer framing and ``blob``, the file written is the shard's image layer itself: the
tar prefix, the safetensors bytes at ``len(prefix)`` (a page boundary), the suffix, so OUT
holds the weights once; the shard's sha256 and the layer's digest are computed from the same
bytes in the same pass, or neither (``hashed=False``): ``packer build`` re-reads the blob,
hashes both there and names the blob by its digest, while the read-back here still proves
that each span landed as meant; the framing, which is not read back, the build compares with
the framing it computes itself.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packer.checkpoint.records import DTYPE_SIZES, TensorRecord
from packer.errors import WeightsError
from packer.reading import map_readonly
from packer.stage import Progress
from packer.util.formats import CAST_DTYPES
from packer.util.fsutil import HashThread, umask
from packer.weights.assemble import piece_blocks, row_pieces
from packer.weights.plan import PlannedTensor, ShardPlan

CHUNK = 8 * 2**20  # a gathered or cast tensor's block (few numpy/torch calls), and verify_written's compare
# one kernel copy and its read-back: small enough that the read-back finds the bytes it just
# copied still in the core's own cache (2 MB L2 here; 1 GB copied and read back in 0.55 s with
# 256 KiB spans against 0.70 s with 8 MiB ones: benchmarks/RESULTS.md, issue 30)
SPAN = 2**18
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM}
_TORCH_DTYPES = {code: name for name, code in CAST_DTYPES.items()}  # safetensors code -> torch name


@dataclass(frozen=True)
class WrittenShard:
    """A shard written to ``path`` (a temporary name until committed)."""

    path: Path
    size: int
    sha256: str
    checked: frozenset[str]  # tensors whose written bytes were compared with the input
    framed_sha256: str | None = None  # sha256 of framing[0] + file + framing[1], if asked
    base: int = 0  # where the safetensors bytes start in ``path`` (a blob: len(framing[0]))


class Sources:
    """Open input files, each once: a file descriptor and a read-only mmap."""

    def __init__(self) -> None:
        self._open: dict[Path, tuple[int, mmap.mmap | None]] = {}

    def get(self, path: Path) -> tuple[int, memoryview]:
        if path not in self._open:
            fd, mm, _ = map_readonly(path, WeightsError)  # the file the reader saw; never a FIFO swapped in
            self._open[path] = (fd, mm)
        fd, mm = self._open[path]
        return fd, memoryview(mm) if mm is not None else memoryview(b"")

    def __enter__(self) -> Sources:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every file (an mmap still viewed elsewhere closes when it is collected)."""
        for fd, mm in self._open.values():
            if mm is not None:
                with contextlib.suppress(BufferError):
                    mm.close()
            os.close(fd)
        self._open.clear()


def uint_view(r: TensorRecord, data: memoryview) -> Any:
    """The record's view as unsigned integers over ``data`` (bit patterns: NaN-safe)."""
    import numpy as np

    size = DTYPE_SIZES[r.dtype]
    base = np.frombuffer(data, dtype=f"<u{size}", count=r.storage.nbytes // size,
                         offset=r.storage.offset)
    return np.lib.stride_tricks.as_strided(
        base[r.storage_offset:], shape=r.shape, strides=[s * size for s in r.stride],
        writeable=False,
    )


def tensor_chunks(t: PlannedTensor, data: memoryview) -> Iterator[bytes | memoryview]:
    """The output bytes of a gathered or cast tensor, in row-major chunks of about CHUNK."""
    if t.record.numel:
        for block in _blocks(uint_view(t.record, data)):
            yield _out_bytes(t, block)


def _blocks(view: Any) -> Iterator[Any]:
    if view.ndim == 0 or view.nbytes <= CHUNK:
        yield view
        return
    row = view.nbytes // view.shape[0]
    if row > CHUNK and view.ndim > 1:
        for i in range(view.shape[0]):
            yield from _blocks(view[i])
        return
    step = max(1, CHUNK // row)
    for i in range(0, view.shape[0], step):
        yield view[i:i + step]


def _out_bytes(t: PlannedTensor, part: Any) -> bytes | memoryview:
    import numpy as np

    dense = np.ascontiguousarray(part)
    if not t.cast:
        return dense.data.cast("B")
    import torch  # only the cast path pays for torch

    with warnings.catch_warnings():  # read-only input: torch warns, but we never write to it
        warnings.simplefilter("ignore", UserWarning)
        src = torch.from_numpy(dense.reshape(-1))
    src = src.view(getattr(torch, _TORCH_DTYPES[t.record.dtype]))
    out = src.to(getattr(torch, _TORCH_DTYPES[t.dtype])).contiguous()
    return out.view(torch.uint8).numpy().tobytes()


class _Output:
    """The shard being written: bytes land at a position, are read back if verifying, hashed."""

    def __init__(self, path: Path, label: Path, verify: bool,
                 framing: tuple[bytes, bytes] | None = None, blob: bool = False, hashed: bool = True) -> None:
        self.label = label
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 & ~umask())
        self.ro = os.open(path, os.O_RDONLY) if verify else -1
        self.buf = bytearray(SPAN if verify else 0)
        self.file = HashThread() if hashed else None
        # the framed hash (e.g. the file's image layer) runs on its own thread too
        self.framed = HashThread(framing[0]) if framing is not None and hashed else None
        self.hashers = [h for h in (self.file, self.framed) if h is not None]
        self.suffix = framing[1] if framing else b""
        self.prefix = framing[0] if framing and blob else b""
        self.base = len(self.prefix)  # the shard's byte 0 in the file written

    def landed(self, pos: int, expected: Any, name: str) -> None:
        """``expected`` now lies at ``pos``: compare it with the file (verify), then hash it."""
        if self.ro >= 0:
            view = memoryview(self.buf)
            for i in range(0, len(expected), SPAN):
                want = expected[i:i + SPAN]
                n = os.preadv(self.ro, [view[:len(want)]], self.base + pos + i)
                got = self.buf if n == SPAN else self.buf[:n]  # bytearray == buffer: memcmp
                if n != len(want) or got != want:
                    raise WeightsError(f"{self.label}: tensor {name!r}: bytes read back at "
                                       f"offset {pos + i} differ from what was written")
        for h in self.hashers:
            h.update(expected)

    def frame(self, end: int) -> None:
        """A blob: write the tar framing around the ``end`` bytes of the shard."""
        if self.prefix:
            _pwrite_all(self.fd, self.prefix, 0)
            _pwrite_all(self.fd, self.suffix, self.base + end)

    def close(self) -> tuple[str, str | None]:
        """Stop hashing, close the file; return the sha256 ("" when not hashed) and the framed
        sha256 (hex; None without a framing or when not hashed)."""
        for h in self.hashers:
            h.close()
        os.close(self.fd)
        if self.ro >= 0:
            os.close(self.ro)
        try:
            if self.framed is not None:
                self.framed.sha.update(self.suffix)
            return (self.file.hexdigest() if self.file is not None else "",
                    self.framed.hexdigest() if self.framed is not None else None)
        except Exception as e:
            raise WeightsError(f"{self.label}: hashing failed: {e}") from e


def _pwrite_all(fd: int, data: bytes, at: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, memoryview(data)[done:], at + done)


def _kernel_copy(src_fd: int, dst_fd: int, src_pos: int, dst_pos: int, n: int) -> int:
    try:
        return os.copy_file_range(src_fd, dst_fd, n, src_pos, dst_pos)
    except OSError as e:
        if e.errno not in _NO_KERNEL_COPY:
            raise
    data = os.pread(src_fd, n, src_pos)  # file systems without copy_file_range
    return os.pwrite(dst_fd, data, dst_pos) if data else 0


def _copy_span(t: PlannedTensor, fd: int, data: memoryview, out: _Output, pos: int,
               progress: Progress | None) -> None:
    src, end = t.source_offset, t.source_offset + (t.end - t.begin)
    while src < end:
        n = min(SPAN, end - src)
        done = _kernel_copy(fd, out.fd, src, out.base + pos, n)
        if done <= 0:
            raise WeightsError(f"{t.record.storage.path}: tensor {t.record.name!r}: input "
                               f"ends at byte {src}, before the tensor's data ends; truncated?")
        out.landed(pos, data[src:src + done], t.name)
        src, pos = src + done, pos + done
        if progress is not None:
            progress(done)


def pieced_chunks(t: PlannedTensor, sources: Sources) -> Iterator[bytes | memoryview]:
    """The output bytes of a tensor assembled from pieces (:mod:`packer.weights.assemble`)."""
    for block in piece_blocks(t, lambda rec: uint_view(rec, sources.get(rec.storage.path)[1])):
        for part in _blocks(block):
            yield _out_bytes(t, part)


def _write_pieces(t: PlannedTensor, sources: Sources, out: _Output, pos: int, progress: Progress | None) -> bool:
    """Write an assembled tensor; True when every byte went by kernel copy (and was read back)."""
    rows = None if t.cast else row_pieces(t.record)
    if rows is None:
        _write_span(t, pieced_chunks(t, sources), out, pos, progress)
        return False
    for rec in rows:
        fd, data = sources.get(rec.storage.path)
        _copy_span(PlannedTensor(t.name, rec, rec.dtype, 0, rec.nbytes), fd, data, out, pos, progress)
        pos += rec.nbytes
    return True


def _write_span(t: PlannedTensor, chunks: Iterator[bytes | memoryview], out: _Output, pos: int,
                progress: Progress | None) -> None:
    start = pos
    for chunk in chunks:
        view = memoryview(chunk)
        done = 0
        while done < len(view):
            done += os.pwrite(out.fd, view[done:], out.base + pos + done)
        out.landed(pos, view, t.name)
        pos += len(view)
        if progress is not None:
            progress(len(view))
    if pos - start != t.end - t.begin:  # a plan/gather mismatch would corrupt every offset after
        raise WeightsError(f"tensor {t.name!r}: wrote {pos - start} bytes, planned {t.end - t.begin}")


def write_shard(
    shard: ShardPlan,
    path: Path,
    sources: Sources,
    *,
    verify: bool = True,
    progress: Progress | None = None,
    framing: tuple[bytes, bytes] | None = None,
    blob: bool = False,
    hashed: bool = True,
) -> WrittenShard:
    """Write one planned shard to ``path`` (created; must not exist) and hash it on the way.

    Args:
        shard: the planned shard (header bytes and tensors in file order).
        path: where to write; the caller renames it into place when all shards are done.
        sources: the open input files.
        verify: read every span back and compare it with what it should hold.
        progress: called with the number of tensor bytes written after each chunk (an
            increment, see :data:`packer.stage.Progress`).
        framing: ``(prefix, suffix)``: also hash ``prefix + file + suffix`` (the shard's
            image layer) on another thread, into ``framed_sha256``.
        blob: with ``framing``, write ``prefix + file + suffix`` to ``path`` (the layer blob;
            the shard starts at ``base = len(prefix)``); else the shard alone.
        hashed: False hashes nothing (``sha256`` is "", ``framed_sha256`` None), for a caller
            that re-reads what was written and hashes it there (``verify`` still compares).

    Returns:
        The written shard with its size and sha256.

    Raises:
        WeightsError: a truncated input or a read-back mismatch.
        OSError: the output cannot be written.
    """
    out = _Output(path, path.parent / shard.filename, verify, framing, blob, hashed)
    checked: set[str] = set()
    try:
        os.pwrite(out.fd, shard.header, out.base)
        out.landed(0, memoryview(shard.header), "(header)")
        pos = len(shard.header)
        for t in shard.tensors:
            if t.record.pieces:
                if _write_pieces(t, sources, out, pos, progress):
                    checked.add(t.name)
                pos += t.end - t.begin
                continue
            fd, data = sources.get(t.record.storage.path)
            if t.contiguous and not t.cast:
                _copy_span(t, fd, data, out, pos, progress)
                checked.add(t.name)
            else:
                _write_span(t, tensor_chunks(t, data), out, pos, progress)
            pos += t.end - t.begin
        out.frame(pos)
    except BaseException:
        with contextlib.suppress(Exception):
            out.close()
        raise
    digest, framed = out.close()
    return WrittenShard(path, pos, digest, frozenset(checked if verify else ()), framed, out.base)


class StagedFiles:
    """Temporary files in one directory, renamed to their final names together or removed."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.pending: list[tuple[Path, Path]] = []

    def temp_for(self, name: str) -> Path:
        """A fresh, not yet existing temporary path for the final name ``name``."""
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=self.directory)
        os.close(fd)
        os.unlink(tmp)  # write_shard creates it with O_EXCL and the umask's mode
        self.pending.append((Path(tmp), self.directory / name))
        return Path(tmp)

    def retarget(self, tmp: Path, final: Path) -> None:
        """Give the temporary file ``tmp`` another final path (a layer blob, left for its re-read)."""
        self.pending = [(t, final if t == tmp else f) for t, f in self.pending]

    def commit(self) -> None:
        """Rename every temporary file into place."""
        for tmp, final in self.pending:
            os.replace(tmp, final)
        self.pending.clear()

    def discard(self) -> None:
        """Remove every temporary file not yet committed."""
        for tmp, _ in self.pending:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self.pending.clear()
