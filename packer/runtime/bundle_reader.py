"""Safe reader of packer's tokenizer/config bundle (``bundle.tar.zst``).

Self-contained on purpose (standard library + zstandard, no other module): the build's
bundle writer and ``packer verify`` use it as the loader does, which imports it (and so
zstandard) only when a bundle is first read. The archive is opened once and read once;
its zstd frames are walked by hand (window, declared size, trailing data; skippable frames
skipped) and then decompressed in sequence as a stream under one output cap; the tar headers are parsed here, not by
``tarfile``, whose filters have a long history of bypasses. Anything unexpected rejects
the whole archive with :class:`BundleFormatError` before a single byte is written.

Extraction writes every file itself (``O_CREAT|O_EXCL|O_NOFOLLOW`` relative to directory
descriptors). :func:`extract_cached` makes the result content-addressed by the archive's
sha256 and publishes it with one ``rename``, so workers starting together share one copy.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import tempfile
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import zstandard

from .bundle_cache import cache_root, cached
from .bundle_cache import is_dir as _is_dir
from .env import ArtifactMismatchError
from .inflate import STEP, InflateError, OverCapError, collect
from .reading import open_regular

DEFAULT_MAX_BYTES = 512 * 2**20  # decompressed tar stream; the largest tokenizers are ~50 MB
DEFAULT_MAX_MEMBERS = 10_000
DEFAULT_MAX_DEPTH = 16
DEFAULT_MAX_WINDOW = 16 * 2**20  # zstd -19 uses 8 MiB, packer's level 3 at most 2 MiB

_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_SKIPPABLE = 0x184D2A50  # skippable frames: magic 0x184D2A50..5F, 4-byte size, user data
_MAX_FRAMES = 1 << 16
_MAX_ZSTD_BLOCK = 128 * 1024
_MAX_PAX = 64 * 1024
# PAX records that change nothing we rely on; "size" must equal the ustar size field.
_PAX_HARMLESS = frozenset({"mtime", "atime", "ctime", "uid", "gid", "uname", "gname", "comment"})
_DRIVE = re.compile(r"^[A-Za-z]:")
_KINDS = {b"1": "a hard link", b"2": "a symbolic link", b"3": "a character device",
          b"4": "a block device", b"6": "a FIFO", b"7": "a contiguous file", b"g": "a global PAX header",
          b"L": "a GNU long name", b"K": "a GNU long link name", b"S": "a GNU sparse file"}
_NUMERIC = ((108, 116, "uid"), (116, 124, "gid"), (136, 148, "mtime"), (329, 337, "devmajor"),
            (337, 345, "devminor"))
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class BundleFormatError(ValueError):
    """The archive is malformed, hostile or over a cap; the whole archive is rejected."""


class BundleOverCapError(BundleFormatError, OverCapError):
    """Compressed bundle data whose output would pass its byte cap: a format error that is also
    the one kind of refusal a caller that lowered the cap (to a memory limit) may explain."""


def member_key(name: str) -> str:
    """The key two names collide on: NFKC, case folded, NFKC again (as on macOS/Windows and worse)."""
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", name).casefold())


def check_name(name: str, *, max_depth: int = DEFAULT_MAX_DEPTH) -> tuple[str, ...]:
    """Return the components of a member name, or raise BundleFormatError saying why not."""
    if not name:
        raise BundleFormatError("empty member name")
    if name.startswith("/"):
        raise BundleFormatError(f"member {name!r}: absolute name")
    if "\\" in name:
        raise BundleFormatError(f"member {name!r}: backslash in name")
    if _DRIVE.match(name):
        raise BundleFormatError(f"member {name!r}: drive letter in name")
    if any(ord(c) < 0x20 or c == "\x7f" for c in name):
        raise BundleFormatError(f"member {name!r}: control character in name")
    parts = tuple(name.split("/"))
    for part in parts:
        folded = member_key(part)
        if part == ".." or folded == "..":
            raise BundleFormatError(f"member {name!r}: '..' component")
        if part in ("", ".") or folded in ("", ".") or "/" in folded or "\\" in folded:
            raise BundleFormatError(f"member {name!r}: empty, '.' or ambiguous component {part!r}")
    if len(parts) > max_depth:
        raise BundleFormatError(f"member {name!r}: {len(parts)} levels deep, over the cap of {max_depth}")
    return parts


# ---------------------------------------------------------------------------------------
# zstd: frames walked by hand (skippable ones skipped), then decompressed under caps


def _frame_end(data: bytes | bytearray, start: int, max_window: int, budget: list[int]) -> tuple[int, int | None]:
    """Check one zstd frame's header and block layout; return its end and declared size.

    ``budget`` holds the zstd blocks still allowed (shared by all frames: it bounds the walk).
    """
    n = len(data)
    if n - start < 6 or data[start : start + 4] != _ZSTD_MAGIC:
        raise BundleFormatError(f"not a zstd frame at byte {start} (bad magic number)")
    fhd = data[start + 4]
    fcs_flag, single, checksum, dict_flag = fhd >> 6, fhd >> 5 & 1, fhd >> 2 & 1, fhd & 3
    if fhd & 0x08:
        raise BundleFormatError("zstd frame header has its reserved bit set")
    if dict_flag:
        raise BundleFormatError("zstd frame needs a dictionary")
    pos, window = start + 5, 0
    if not single:
        exponent, mantissa = data[pos] >> 3, data[pos] & 7
        base = 1 << (10 + exponent)
        window, pos = base + (base >> 3) * mantissa, pos + 1
    fcs_len = (single, 2, 4, 8)[fcs_flag]
    if pos + fcs_len > n:
        raise BundleFormatError("truncated zstd frame header")
    declared = None
    if fcs_len:
        declared = int.from_bytes(data[pos : pos + fcs_len], "little") + (256 if fcs_len == 2 else 0)
        window = declared if single else window
    pos += fcs_len
    if window > max_window:
        raise BundleFormatError(f"zstd window of {window} bytes is over the cap of {max_window}")
    last = 0
    while not last:
        budget[0] -= 1
        if budget[0] < 0:
            raise BundleFormatError("too many zstd blocks for the size cap")
        if pos + 3 > n:
            raise BundleFormatError("truncated zstd frame (block header)")
        head = int.from_bytes(data[pos : pos + 3], "little")
        last, kind, size = head & 1, head >> 1 & 3, head >> 3
        if kind == 3 or size > _MAX_ZSTD_BLOCK:
            raise BundleFormatError(f"invalid zstd block at byte {pos}")
        pos += 3 + (1 if kind == 1 else size)
    pos += 4 * checksum
    if pos > n:
        raise BundleFormatError("truncated zstd frame")
    return pos, declared


def _frames(data: bytes | bytearray, max_window: int, max_bytes: int) -> list[tuple[int, int, int | None]]:
    """The zstd frames of ``data`` in order, as (start, end, declared size); skippable frames
    are skipped, and anything that is no frame (trailing junk) is refused."""
    frames: list[tuple[int, int, int | None]] = []
    pos, n, declared_total = 0, len(data), 0
    budget = [max_bytes // 1024 + 4096]  # zstd blocks hold up to 128 KiB; bounds the walk
    while pos < n:
        if len(frames) >= _MAX_FRAMES:
            raise BundleFormatError(f"more than {_MAX_FRAMES} zstd frames")
        magic = int.from_bytes(data[pos : pos + 4], "little") if n - pos >= 4 else -1
        if magic & 0xFFFFFFF0 == _SKIPPABLE:
            if n - pos < 8:
                raise BundleFormatError(f"truncated skippable zstd frame at byte {pos}")
            size = int.from_bytes(data[pos + 4 : pos + 8], "little")
            if size > n - pos - 8:
                raise BundleFormatError(f"skippable zstd frame at byte {pos} runs past the end")
            pos += 8 + size
            budget[0] -= 1  # a flood of empty skippable frames costs the walk too
            if budget[0] < 0:
                raise BundleFormatError("too many zstd frames for the size cap")
            continue
        if frames and data[pos : pos + 4] != _ZSTD_MAGIC:
            raise BundleFormatError(f"{n - pos} bytes of trailing data after the zstd frames")
        end, declared = _frame_end(data, pos, max_window, budget)
        declared_total += declared or 0
        if declared_total > max_bytes:
            raise BundleOverCapError(f"zstd data declares {declared_total} bytes, over the cap of {max_bytes}")
        frames.append((pos, end, declared))
        pos = end
    if not frames:
        raise BundleFormatError("not a zstd frame (bad magic number)")
    return frames


def decompress(data: bytes | bytearray, max_bytes: int, max_window: int = DEFAULT_MAX_WINDOW) -> bytearray:
    """zstd ``data`` (one or more frames) decompressed, at most ``max_bytes``.

    Raises:
        BundleFormatError: malformed frames, a window over ``max_window``, or (its subclass
            :class:`BundleOverCapError`) over the cap.
    """
    return _decompress(data, max_bytes, max_window)


def _decompress(data: bytes | bytearray, max_bytes: int, max_window: int) -> bytearray:
    frames = _frames(data, max_window, max_bytes)
    try:
        return collect(_zstd_pieces(memoryview(data), frames, max_window), max_bytes)
    except OverCapError as e:
        raise BundleOverCapError(str(e)) from None
    except InflateError as e:
        raise BundleFormatError(str(e)) from None
    except zstandard.ZstdError as e:
        raise BundleFormatError(f"corrupt zstd data: {e}") from e


def _zstd_pieces(view: memoryview, frames: list[tuple[int, int, int | None]], max_window: int) -> Iterator[bytes]:
    """Each frame's output in pieces of at most :data:`~.inflate.STEP` bytes (the growth and the
    cap are :func:`~.inflate.collect`'s), every frame holding the size it declares."""
    dctx = zstandard.ZstdDecompressor(max_window_size=max(max_window, 1 << 10))
    for start, end, declared in frames:
        got = 0
        with dctx.stream_reader(view[start:end], read_size=STEP, read_across_frames=False) as reader:
            while chunk := reader.read(STEP):
                got += len(chunk)
                yield chunk
        if declared is not None and got != declared:
            raise BundleFormatError(f"zstd frame at byte {start} declares {declared} bytes but holds {got}")


# ---------------------------------------------------------------------------------------
# tar: ustar headers and PAX "x" records (a "path" only for a name ustar cannot hold)


def _octal(field: bytes, what: str, at: int) -> int:
    if field[:1] and field[0] & 0x80:
        raise BundleFormatError(f"header at byte {at}: base-256 {what} is not supported")
    text = field.rstrip(b"\0 ").lstrip(b" ")
    if text.strip(b"01234567"):
        raise BundleFormatError(f"header at byte {at}: {what} field is not octal: {bytes(field)!r}")
    return int(text, 8) if text else 0


def _cstr(field: bytes, what: str, at: int) -> bytes:
    text, _, rest = bytes(field).partition(b"\0")
    if rest.strip(b"\0"):
        raise BundleFormatError(f"header at byte {at}: {what} field has bytes after its terminator")
    return text


def _header(block: bytes, at: int) -> tuple[bytes, bytes, int, int]:
    """Check one ustar header; return (type, raw name, mode, size); a link name is refused."""
    stored = _octal(block[148:156], "checksum", at)
    if stored != sum(block[:148]) + 8 * 0x20 + sum(block[156:]):
        raise BundleFormatError(f"header at byte {at}: bad checksum")
    if block[257:265] != b"ustar\x0000":
        raise BundleFormatError(f"header at byte {at}: not a POSIX ustar/pax header")
    kind = bytes(block[156:157])
    name = _cstr(block[0:100], "name", at)
    prefix = _cstr(block[345:500], "prefix", at)
    for lo, hi, what in _NUMERIC:
        _octal(block[lo:hi], what, at)
    mode, size = _octal(block[100:108], "mode", at), _octal(block[124:136], "size", at)
    if kind not in (b"0", b"\0", b"5", b"x"):
        what = _KINDS.get(kind, f"an unsupported member type {kind!r}")
        raise BundleFormatError(f"header at byte {at} ({name[:100]!r}): {what} is not allowed")
    if _cstr(block[157:257], "link name", at):
        raise BundleFormatError(f"header at byte {at}: link name on a member that is not a link")
    return kind, (prefix + b"/" + name if prefix else name), mode, size


def _parse_pax(buf: bytes, at: int) -> dict[str, str]:
    records: dict[str, str] = {}
    pos = 0
    while pos < len(buf):
        space = buf.find(b" ", pos, pos + 12)
        digits = buf[pos:space] if space > pos else b""
        if not digits.isdigit() or digits.startswith(b"0"):
            raise BundleFormatError(f"PAX header at byte {at}: malformed record length")
        end = pos + int(digits)
        key, eq, value = buf[space + 1 : end - 1].partition(b"=")
        if end > len(buf) or end <= space + 1 or buf[end - 1 : end] != b"\n" or not eq or not key:
            raise BundleFormatError(f"PAX header at byte {at}: malformed record")
        try:
            k, v = key.decode("utf-8"), value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BundleFormatError(f"PAX header at byte {at}: record is not UTF-8") from e
        if k in records:
            raise BundleFormatError(f"PAX header at byte {at}: duplicate record {k!r}")
        records[k] = v
        pos = end
    return records


def _fits_ustar(name: bytes) -> bool:
    """True when a ustar header holds ``name`` (100 bytes, or a '/' split into 155 + 100)."""
    if len(name) <= 100:
        return True
    parts = name.split(b"/")
    return any(len(b"/".join(parts[:i])) <= 155 and 0 < len(b"/".join(parts[i:])) <= 100 for i in range(1, len(parts)))


def _pax_path(pax: dict[str, str], raw: bytes) -> bytes:
    """The member's name: a PAX ``path`` record only for a name no ustar header can hold.

    A ``path`` record for a name that would fit is a rename (tools that ignore PAX would see
    another name): refused, like ``linkpath``.
    """
    value = pax.get("path")
    if value is None:
        return raw
    name = value.encode("utf-8", "surrogateescape")
    if _fits_ustar(name):
        shown = raw.decode("utf-8", "replace")
        raise BundleFormatError(f"member {shown!r}: PAX header renames it (path={value!r})")
    return name


def _apply_pax(pax: dict[str, str], name: str, size: int) -> None:
    for key, value in pax.items():
        if key == "path":
            continue  # taken as the name by _pax_path
        if key == "linkpath":
            raise BundleFormatError(f"member {name!r}: PAX header renames it ({key}={value!r})")
        if key == "size" and value != str(size):
            raise BundleFormatError(f"member {name!r}: PAX size {value!r} differs from the header's {size}")
        if key != "size" and key not in _PAX_HARMLESS:
            raise BundleFormatError(f"member {name!r}: unsupported PAX record {key!r}")


def _member(kind: bytes, raw: bytes, mode: int, size: int, at: int, max_depth: int) -> tuple[str, tuple[str, ...]]:
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BundleFormatError(f"header at byte {at}: name {raw!r} is not UTF-8") from e
    if kind == b"5":
        name = name[:-1] if name.endswith("/") else name
        if size:
            raise BundleFormatError(f"member {name!r}: directory with a size of {size}")
    if mode & ~0o777:
        raise BundleFormatError(f"member {name!r}: mode {mode:#o} has setuid, setgid, sticky or unknown bits")
    return name, check_name(name, max_depth=max_depth)


class _Index:
    """Members seen so far, keyed so that case and Unicode variants collide."""

    def __init__(self, max_members: int) -> None:
        self.max_members = max_members
        self.keys: dict[str, str] = {}
        self.files: set[str] = set()
        self.parents: set[str] = set()

    def add(self, name: str, parts: tuple[str, ...], is_dir: bool) -> None:
        key = member_key(name)
        if key in self.keys:
            raise BundleFormatError(f"member {name!r}: duplicate of {self.keys[key]!r}")
        for i in range(1, len(parts)):
            parent = member_key("/".join(parts[:i]))
            if parent in self.files:
                raise BundleFormatError(f"member {name!r}: its parent is a file")
            self.parents.add(parent)
        if not is_dir:
            if key in self.parents:
                raise BundleFormatError(f"member {name!r}: a file with the name of a directory")
            self.files.add(key)
        self.keys[key] = name
        if len(self.keys) > self.max_members:
            raise BundleFormatError(f"more than the cap of {self.max_members} members")


def _parse_tar(data: bytearray, max_members: int, max_depth: int) -> dict[tuple[str, ...], tuple[int, int, bool]]:
    """Validate the tar stream; return {components: (offset, size, is_dir)}."""
    view, n, pos = memoryview(data), len(data), 0
    members: dict[tuple[str, ...], tuple[int, int, bool]] = {}
    index, pax, pax_at = _Index(max_members), None, 0
    while True:
        if pos + 2 * _BLOCK > n:
            raise BundleFormatError("truncated tar stream (no end-of-archive marker)")
        block = bytes(view[pos : pos + _BLOCK])
        if block == _ZERO_BLOCK:
            if pax is not None:
                raise BundleFormatError(f"PAX header at byte {pax_at} is not followed by a member")
            if data.count(0, pos) != n - pos:
                raise BundleFormatError(f"data after the tar end-of-archive marker at byte {pos}")
            return members
        kind, raw, mode, size = _header(block, pos)
        start = pos + _BLOCK
        if start + size > n:
            raise BundleFormatError(f"header at byte {pos}: size {size} runs past the end of the archive")
        if kind == b"x":
            if pax is not None or size > _MAX_PAX:
                raise BundleFormatError(f"PAX header at byte {pos}: repeated or over {_MAX_PAX} bytes")
            pax, pax_at = _parse_pax(bytes(view[start : start + size]), pos), pos
        else:
            name, parts = _member(kind, _pax_path(pax or {}, raw), mode, size, pos, max_depth)
            _apply_pax(pax or {}, name, size)
            index.add(name, parts, kind == b"5")
            members[parts] = (start, size, kind == b"5")
            pax = None
        pos = start + -(-size // _BLOCK) * _BLOCK


# ---------------------------------------------------------------------------------------
# the public reader


def _read_once(path: str | os.PathLike[str], limit: int) -> bytearray:
    """One open, one read: the whole archive, refused up front when over ``limit``."""
    try:  # the runtime's one way in: a FIFO or a device is refused by type before a byte is read
        fd = open_regular(path)
    except ArtifactMismatchError as e:
        raise BundleFormatError(f"{e}") from None
    try:
        st = os.fstat(fd)
        if st.st_size > limit:
            raise BundleFormatError(f"{os.fspath(path)}: {st.st_size} bytes, over the cap of {limit}")
        buf = bytearray(st.st_size)
        view, got = memoryview(buf), 0
        while got < st.st_size:
            k = os.readv(fd, [view[got:]])
            if k == 0:
                raise BundleFormatError(f"{os.fspath(path)}: shrank while being read")
            got += k
        return buf
    finally:
        os.close(fd)


def _compressed_limit(max_bytes: int) -> int:
    # incompressible data grows by 3 bytes per 128 KiB block plus the frame header
    return max_bytes + max_bytes // 1024 + 1024


class Bundle:
    """A bundle read and fully validated into memory; see :meth:`open`."""

    def __init__(self, tar: bytearray, members: dict[tuple[str, ...], tuple[int, int, bool]], sha256: str) -> None:
        self._tar = tar
        self._members = members
        self._files = {"/".join(p): (o, s) for p, (o, s, d) in members.items() if not d}
        self.sha256 = sha256  #: sha256 (hex) of the archive bytes

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES,
             max_members: int = DEFAULT_MAX_MEMBERS, max_depth: int = DEFAULT_MAX_DEPTH,
             max_window: int = DEFAULT_MAX_WINDOW) -> Bundle:
        """Read the archive with one open and one read, and validate all of it.

        Args:
            path: the ``bundle.tar.zst`` file.
            max_bytes: cap on the decompressed tar stream (and so on every member).
            max_members: cap on files plus directories.
            max_depth: cap on path components per member.
            max_window: cap on the zstd window (decoder memory).

        Raises:
            BundleFormatError: naming the archive, the member or byte offset, and the reason.
            OSError: the archive cannot be opened or read.
        """
        data = _read_once(path, _compressed_limit(max_bytes))
        try:
            return cls.from_bytes(data, max_bytes=max_bytes, max_members=max_members,
                                  max_depth=max_depth, max_window=max_window)
        except BundleFormatError as e:
            raise BundleFormatError(f"{os.fspath(path)}: {e}") from None

    @classmethod
    def from_bytes(cls, data: bytes | bytearray, *, max_bytes: int = DEFAULT_MAX_BYTES,
                   max_members: int = DEFAULT_MAX_MEMBERS, max_depth: int = DEFAULT_MAX_DEPTH,
                   max_window: int = DEFAULT_MAX_WINDOW) -> Bundle:
        """Validate archive bytes already in memory (same caps and errors as :meth:`open`)."""
        if len(data) > _compressed_limit(max_bytes):
            raise BundleFormatError(f"{len(data)} compressed bytes, over the cap for {max_bytes}")
        tar = _decompress(data, max_bytes, max_window)
        members = _parse_tar(tar, max_members, max_depth)
        return cls(tar, members, hashlib.sha256(data).hexdigest())

    @classmethod
    def from_tar(cls, tar: bytearray, *, max_members: int = DEFAULT_MAX_MEMBERS,
                 max_depth: int = DEFAULT_MAX_DEPTH) -> Bundle:
        """Validate an uncompressed tar stream (an image layer's) by the same rules and caps."""
        return cls(tar, _parse_tar(tar, max_members, max_depth), hashlib.sha256(tar).hexdigest())

    def subtree(self, prefix: tuple[str, ...]) -> dict[tuple[str, ...], tuple[memoryview, bool]]:
        """The members under ``prefix`` (a directory's components), by their path below it:
        ``{components: (bytes, is_dir)}``; the rest are left out."""
        view, n = memoryview(self._tar), len(prefix)
        return {parts[n:]: (view[o: o + s], d) for parts, (o, s, d) in self._members.items()
                if parts[:n] == prefix and len(parts) > n}

    def names(self) -> list[str]:
        """The regular files, sorted (directories are implied by the names)."""
        return sorted(self._files)

    def read(self, name: str) -> bytes:
        """The bytes of one file; KeyError if there is no such file."""
        offset, size = self._files[name]
        return bytes(self._tar[offset : offset + size])

    def extract(self, dest_dir: str | os.PathLike[str]) -> Path:
        """Write every member into ``dest_dir``, which must not exist or be empty.

        Returns:
            ``dest_dir`` as a Path.

        Raises:
            FileExistsError: ``dest_dir`` is not empty.
            OSError: the files cannot be written (nothing is cleaned up; use a fresh directory).
        """
        dest = Path(dest_dir)
        with contextlib.suppress(FileExistsError):
            os.mkdir(dest, 0o755)
        root = os.open(dest, _DIR_FLAGS)
        try:
            if os.listdir(root):
                raise FileExistsError(errno.ENOTEMPTY, "extraction target is not empty", str(dest))
            _write_tree(root, self._members, memoryview(self._tar))
        finally:
            os.close(root)
        return dest


def write_members(dest: str | os.PathLike[str], members: dict[tuple[str, ...], tuple[memoryview, bool]]) -> None:
    """Write ``members`` (as :meth:`Bundle.subtree` gives them, from one or more archives)
    into the empty directory ``dest``, by the extraction's rules (no link followed, none made).

    Raises:
        FileExistsError: ``dest`` is not empty; OSError: the files cannot be written.
    """
    data, flat = bytearray(), {}
    for parts, (raw, is_dir) in members.items():
        flat[parts] = (len(data), len(raw), is_dir)
        data += raw
    root = os.open(dest, _DIR_FLAGS)
    try:
        if os.listdir(root):
            raise FileExistsError(errno.ENOTEMPTY, "extraction target is not empty", os.fspath(dest))
        _write_tree(root, flat, memoryview(data))
    finally:
        os.close(root)


def _write_tree(root: int, members: dict[tuple[str, ...], tuple[int, int, bool]], data: memoryview) -> None:
    """Create members in component order, keeping one open descriptor per directory level."""
    stack: list[tuple[tuple[str, ...], int]] = [((), root)]
    made: set[tuple[str, ...]] = set()
    try:
        for parts in sorted(members):
            offset, size, is_dir = members[parts]
            parent = parts[:-1]
            while stack[-1][0] != parent[: len(stack[-1][0])]:
                os.close(stack.pop()[1])
            for i in range(len(stack[-1][0]), len(parent)):
                if parent[: i + 1] not in made:  # a parent the archive did not list
                    os.mkdir(parent[i], 0o755, dir_fd=stack[-1][1])
                    made.add(parent[: i + 1])
                stack.append((parent[: i + 1], os.open(parent[i], _DIR_FLAGS, dir_fd=stack[-1][1])))
            if is_dir:
                os.mkdir(parts[-1], 0o755, dir_fd=stack[-1][1])
                made.add(parts)
                continue
            fd = os.open(parts[-1], _FILE_FLAGS, 0o644, dir_fd=stack[-1][1])
            try:
                done = 0
                while done < size:
                    done += os.write(fd, data[offset + done : offset + size])
            finally:
                os.close(fd)
    finally:
        for _, fd in stack[1:]:
            os.close(fd)


def extract_cached(archive: str | os.PathLike[str], root: str | os.PathLike[str] | None = None, *,
                   expected_sha256: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                   max_members: int = DEFAULT_MAX_MEMBERS, max_depth: int = DEFAULT_MAX_DEPTH,
                   max_window: int = DEFAULT_MAX_WINDOW) -> Path:
    """Extract ``archive`` once per node into ``root/<sha256 of the archive>`` and return it.

    The archive is read with one open (none when ``expected_sha256`` names a directory that
    exists). An existing directory is complete, since it only ever appears through a rename,
    and is returned without decompressing. Otherwise
    the archive is validated, extracted into a temporary directory beside it and renamed
    into place; when another process wins that race, this copy is discarded.

    Args:
        archive: the ``bundle.tar.zst`` file.
        root: cache directory; default :func:`.bundle_cache.private_root`
            (``$XDG_CACHE_HOME/packer/bundles-<uid>``, else ``/dev/shm``'s, else the temp directory's).
        expected_sha256: the archive digest pinned by the manifest.
        max_bytes, max_members, max_depth, max_window: caps, as for :meth:`Bundle.open`.

    Raises:
        BundleFormatError: digest mismatch, or the archive is malformed or over a cap.
        OSError: the archive cannot be read or the cache cannot be written.
    """
    base = cache_root(root)
    if expected_sha256 is not None and (hit := cached(base, expected_sha256)) is not None:
        return hit  # a start after the first: not even one open of the archive
    data = _read_once(archive, _compressed_limit(max_bytes))
    digest = hashlib.sha256(data).hexdigest()
    if expected_sha256 is not None and digest != expected_sha256.lower():
        raise BundleFormatError(f"{os.fspath(archive)}: sha256 {digest} does not match the expected {expected_sha256}")
    final = base / digest
    if _is_dir(final):
        return final
    try:
        bundle = Bundle.from_bytes(data, max_bytes=max_bytes, max_members=max_members,
                                   max_depth=max_depth, max_window=max_window)
    except BundleFormatError as e:
        raise BundleFormatError(f"{os.fspath(archive)}: {e}") from None
    tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}.", suffix=".tmp", dir=base))
    try:
        bundle.extract(tmp)
        os.chmod(tmp, 0o755)
        os.rename(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not _is_dir(final):
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
