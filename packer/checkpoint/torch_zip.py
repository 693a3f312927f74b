"""The torch zip format (torch.save since 1.6), parsed here rather than trusted to zipfile.

Only what torch writes is accepted: stored (uncompressed) entries under one archive prefix,
tiled from byte 0 to the central directory with nothing before or after, each local header
agreeing with its central directory entry. Storages are reported as byte ranges; their
bytes are never read here unless a CRC check is asked for.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from packer.checkpoint.allowlist import STORAGE_MODULES, STORAGE_TYPES, TORCH_DTYPES
from packer.checkpoint.pickle_vm import DEFAULT_POLICY, run_pickle
from packer.checkpoint.placeholders import GlobalPolicy
from packer.checkpoint.records import StorageRange
from packer.checkpoint.tree import Global, StorageRef, short
from packer.errors import CheckpointError, UnsafeInputError

_EOCD = b"PK\x05\x06"
_EOCD64 = b"PK\x06\x06"
_LOC64 = b"PK\x06\x07"
_CEN = b"PK\x01\x02"
_LOC = b"PK\x03\x04"
_DESC = b"PK\x07\x08"
_BAD_FLAGS = {0x1: "encrypted", 0x20: "compressed patched data", 0x40: "strong encryption",
              0x2000: "encrypted central directory"}
_SMALL = {"byteorder", "version", ".data/version", ".data/serialization_id",
          ".format_version", ".storage_alignment"}
MAX_PICKLE_BYTES = 256 << 20
MAX_ENTRIES = 1_000_000
_CRC_CHUNK = 16 << 20


@dataclass(frozen=True)
class ZipMember:
    """One stored entry: its data lies at ``offset`` for ``size`` bytes."""

    name: str
    header_offset: int
    offset: int
    size: int
    crc: int


def _fail(path: Path, place: str, reason: str) -> CheckpointError:
    return CheckpointError(f"{path}: {place}: {reason}")


def _read_at(f: BinaryIO, offset: int, n: int) -> bytes:
    f.seek(offset)
    return f.read(n)


def _find_eocd(f: BinaryIO, path: Path, size: int) -> tuple[int, int, int, int]:
    """Return (entries, cd_size, cd_offset, eocd_offset), handling zip64."""
    tail_len = min(size, 22 + 65535)
    tail = _read_at(f, size - tail_len, tail_len)
    at = tail.rfind(_EOCD)
    while at >= 0 and at + 22 > len(tail):
        at = tail.rfind(_EOCD, 0, at)
    if at < 0:
        raise _fail(path, "zip", "no end-of-central-directory record (truncated archive?)")
    eocd = size - tail_len + at
    _, disk, cd_disk, n_disk, n, cd_size, cd_off, clen = struct.unpack("<4sHHHHIIH", tail[at : at + 22])
    if eocd + 22 + clen != size:
        raise _fail(path, "zip", f"{size - eocd - 22 - clen} bytes of junk after the archive")
    if clen:
        raise _fail(path, "zip", "archive comment not allowed in a torch checkpoint")
    if disk or cd_disk or n_disk != n:
        raise _fail(path, "zip", "multi-disk archives are not supported")
    loc = _read_at(f, eocd - 20, 20) if eocd >= 20 else b""
    if loc[:4] == _LOC64:
        _, disk64, off64, ndisks = struct.unpack("<4sIQI", loc)
        if disk64 or ndisks != 1 or off64 + 56 > eocd - 20:
            raise _fail(path, "zip", "bad zip64 locator")
        rec = _read_at(f, off64, 56)
        sig, rsize, _, _, d1, d2, n1, n, cd_size, cd_off = struct.unpack("<4sQHHIIQQQQ", rec)
        if sig != _EOCD64 or off64 + 12 + rsize != eocd - 20 or d1 or d2 or n1 != n:
            raise _fail(path, "zip", "bad zip64 end-of-central-directory record")
        end_of_cd = off64
    elif n == 0xFFFF or 0xFFFFFFFF in (cd_size, cd_off):
        raise _fail(path, "zip", "zip64 end record missing")
    else:
        end_of_cd = eocd
    if cd_off + cd_size != end_of_cd:
        raise _fail(path, "zip", "central directory does not end where its end record begins")
    # each entry is 46 bytes and at most three 16-bit-counted fields: a directory claimed larger
    # would be read whole into memory for nothing
    if n > MAX_ENTRIES or not 46 * n <= cd_size <= n * (46 + 3 * 0xFFFF):
        raise _fail(path, "zip", f"central directory claims {n} entries in {cd_size} bytes")
    return n, cd_size, cd_off, end_of_cd


def _zip64_extra(extra: bytes, usize: int, csize: int, lho: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, ln = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + ln]
        if tag == 1:
            vals = list(struct.unpack_from(f"<{len(body) // 8}Q", body))
            if usize == 0xFFFFFFFF and vals:
                usize = vals.pop(0)
            if csize == 0xFFFFFFFF and vals:
                csize = vals.pop(0)
            if lho == 0xFFFFFFFF and vals:
                lho = vals.pop(0)
        pos += 4 + ln
    return usize, csize, lho


def _central_directory(
    f: BinaryIO, path: Path, n: int, cd_size: int, cd_off: int
) -> list[tuple[str, bytes, int, int, int, int]]:
    cd = _read_at(f, cd_off, cd_size)
    if len(cd) != cd_size:
        raise _fail(path, "zip", "central directory truncated")
    out, pos = [], 0
    for i in range(n):
        if cd[pos : pos + 4] != _CEN or pos + 46 > len(cd):
            raise _fail(path, "zip", f"central directory entry {i} is malformed")
        fields = struct.unpack_from("<4sHHHHHHIIIHHHHHII", cd, pos)
        flags, method, crc, csize, usize, nlen, elen, clen, disk, lho = (
            fields[3], fields[4], fields[7], fields[8], fields[9], fields[10], fields[11],
            fields[12], fields[13], fields[16],
        )
        raw = cd[pos + 46 : pos + 46 + nlen]
        extra = cd[pos + 46 + nlen : pos + 46 + nlen + elen]
        pos += 46 + nlen + elen + clen
        if pos > len(cd):
            raise _fail(path, "zip", f"central directory entry {i} runs past its end")
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _fail(path, "zip", f"entry {i} name is not UTF-8") from None
        _refuse_code(path, name)
        for bit, what in _BAD_FLAGS.items():
            if flags & bit:
                raise _fail(path, f"member {name}", f"flag 0x{bit:x} ({what}) not allowed")
        if method != 0:
            raise _fail(path, f"member {name}", f"compressed (method {method}); torch writes stored entries only")
        usize, csize, lho = _zip64_extra(extra, usize, csize, lho)
        if csize != usize or disk not in (0, 0xFFFF):
            raise _fail(path, f"member {name}", "sizes disagree for a stored entry")
        out.append((name, raw, flags, crc, usize, lho))
    if pos != len(cd):
        raise _fail(path, "zip", "junk inside the central directory")
    return out


def _local(f: BinaryIO, path: Path, entry: tuple[str, bytes, int, int, int, int], size: int) -> tuple[ZipMember, int]:
    """Check the local header (and data descriptor) of one entry; return it and its end."""
    name, raw, flags, crc, usize, lho = entry
    head = _read_at(f, lho, 30) if lho + 30 <= size else b""  # a zip64 offset may be any 64-bit number
    if len(head) != 30 or head[:4] != _LOC:
        raise _fail(path, f"member {name}", "local header missing or out of bounds")
    _, _, lflags, method, _, _, lcrc, lcsize, lusize, nlen, elen = struct.unpack("<4sHHHHHIIIHH", head)
    if _read_at(f, lho + 30, nlen) != raw:
        raise _fail(path, f"member {name}", "local header name differs from the central directory")
    if lflags != flags or method != 0:
        raise _fail(path, f"member {name}", "local header flags or method differ from the central directory")
    sizes_ok = (lcrc, lcsize, lusize) in ((0, 0, 0), (crc, usize, usize)) or (
        lcrc == crc and lcsize == lusize == 0xFFFFFFFF
    )
    if not sizes_ok or (not flags & 0x8 and lcrc != crc):
        raise _fail(path, f"member {name}", "local header CRC or sizes differ from the central directory")
    data = lho + 30 + nlen + elen
    end = data + usize
    if end > size:
        raise _fail(path, f"member {name}", "data runs past the end of the file")
    if flags & 0x8:
        end = _descriptor(f, path, name, end, crc, usize)
    return ZipMember(name, lho, data, usize, crc), end


def _descriptor(f: BinaryIO, path: Path, name: str, at: int, crc: int, usize: int) -> int:
    # The descriptor's signature is optional and its sizes are 4 or 8 bytes wide; the form
    # that agrees with the central directory and is followed by the next record wins.
    desc = _read_at(f, at, 30)
    for sig in (4, 0):
        if sig and desc[:4] != _DESC:
            continue
        for fmt in ("<III", "<IQQ"):
            end = sig + struct.calcsize(fmt)
            if len(desc) < end + 2 or desc[end : end + 2] != b"PK":
                continue
            if struct.unpack_from(fmt, desc, sig) == (crc, usize, usize):
                return at + end
    raise _fail(path, f"member {name}", "data descriptor disagrees with the central directory")


def read_zip_index(f: BinaryIO, path: Path, size: int) -> dict[str, ZipMember]:
    """Parse and check the whole zip structure; return members by full name.

    Raises:
        CheckpointError: anything but a tiled, stored, consistent archive.
    """
    n, cd_size, cd_off, _ = _find_eocd(f, path, size)
    entries = _central_directory(f, path, n, cd_size, cd_off)
    members: dict[str, ZipMember] = {}
    ends: dict[int, int] = {}
    for entry in entries:
        if entry[0] in members:
            raise _fail(path, f"member {entry[0]}", "duplicate name in the archive")
        member, end = _local(f, path, entry, size)
        members[member.name] = member
        if member.header_offset in ends:
            raise _fail(path, f"member {member.name}", "shares its local header with another entry")
        ends[member.header_offset] = end
    expected = 0
    for start in sorted(ends):
        if start != expected:
            what = "junk before the archive" if expected == 0 else "gap or overlap between entries"
            raise _fail(path, "zip", f"{what} at byte {expected}")
        expected = ends[start]
    if expected != cd_off:
        raise _fail(path, "zip", f"gap or overlap before the central directory at byte {expected}")
    return members


def _refuse_code(path: Path, name: str) -> None:
    rel = name.split("/", 1)[-1]
    if rel == "constants.pkl" or rel.startswith(("code/", ".data/ts_code")):
        raise UnsafeInputError(
            f"{path}: member {name}: TorchScript archive (holds code); save a state_dict with torch.save instead"
        )


def _classify(path: Path, members: dict[str, ZipMember]) -> tuple[str, dict[str, ZipMember]]:
    prefixes = {name.split("/", 1)[0] for name in members}
    if len(prefixes) != 1 or any("/" not in name for name in members):
        raise _fail(path, "zip", f"expected one archive prefix, found {sorted(prefixes)[:5]}")
    prefix = prefixes.pop()
    rel = {name[len(prefix) + 1 :]: m for name, m in members.items()}
    for name in rel:
        if name.endswith(".pkl") and name != "data.pkl":
            raise UnsafeInputError(f"{path}: member {prefix}/{name}: extra pickle not allowed")
        key = name[5:] if name.startswith("data/") else None
        if name not in _SMALL and name != "data.pkl" and not (key and "/" not in key):
            raise _fail(path, f"member {prefix}/{name}", "unexpected member in a torch checkpoint")
    if "data.pkl" not in rel:
        raise _fail(path, "zip", f"no {prefix}/data.pkl (not a torch.save checkpoint)")
    return prefix, rel


def _read_member(f: BinaryIO, path: Path, m: ZipMember, cap: int) -> bytes:
    if m.size > cap:
        raise _fail(path, f"member {m.name}", f"{m.size} bytes is over the cap of {cap}")
    data = _read_at(f, m.offset, m.size)
    if zlib.crc32(data) != m.crc:
        raise _fail(path, f"member {m.name}", "CRC mismatch (corrupt file)")
    return data


def check_crc(f: BinaryIO, path: Path, m: ZipMember) -> None:
    """Stream one member through zlib.crc32 and compare with the archive's CRC."""
    f.seek(m.offset)
    crc, left = 0, m.size
    while left:
        chunk = f.read(min(left, _CRC_CHUNK))
        if not chunk:
            raise _fail(path, f"member {m.name}", "truncated")
        crc = zlib.crc32(chunk, crc)
        left -= len(chunk)
    if crc != m.crc:
        raise _fail(path, f"member {m.name}", "CRC mismatch (corrupt file)")


def _storage_loader(path: Path, prefix: str, rel: dict[str, ZipMember]) -> Callable[[object], StorageRef]:
    cache: dict[str, StorageRef] = {}
    where = f"{path}: {prefix}/data.pkl"

    def load(pid: object) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafeInputError(f"{where}: persistent id is not a storage: {short(pid)}")
        _, stype, key, _, numel = pid
        if not isinstance(stype, Global) or stype.module not in STORAGE_MODULES or stype.name not in STORAGE_TYPES:
            raise CheckpointError(f"{where}: persistent id has no storage type")
        if not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise CheckpointError(f"{where}: malformed storage id {short(pid)}")
        dtype = STORAGE_TYPES[stype.name]
        member = rel.get(f"data/{key}")
        if member is None:
            raise CheckpointError(f"{where}: storage {key}: member {prefix}/data/{key} is missing")
        nbytes = numel * TORCH_DTYPES[dtype][1]
        if nbytes != member.size:
            raise CheckpointError(f"{where}: storage {key}: declares {nbytes} bytes but the member holds {member.size}")
        ref = cache.get(key)
        if ref is None:
            rng = StorageRange(f"data/{key}", path, member.offset, member.size)
            ref = cache[key] = StorageRef(key, dtype, numel, rng)
        elif ref.dtype != dtype:
            raise CheckpointError(f"{where}: storage {key} used as both {ref.dtype} and {dtype}")
        return ref

    return load


def load_torch_zip(f: BinaryIO, path: Path, size: int, *, verify_crc: bool = False,
                   policy: GlobalPolicy = DEFAULT_POLICY) -> object:
    """Parse a torch zip checkpoint and run its data.pkl; return the pickled root object.

    Args:
        f: the open file; path: its name for messages; size: its length in bytes.
        verify_crc: also stream every storage through CRC-32 (costs one read of the file).
        policy: the globals the pickle may name (placeholder types included).

    Raises:
        CheckpointError / UnsafeInputError: a malformed or disallowed archive or pickle.
    """
    prefix, rel = _classify(path, read_zip_index(f, path, size))
    small = {k: _read_member(f, path, m, 4096) for k, m in rel.items() if k in _SMALL}
    if small.get("byteorder", b"little") != b"little":
        raise _fail(path, f"member {prefix}/byteorder", "only little-endian checkpoints are supported")
    pkl = _read_member(f, path, rel["data.pkl"], MAX_PICKLE_BYTES)
    root, _ = run_pickle(pkl, where=f"{path}: {prefix}/data.pkl",
                         persistent_load=_storage_loader(path, prefix, rel), policy=policy)
    if verify_crc:
        for name, m in rel.items():
            if name.startswith("data/"):
                check_crc(f, path, m)
    return root
