"""Weight files: headers checked against the embedded table, sha256, tensors out of buffers.

Each safetensors shard is opened once; its size and header must match the manifest exactly
(the loader refuses anything else), and its tensors become views of whatever buffer holds
its data section (a mapping, a private copy or one device allocation).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .env import MAX_HEADER, ArtifactMismatchError, torch_dtype
from .proof import check_sha256
from .reading import PositionalSource, loads_json, open_regular, read_at

if TYPE_CHECKING:
    from types import ModuleType

    import torch
    from torch import Tensor


class TensorEntry(NamedTuple):
    """One tensor of a shard as the manifest pins it; bytes ``begin:end`` of the data section."""

    name: str
    code: str  # safetensors dtype code ("BF16", "F4", ...)
    shape: list[int]  # the torch shape (a packed float4's manifest torch_shape)
    begin: int
    end: int


class Shard:
    """One safetensors file, its header checked against the manifest, its fd open.

    The file's bytes are ``size`` bytes at ``base`` of the file ``path`` (0 for a file of its
    own; a page offset inside the weight layer blob that holds it); ``data_start`` is where
    its data section starts in that file, so every read is at ``data_start + begin``.
    ``proven_as_read``: its source proves every chunk it serves (a registry's,
    :class:`~.remote.RemoteFile`): readers neither hash it again nor map it.
    """

    def __init__(self, rel: str, path: Path, fd: int | PositionalSource, size: int, head: bytes,
                 tensors: list[TensorEntry], base: int = 0, label: str | Path | None = None, *,
                 proven_as_read: bool = False) -> None:
        self.rel, self.path, self.fd, self.size, self.head = rel, path, fd, size, head
        self.proven_as_read = proven_as_read
        self.base = base
        self.data_start = base + len(head)
        self.data_size = size - len(head)
        self.tensors = tensors  # sorted by begin
        self.label = str(label) if proven_as_read else os.path.abspath(label if label is not None else path)

    def check_sha256(self, got: str, want: str) -> None:
        """Raise unless ``got == want``, naming the file (and, in a layer blob, where it lies)."""
        held = f" (its bytes lie in {os.path.abspath(self.path)} at offset {self.base})" if self.base else ""
        check_sha256(self.label, got, want, held)

    def close(self) -> None:
        if isinstance(self.fd, int) and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def pread_exact(fd: int | PositionalSource, n: int, offset: int, rel: str) -> bytes:
    """Exactly ``n`` bytes at ``offset`` of ``fd`` (an open file or a view's source)."""
    buf = bytearray(n)
    read_at(fd, memoryview(buf), offset, rel)
    return bytes(buf)


def open_shard(rel: str, path: Path, meta: dict[str, Any], table: dict[str, Any], *,
               random_access: bool = False, base: int = 0, label: str | Path | None = None) -> Shard:
    """Open ``path`` and check its size and safetensors header against the manifest.

    ``random_access``: readahead off from the first read on (``POSIX_FADV_RANDOM``), for a
    reader of some slices only (tensor parallel ranks): the header read would otherwise read
    ahead into the first tensors, other ranks' bytes among them. ``base``: the file's bytes
    start there in ``path`` (a layer blob holding it; the blob may go on after them), and
    ``label`` is the name messages give the file (default ``path``).

    Raises:
        ArtifactMismatchError: missing file, wrong size, or a header that differs.
    """
    # errors name the file on this machine, not the manifest's path
    where = os.path.abspath(path) + (f" (at offset {base})" if base else "")
    try:
        fd = open_regular(path)  # a FIFO or a device is refused before anything blocks or is read
    except FileNotFoundError:
        raise ArtifactMismatchError(f"{rel}: missing (looked for {path}); set PACKER_ARTIFACTS "
                                    "or PACKER_WEIGHTS_DIR to where the build put it") from None
    try:
        if random_access and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        size = os.fstat(fd).st_size - base
        if size != meta["size"] if not base else size < meta["size"]:
            raise ArtifactMismatchError(f"{where}: {size} bytes, the manifest says {meta['size']}; "
                                        "these weights are not from this build")
        return read_header(rel, path, fd, meta["size"], table, base=base, label=label, where=where)
    except BaseException:
        os.close(fd)
        raise


def read_header(rel: str, path: Path, fd: int | PositionalSource, size: int, table: dict[str, Any], *,
                base: int = 0, label: str | Path | None = None, where: str = "",
                proven_as_read: bool = False) -> Shard:
    """The :class:`Shard` of the ``size`` bytes at ``base`` of ``fd`` (an open file, or a source
    of a build's view: :mod:`.view`), its safetensors header read and checked against ``table``.

    Raises:
        ArtifactMismatchError: an impossible header length, or a header that differs.
    """
    where = where or str(label or path)
    if size < 8:
        raise ArtifactMismatchError(f"{where}: {size} bytes, too short for a safetensors header")
    n = struct.unpack("<Q", pread_exact(fd, 8, base, where))[0]
    if n > min(size - 8, MAX_HEADER):
        raise ArtifactMismatchError(f"{where}: header length {n} is impossible for {size} bytes")
    raw = pread_exact(fd, n, base + 8, where)
    tensors = _check_header(rel, raw, size - 8 - n, table, where)
    return Shard(rel, path, fd, size, struct.pack("<Q", n) + raw, tensors, base, label,
                 proven_as_read=proven_as_read)


def _check_header(rel: str, raw: bytes, data_len: int,
                  table: dict[str, Any], where: str) -> list[TensorEntry]:
    header = loads_json(raw, f"{where}: safetensors header", top=object)
    if not isinstance(header, dict):
        raise ArtifactMismatchError(f"{where}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    want = {k: v for k, v in table.items() if v["file"] == rel}
    if set(header) != set(want):
        extra, gone = sorted(set(header) - set(want)), sorted(set(want) - set(header))
        raise ArtifactMismatchError(f"{where}: header tensors differ from the manifest "
                                    f"(unexpected {extra[:3]}, missing {gone[:3]})")
    out = []
    for name, rec in want.items():
        got = header[name]
        if not isinstance(got, dict):  # a corrupt entry is a mismatch like any other
            raise ArtifactMismatchError(f"{where}: tensor {name!r}: header entry is {type(got).__name__}, "
                                        "not an object; the file is corrupt or from another build")
        for key in ("dtype", "shape", "data_offsets"):
            expected = rec[key] if key == "dtype" else list(rec[key])
            if got.get(key) != expected:
                raise ArtifactMismatchError(f"{where}: tensor {name!r} {key} is {got.get(key)!r:.80}, "
                                            f"the manifest says {rec[key]}")
        begin, end = rec["data_offsets"]
        if not 0 <= begin <= end <= data_len:
            raise ArtifactMismatchError(f"{where}: tensor {name!r} lies outside the data section")
        # packed float4: the header counts single values, the manifest keeps the torch shape
        out.append(TensorEntry(name, rec["dtype"], list(rec.get("torch_shape", rec["shape"])), begin, end))
    out.sort(key=lambda t: (t.begin, t.name))
    return out


CPU_ALIGN = 64  # torch's CPU allocator gives this; oneDNN's kernels take another path below it


def tensor_view(torch: ModuleType, buf: torch.Tensor, begin: int, end: int, code: str, shape: list[int],
                where: str, *, aligned: bool = True) -> torch.Tensor:
    """A tensor of ``buf[begin:end]`` (a uint8 buffer); misaligned bytes get a same-device copy.

    Element misalignment is always copied (``view(dtype)`` needs it); with ``aligned``, so is
    a CPU start that is not ``CPU_ALIGN``-byte aligned: CPU kernels such as oneDNN's
    convolutions round differently on such pointers than on the library's own allocations.
    """
    dt, size = torch_dtype(code, where)
    raw = buf[begin:end]
    if begin % size or (aligned and raw.device.type == "cpu" and raw.data_ptr() % CPU_ALIGN):
        raw = raw.clone()  # the copy stays on the device; CPU allocations are CPU_ALIGN-aligned
    return raw.view(dt).view(tuple(shape))


def shard_tensors(torch: ModuleType, shards: list[Shard], bufs: list[tuple[torch.Tensor, int]],
                  dtype: torch.dtype | None, aliases: dict[str, str], *,
                  offsets: list[dict[str, int]] | None = None,
                  copied: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of ``shards`` as a view of its buffer (cast to ``dtype``), plus ``aliases``.

    ``bufs`` holds each shard's buffer and the offset of its data section in it; with
    ``offsets`` (a device layout, see ``layout``), each tensor starts at its laid-out offset.
    A tensor that cannot be a view (misaligned, see :func:`tensor_view`) is a copy; its name
    is appended to ``copied``.
    """
    out: dict[str, Tensor] = {}
    for i, (s, (buf, base)) in enumerate(zip(shards, bufs, strict=True)):
        for name, code, shape, begin, end in s.tensors:
            at = offsets[i][name] if offsets is not None else base + begin
            dt = torch_dtype(code, name)[0]
            # packed float4 has no cast in torch: it stays as stored, as integers do
            cast = dtype is not None and code != "F4" and dt.is_floating_point and dt != dtype
            t = tensor_view(torch, buf, at, at + end - begin, code, shape, f"{s.rel}: tensor {name!r}",
                            aligned=not cast)  # a cast allocates anew anyway
            if copied is not None and not cast and end > begin and t.data_ptr() != buf[at:].data_ptr():
                copied.append(name)
            out[name] = t.to(dtype) if cast else t
    for alias, kept in sorted(aliases.items()):
        out[alias] = out[kept]
    return out
