"""The runtime bundle reader against hostile archives built here byte by byte, zstd bombs,
caps, concurrent extraction, fuzzing, and a real ``tokenizers`` tokenizer round trip."""

from __future__ import annotations

import errno
import functools
import hashlib
import io
import multiprocessing
import os
import re
from pathlib import Path

import pytest
import zstandard
from hypothesis import event, given
from hypothesis import strategies as st

from packer.bundle import ustar_header
from packer.runtime import bundle_reader
from packer.runtime.bundle_reader import Bundle, BundleFormatError, extract_cached, member_key

# ---------------------------------------------------------------------------------------
# raw tar and zstd builders


def hdr(name: str | bytes, *, size: int = 0, kind: bytes = b"0", mode: int = 0o644, prefix: bytes = b"",
        link: bytes = b"", magic: bytes = b"ustar\x0000", size_field: bytes | None = None,
        checksum_delta: int = 0) -> bytes:
    raw = name.encode() if isinstance(name, str) else name
    h = bytearray(512)
    h[0 : len(raw)] = raw
    h[100:108] = b"%07o\0" % mode
    h[108:116] = h[116:124] = b"0000000\0"
    h[124:136] = size_field if size_field is not None else b"%011o\0" % size
    h[136:148] = b"%011o\0" % 0
    h[148:156] = b" " * 8
    h[156:157] = kind
    h[157 : 157 + len(link)] = link
    h[257:265] = magic
    h[345 : 345 + len(prefix)] = prefix
    h[148:156] = b"%06o\0 " % (sum(h) + checksum_delta)
    return bytes(h)


def pad(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def member(name: str | bytes, data: bytes = b"", **kw: object) -> bytes:
    return hdr(name, size=len(data), **kw) + pad(data)  # type: ignore[arg-type]


def dirent(name: str, mode: int = 0o755) -> bytes:
    return hdr(name + "/", kind=b"5", mode=mode)


def record(key: str, value: str) -> bytes:
    body = f" {key}={value}\n".encode()
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n = len(str(n)) + len(body)
    return str(n).encode() + body


def pax(records: dict[str, str], kind: bytes = b"x") -> bytes:
    body = b"".join(record(k, v) for k, v in records.items())
    return hdr("././@PaxHeader", kind=kind, size=len(body)) + pad(body)


def tar(*parts: bytes) -> bytes:
    return b"".join(parts) + bytes(1024)


def zst(data: bytes, **kw: object) -> bytes:
    return zstandard.ZstdCompressor(level=3, write_checksum=True, **kw).compress(data)  # type: ignore[arg-type]


def zst_stream(chunks: object, **kw: object) -> bytes:
    """A frame without a declared content size (streamed)."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor(**kw).stream_writer(out, closefd=False) as w:  # type: ignore[arg-type]
        for c in chunks:  # type: ignore[attr-defined]
            w.write(c)
    return out.getvalue()


def frame(blocks: list[bytes], *, fhd: int = 0, window: bytes = b"\x00", fcs: bytes = b"") -> bytes:
    """A hand-made zstd frame; ``blocks`` are (header + payload) byte strings."""
    return bundle_reader._ZSTD_MAGIC + bytes([fhd]) + window + fcs + b"".join(blocks)


def raw_block(data: bytes, last: bool = True) -> bytes:
    return ((len(data) << 3) | int(last)).to_bytes(3, "little") + data


def rle_block(size: int, last: bool = False) -> bytes:
    return ((size << 3) | 2 | int(last)).to_bytes(3, "little") + b"\0"


GOOD = tar(dirent("d"), member("d/a.json", b'{"a": 1}'), member("b.txt", b"hello"))


def rejects(archive: bytes, match: str, tmp_path: Path, **caps: int) -> None:
    """The archive is refused by every entry point, and nothing appears on disk."""
    with pytest.raises(BundleFormatError, match=match):
        Bundle.from_bytes(archive, **caps)
    path = tmp_path / "bad.tar.zst"
    path.write_bytes(archive)
    with pytest.raises(BundleFormatError, match=match):
        Bundle.open(path, **caps)
    cache = tmp_path / "cache"
    with pytest.raises(BundleFormatError, match=match):
        extract_cached(path, cache, **caps)
    assert list(cache.iterdir()) == []


def test_good_archive_reads() -> None:
    b = Bundle.from_bytes(zst(GOOD))
    assert b.names() == ["b.txt", "d/a.json"] and b.read("d/a.json") == b'{"a": 1}'
    with pytest.raises(KeyError):
        b.read("d")


# ---------------------------------------------------------------------------------------
# hostile tar content

TAR_ATTACKS = {
    "absolute": (tar(member("/etc/passwd", b"x")), "absolute"),
    "dotdot": (tar(member("../evil", b"x")), r"'\.\.' component"),
    "dotdot-inside": (tar(member("a/../../evil", b"x")), r"'\.\.' component"),
    "dotdot-prefix": (tar(member("x", b"x", prefix=b"..")), r"'\.\.' component"),
    "dotdot-fullwidth": (tar(member("\uff0e\uff0e/x", b"x")), r"'\.\.' component"),
    "slash-fullwidth": (tar(member("a\uff0fb", b"x")), "ambiguous component"),
    "backslash": (tar(member("a\\..\\b", b"x")), "backslash"),
    "drive": (tar(member("C:/Windows/x", b"x")), "drive letter"),
    "drive-relative": (tar(member("c:x", b"x")), "drive letter"),
    "dot": (tar(member("./a", b"x")), "'.'"),
    "empty-component": (tar(member("a//b", b"x")), "empty"),
    "empty-name": (tar(member("", b"x")), "empty member name"),
    "control-char": (tar(member("a\nb", b"x")), "control character"),
    "bad-utf8": (tar(member(b"\xff.txt", b"x")), "not UTF-8"),
    "nul-smuggling": (tar(member(b"ok.txt\0../../evil", b"x")), "after its terminator"),
    "symlink": (tar(hdr("link", kind=b"2", link=b"/etc/passwd")), "symbolic link"),
    "hardlink": (tar(member("a", b"x"), hdr("b", kind=b"1", link=b"a")), "hard link"),
    "chardev": (tar(hdr("tty", kind=b"3")), "character device"),
    "blockdev": (tar(hdr("sda", kind=b"4")), "block device"),
    "fifo": (tar(hdr("pipe", kind=b"6")), "FIFO"),
    "contiguous": (tar(member("c", b"x", kind=b"7")), "contiguous"),
    "gnu-longname": (tar(member("././@LongLink", b"../../evil\0", kind=b"L"), member("x", b"x")), "GNU long"),
    "unknown-type": (tar(member("v", b"x", kind=b"V")), "unsupported member type"),
    "link-name-on-file": (tar(member("f", b"x", link=b"/etc/passwd")), "link name"),
    "global-pax": (tar(pax({"comment": "x"}, kind=b"g"), member("a", b"x")), "global PAX"),
    "pax-path": (tar(pax({"path": "../../etc/passwd"}), member("safe.txt", b"x")), "renames"),
    "pax-path-same": (tar(pax({"path": "safe.txt"}), member("safe.txt", b"x")), "renames"),
    "pax-linkpath": (tar(pax({"linkpath": "/etc"}), member("a", b"x")), "renames"),
    "pax-long-path-traversal": (tar(pax({"path": "../" + "x" * 120}), member("x" * 100, b"x")), "'..' component"),
    "pax-long-path-absolute": (tar(pax({"path": "/" + "x" * 120}), member("x" * 100, b"x")), "absolute name"),
    "pax-splittable-path": (tar(pax({"path": "d/" + "x" * 99}), member("x" * 100, b"x")), "renames"),
    "pax-size": (tar(pax({"size": "4096"}), member("a", b"x")), "PAX size"),
    "pax-sparse": (tar(pax({"GNU.sparse.map": "0,1"}), member("a", b"x")), "unsupported PAX record"),
    "pax-charset": (tar(pax({"hdrcharset": "BINARY"}), member("a", b"x")), "unsupported PAX record"),
    "pax-dangling": (tar(member("a", b"x"), pax({"mtime": "1"})), "not followed by a member"),
    "pax-twice": (tar(pax({"mtime": "1"}), pax({"mtime": "2"}), member("a", b"x")), "repeated"),
    "pax-bad-length": (tar(hdr("p", kind=b"x", size=12) + pad(b"99 mtime=1\n\n"), member("a")), "malformed"),
    "pax-duplicate-key": (tar(hdr("p", kind=b"x", size=22) + pad(record("mtime", "1") * 2), member("a")),
                          "duplicate record"),
    "setuid": (tar(member("run", b"x", mode=0o4755)), "setuid"),
    "setgid": (tar(member("run", b"x", mode=0o2755)), "setuid, setgid"),
    "sticky": (tar(dirent("tmp", mode=0o1777)), "sticky"),
    "duplicate": (tar(member("a.txt", b"1"), member("a.txt", b"2")), "duplicate"),
    "duplicate-case": (tar(member("Vocab.txt", b"1"), member("vocab.txt", b"2")), "duplicate"),
    "duplicate-nfc": (tar(member("caf\u00e9.json", b"1"), member("cafe\u0301.json", b"2")), "duplicate"),
    "duplicate-nfkc": (tar(member("\ufb01le.txt", b"1"), member("file.txt", b"2")), "duplicate"),
    "duplicate-dir": (tar(dirent("d"), dirent("D")), "duplicate"),
    "file-then-child": (tar(member("a", b"1"), member("a/b", b"2")), "parent is a file"),
    "child-then-file": (tar(member("A/b", b"1"), member("a", b"2")), "name of a directory"),
    "dir-with-size": (tar(hdr("d/", kind=b"5", mode=0o755, size=512) + bytes(512)), "directory with a size"),
    "bad-checksum": (tar(member("a", b"x", checksum_delta=1)), "bad checksum"),
    "v7-header": (tar(member("a", b"x", magic=bytes(8))), "not a POSIX ustar"),
    "gnu-magic": (tar(member("a", b"x", magic=b"ustar  \0")), "not a POSIX ustar"),
    "base256-size": (tar(hdr("a", size_field=b"\x80" + bytes(10) + b"\x01") + pad(b"x")), "base-256"),
    "non-octal-size": (tar(hdr("a", size_field=b"0000000001x\0") + pad(b"x")), "not octal"),
    "size-past-end": (hdr("b", size=10**6) + bytes(1024), "runs past the end"),
    "no-end-marker": (member("a", b"x"), "truncated tar"),
    "data-after-end": (tar(member("a", b"x")) + member("hidden", b"y"), "after the tar end-of-archive"),
}


@pytest.mark.parametrize("case", sorted(TAR_ATTACKS))
def test_tar_attack_rejected(case: str, tmp_path: Path) -> None:
    data, match = TAR_ATTACKS[case]
    rejects(zst(data), match, tmp_path)


# ---------------------------------------------------------------------------------------
# zstd bombs and frame tricks


def test_forged_content_size(tmp_path: Path) -> None:
    # hand-made frame: window 1 MiB, 4-byte content size, one raw block of 1536 bytes
    body = tar(member("a", b"x"))
    honest = frame([raw_block(body)], fhd=0x80, window=b"\x50", fcs=len(body).to_bytes(4, "little"))
    assert Bundle.from_bytes(honest).names() == ["a"]
    for lie in (len(body) - 512, len(body) + 512):
        rejects(frame([raw_block(body)], fhd=0x80, window=b"\x50", fcs=lie.to_bytes(4, "little")),
                "corrupt zstd data|declares", tmp_path)
    huge = frame([raw_block(body)], fhd=0xC0, window=b"\x50", fcs=(2**40).to_bytes(8, "little"))
    rejects(huge, "declares 1099511627776 bytes, over the cap", tmp_path)
    # a real frame whose (single-segment) content size is edited down: the window shrinks too
    real = bytearray(zst(tar(member("a", os.urandom(3000)))))
    assert real[4] & 0x20, "expected a single-segment frame"
    real[5:7] = (int.from_bytes(real[5:7], "little") - 300).to_bytes(2, "little")
    rejects(bytes(real), "corrupt zstd data|declares", tmp_path)


def test_huge_window(tmp_path: Path) -> None:
    rejects(frame([raw_block(b"")], window=b"\xf8"), "window of .* over the cap", tmp_path)  # 2**41 bytes
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=25)
    big = zst_stream([GOOD], compression_params=params)
    rejects(big, "window of 33554432 bytes is over the cap of 16777216", tmp_path)
    assert Bundle.from_bytes(big, max_window=2**25).names() == ["b.txt", "d/a.json"]


def test_256_mib_of_zeros_against_a_small_cap(tmp_path: Path) -> None:
    zeros = bytes(1 << 20)
    streamed = zst_stream([zeros] * 256, level=1)  # no declared size: only the output cap stops it
    assert len(streamed) < 64 * 1024
    rejects(streamed, "decompresses to more than the cap of 1048576", tmp_path, max_bytes=1 << 20)
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=1).stream_writer(out, size=256 << 20, closefd=False) as w:
        for _ in range(256):
            w.write(zeros)
    declared = out.getvalue()
    rejects(declared, "declares 268435456 bytes, over the cap", tmp_path, max_bytes=1 << 20)
    # hand-made: 2048 RLE blocks of 128 KiB, 8 KiB of input
    rle = frame([rle_block(128 * 1024)] * 2047 + [rle_block(128 * 1024, last=True)], window=b"\x58")
    rejects(rle, "decompresses to more than the cap", tmp_path, max_bytes=4 << 20)
    empty_blocks = frame([raw_block(b"", last=False)] * 6000 + [raw_block(b"")], window=b"\x58")
    rejects(empty_blocks, "too many zstd blocks", tmp_path, max_bytes=1 << 20)  # a CPU bomb for the walk


def test_frames_and_trailing_data(tmp_path: Path) -> None:
    good = zst(GOOD)
    # a second frame is read in sequence: here it adds a tar after the end-of-archive marker
    rejects(good + zst(tar(member("x", b"y"))), "data after the tar end-of-archive marker", tmp_path)
    skippable = (0x184D2A50).to_bytes(4, "little") + (4).to_bytes(4, "little") + b"evil"
    rejects(skippable[:6], "truncated skippable zstd frame", tmp_path)
    rejects(skippable[:4] + (1 << 20).to_bytes(4, "little") + good, "runs past the end", tmp_path)
    rejects(skippable, "not a zstd frame", tmp_path)  # no data frame at all
    rejects(good + b"junk", "4 bytes of trailing data", tmp_path)
    rejects(good + b"\0", "1 bytes of trailing data", tmp_path)
    rejects(good[:-7], "truncated", tmp_path)
    rejects(b"\x1f\x8b\x08\x00" + bytes(20), "not a zstd frame", tmp_path)
    flipped = bytearray(good)
    flipped[-1] ^= 0xFF  # the content checksum
    rejects(bytes(flipped), "corrupt zstd data", tmp_path)
    with_dict = bytearray(good)
    with_dict[4] |= 0x01
    rejects(bytes(with_dict), "dictionary", tmp_path)
    reserved = bytearray(good)
    reserved[4] |= 0x08
    rejects(bytes(reserved), "reserved bit", tmp_path)


# ---------------------------------------------------------------------------------------
# caps


def test_caps_are_enforced_and_overridable(tmp_path: Path) -> None:
    five = zst(tar(*(member(f"f{i}", b"x") for i in range(5))))
    rejects(five, "more than the cap of 4 members", tmp_path, max_members=4)
    assert len(Bundle.from_bytes(five, max_members=5).names()) == 5
    deep = zst(tar(member("a/b/c/d.txt", b"x")))
    rejects(deep, "4 levels deep, over the cap of 3", tmp_path, max_depth=3)
    assert Bundle.from_bytes(deep, max_depth=4).names() == ["a/b/c/d.txt"]
    big = tar(member("big", b"ab" * 5000))
    rejects(zst(big), "over the cap", tmp_path, max_bytes=8192)
    rejects(zst_stream([big]), "more than the cap of 8192", tmp_path, max_bytes=8192)
    assert Bundle.from_bytes(zst(big), max_bytes=len(big)).names() == ["big"]
    path = tmp_path / "huge.tar.zst"
    path.write_bytes(os.urandom(20_000))
    with pytest.raises(BundleFormatError, match="over the cap"):
        Bundle.open(path, max_bytes=8192)  # refused before it is read


# ---------------------------------------------------------------------------------------
# extraction


def test_extract_writes_files_and_implied_dirs(tmp_path: Path) -> None:
    data = zst(tar(member("x/y/z.txt", b"deep"), member("top.json", b"{}")))  # no directory entries
    out = Bundle.from_bytes(data).extract(tmp_path / "out")
    assert (out / "x" / "y" / "z.txt").read_bytes() == b"deep" and (out / "top.json").read_bytes() == b"{}"
    with pytest.raises(FileExistsError):
        Bundle.from_bytes(data).extract(out)
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(OSError) as info:
        Bundle.from_bytes(data).extract(tmp_path / "link")  # never through a symlink
    assert info.value.errno in (errno.ELOOP, errno.ENOTDIR) and not any((tmp_path / "elsewhere").iterdir())


def _archive(tmp_path: Path, data: bytes = zst(GOOD)) -> Path:
    path = tmp_path / "bundle.tar.zst"
    path.write_bytes(data)
    return path


def test_extract_cached_is_content_addressed(tmp_path: Path) -> None:
    archive = _archive(tmp_path)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    out = extract_cached(archive, tmp_path / "cache", expected_sha256=digest.upper())
    assert out == tmp_path / "cache" / digest and (out / "d" / "a.json").read_bytes() == b'{"a": 1}'
    inode = os.stat(out / "b.txt").st_ino
    assert extract_cached(str(archive), str(tmp_path / "cache")) == out
    assert os.stat(out / "b.txt").st_ino == inode  # reused, not re-extracted
    with pytest.raises(BundleFormatError, match="does not match the expected"):
        extract_cached(archive, tmp_path / "other", expected_sha256="0" * 64)
    assert not any((tmp_path / "other").iterdir())
    archive.unlink()  # a warm start with the pinned digest does not read the archive at all
    assert extract_cached(archive, tmp_path / "cache", expected_sha256=digest) == out
    with pytest.raises(FileNotFoundError):
        extract_cached(archive, tmp_path / "cache")


def test_extract_cached_default_root_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    archive = _archive(tmp_path, zst(tar(member("default-root.txt", b"x"))))
    base = extract_cached(archive).parent
    assert base == tmp_path / "xdg" / "packer" / f"bundles-{os.getuid()}" and base.stat().st_mode & 0o077 == 0


def test_race_loser_discards_its_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive = _archive(tmp_path)
    first = extract_cached(archive, tmp_path / "cache")
    inode = os.stat(first / "b.txt").st_ino
    answers, real = [False], bundle_reader._is_dir  # the first look says "absent": it loses the race
    monkeypatch.setattr(bundle_reader, "_is_dir", lambda p: answers.pop() if answers else real(p))
    assert extract_cached(archive, tmp_path / "cache") == first
    assert os.stat(first / "b.txt").st_ino == inode
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]


def test_failed_extraction_leaves_nothing_visible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive = _archive(tmp_path)
    real = bundle_reader._write_tree

    def full_disk(root: int, members: object, data: memoryview) -> None:
        real(root, members, data)  # type: ignore[arg-type]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(bundle_reader, "_write_tree", full_disk)
    with pytest.raises(OSError, match="No space"):
        extract_cached(archive, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_processes_extracting_at_once_share_one_directory(tmp_path: Path) -> None:
    files = {f"f{i:03d}.json": os.urandom(2000) for i in range(200)}
    archive = _archive(tmp_path, zst(tar(*(member(n, d) for n, d in files.items()))))
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        outs = pool.map(functools.partial(extract_cached, root=tmp_path / "cache"), [archive] * 8, chunksize=1)
    assert len(set(outs)) == 1
    out = outs[0]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [out.name]  # no leftover temp dirs
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files


# ---------------------------------------------------------------------------------------
# property tests: writer/reader round trip, mutated archives

NAME_CHARS = st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp"), blacklist_characters="/\\")
COMPONENT = st.text(NAME_CHARS, min_size=1, max_size=40).filter(lambda s: s not in (".", ".."))
NAMES = st.lists(st.lists(COMPONENT, min_size=1, max_size=4).map("/".join), min_size=1, max_size=8)


def _writer_tar(files: dict[str, bytes]) -> bytes:
    out = [ustar_header(n, size=len(d), mtime=0, is_dir=False) + pad(d) for n, d in sorted(files.items())]
    return tar(*out)


@given(names=NAMES, data=st.data())
def test_round_trip_property(names: list[str], data: st.DataObject) -> None:
    files = {n: data.draw(st.binary(max_size=700)) for n in names}
    try:
        body = _writer_tar(files)
    except Exception as e:  # only a too-long name may stop the writer
        assert "name too long" in str(e)
        return
    try:
        bundle = Bundle.from_bytes(zst(body))
    except BundleFormatError as e:
        keys = [member_key(n) for n in files]
        parents = {member_key("/".join(n.split("/")[:i])) for n in files for i in range(1, n.count("/") + 1)}
        clash = len(set(keys)) < len(keys) or bool(parents & set(keys))
        odd = any(p in (".", "..", "") or "/" in p or "\\" in p
                  for n in files for p in (member_key(c) for c in n.split("/")))
        assert clash or odd or "drive letter" in str(e), str(e)
        event("rejected")
        return
    event("round trip")
    assert bundle.names() == sorted(files)
    assert all(bundle.read(n) == d for n, d in files.items())


SEED = tar(dirent("sub"), member("sub/config.json", b'{"hidden_size": 8}' * 20), member("vocab.txt", b"a\nb\n" * 40))


def _outcome_is_sane(data: bytes, tmp: Path) -> None:
    try:
        bundle = Bundle.from_bytes(data, max_bytes=1 << 20)
    except BundleFormatError:
        event("rejected")
        return
    event("accepted")
    names = bundle.names()
    for n in names:
        bundle_reader.check_name(n)
        bundle.read(n)
    out = bundle.extract(tmp)
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert written == names


SEED_HEADERS = (0, 512, 1536)  # where SEED's headers start


@given(edits=st.lists(st.tuples(st.integers(0, len(SEED) - 1), st.integers(0, 255)), min_size=1, max_size=6),
       fix_checksums=st.booleans())
def test_mutated_tar_fuzz(edits: list[tuple[int, int]], fix_checksums: bool,
                          tmp_path_factory: pytest.TempPathFactory) -> None:
    body = bytearray(SEED)
    for pos, value in edits:
        body[pos] = value
    for at in SEED_HEADERS if fix_checksums else ():  # reach past the checksum into the field checks
        body[at + 148 : at + 156] = b" " * 8
        body[at + 148 : at + 156] = b"%06o\0 " % sum(body[at : at + 512])
    _outcome_is_sane(zst(bytes(body)), tmp_path_factory.mktemp("x"))


ZSEED = zst(SEED)


@given(edits=st.lists(st.tuples(st.integers(0, len(ZSEED) - 1), st.integers(0, 255)), max_size=4),
       cut=st.integers(0, len(ZSEED)), junk=st.binary(max_size=8))
def test_mutated_zstd_fuzz(edits: list[tuple[int, int]], cut: int, junk: bytes,
                           tmp_path_factory: pytest.TempPathFactory) -> None:
    raw = bytearray(ZSEED)
    for pos, value in edits:
        raw[pos] = value
    _outcome_is_sane(bytes(raw[:cut]) + junk, tmp_path_factory.mktemp("z"))


# ---------------------------------------------------------------------------------------
# a real tokenizer survives the trip

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Packer bundles tokenizer files into one archive.",
    "Servers read one file instead of hundreds over NFS.",
    "Tokenizers split text into tokens and map them to ids.",
] * 5


def test_tokenizers_reads_the_extracted_directory(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from packer.bundle import run_bundle
    from packer.recipe import BundleConfig
    from tests.bundle_validate import validate_bundle

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, tokenizers.trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"]))
    src = tmp_path / "model"
    src.mkdir()
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    (src / "pytorch_model.bin").write_bytes(b"PK")
    section = run_bundle(src, BundleConfig(), tmp_path / "out").section
    archive = tmp_path / "out" / section["file"]
    validate_bundle(archive, names=["tokenizer.json", "tokenizer_config.json"])
    out = extract_cached(archive, tmp_path / "cache", expected_sha256=section["sha256"])
    text = "The lazy fox reads tokens over NFS, quickly!"
    original = tokenizers.Tokenizer.from_file(str(src / "tokenizer.json")).encode(text).ids
    assert original and tokenizers.Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids == original
    in_memory = Bundle.open(archive).read("tokenizer.json").decode()
    assert tokenizers.Tokenizer.from_str(in_memory).encode(text).ids == original


# ---------------------------------------------------------------------------------------
# the same corpus through `packer unbundle`: exit 1, the reason named, nothing written anywhere

CLI_CORPUS = {**{f"tar-{k}": (zst(v[0]), v[1]) for k, v in TAR_ATTACKS.items()},
              "zstd-trailing": (zst(GOOD) + b"junk", "trailing data"),
              "zstd-extra-frame": (zst(GOOD) + zst(GOOD), "data after the tar end-of-archive marker"),
              "zstd-huge-window": (frame([raw_block(b"")], window=b"\xf8"), "window"),
              "zstd-forged-size": (frame([raw_block(GOOD)], fhd=0x80, window=b"\x50",
                                         fcs=(len(GOOD) + 512).to_bytes(4, "little")), "corrupt|declares")}


@pytest.mark.parametrize("case", sorted(CLI_CORPUS))
def test_unbundle_cli_rejects_corpus(case: str, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from packer.cli import main

    data, reason = CLI_CORPUS[case]
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    (work / "in.tar.zst").write_bytes(data)
    result = CliRunner().invoke(main, ["unbundle", str(work / "in.tar.zst"), "-o", str(work / "out")])
    assert result.exit_code == 1, result.output
    assert re.search(reason, result.output) and "Traceback" not in result.output
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [work / "in.tar.zst"]  # no canary, no output
    assert not (work / "out").exists()


def test_pax_path_for_a_name_ustar_cannot_hold_is_read() -> None:
    long = "tokenizer_" + "x" * 110 + ".json"  # 125 bytes, no '/' to split at
    body = tar(member("a.json", b"A"), pax({"path": long}), member(long[:100], b"LONG"))
    bundle = Bundle.from_bytes(zst(body))
    assert bundle.names() == ["a.json", long]
    assert bundle.read(long) == b"LONG"


def test_skippable_frames_are_skipped_and_frames_read_in_sequence() -> None:
    def skippable(payload: bytes, nibble: int = 0) -> bytes:
        return (0x184D2A50 + nibble).to_bytes(4, "little") + len(payload).to_bytes(4, "little") + payload

    body = tar(member("b.txt", b"B" * 3000), member("d/a.json", b"{}"))
    cut = 1024  # a cut inside the first member: the frames only make sense read in sequence
    multi = zst(body[:cut]) + skippable(b"seekable index", 0xE) + zst_stream([body[cut:]])
    for data in (skippable(b"meta") + zst(body), zst(body) + skippable(b""), multi, skippable(b"") + multi):
        bundle = Bundle.from_bytes(data)
        assert bundle.names() == ["b.txt", "d/a.json"] and bundle.read("b.txt") == b"B" * 3000


def test_frame_caps_hold_across_frames(tmp_path: Path) -> None:
    zeros = bytes(1 << 19)
    # each frame alone is under the cap, together they are not
    rejects(zst(zeros) + zst(zeros) + zst(zeros), "declares 1572864 bytes, over the cap", tmp_path,
            max_bytes=1 << 20)
    rejects(zst_stream([zeros]) * 3, "decompresses to more than the cap of 1048576", tmp_path, max_bytes=1 << 20)
    empty = (0x184D2A50).to_bytes(4, "little") + bytes(4)
    rejects(empty * 6000 + zst(GOOD), "too many zstd frames for the size cap", tmp_path, max_bytes=1 << 20)
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=25)
    rejects(zst(GOOD) + zst_stream([GOOD], compression_params=params), "window of 33554432 bytes", tmp_path)
