"""The reproducible tar writer and the layer writer: rules, headers, round trips."""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packer.errors import ImageError
from packer.oci.layer import MEDIA_TYPES, write_layer
from packer.oci.tar_reader import TarReader
from packer.oci.tar_writer import (
    Owner,
    SourceFile,
    TarMember,
    encode_header,
    tar_members,
    tar_pieces,
    tar_size,
)
from tests.oci_validate import require_tool


def _tar(members: list[TarMember], mtime: int = 0) -> bytes:
    out = bytearray()
    for piece in tar_pieces(members, mtime=mtime):
        assert isinstance(piece, bytes), "in-memory members only"
        out += piece
    return bytes(out)


def test_members_sorted_with_every_parent_and_owner_below_prefix() -> None:
    files = [
        SourceFile("/opt/model/weights/b.safetensors", 3, data=b"bbb"),
        SourceFile("/opt/model/a-b", 1, data=b"x"),
        SourceFile("/opt/model/packer_loader.py", 2, data=b"ok"),
    ]
    members = tar_members(files, owner=Owner(1000, 0), prefix="/opt/model")
    assert [m.name for m in members] == [
        "opt", "opt/model", "opt/model/a-b", "opt/model/packer_loader.py",
        "opt/model/weights", "opt/model/weights/b.safetensors",
    ]
    by_name = {m.name: m for m in members}
    assert by_name["opt"].owner == Owner(0, 0)  # above the prefix: the base's system dir
    assert by_name["opt/model"].owner == Owner(1000, 0)
    assert {m.mode for m in members if m.is_dir} == {0o755}
    assert {m.mode for m in members if not m.is_dir} == {0o644}


def test_tar_reads_back_with_fixed_fields() -> None:
    files = [SourceFile("/opt/model/x.bin", 5, data=b"hello")]
    data = _tar(tar_members(files, owner=Owner(7, 0), prefix="/opt/model"), mtime=1700000000)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        ms = tf.getmembers()
        assert [(m.name, m.type, m.mode, m.uid, m.gid, m.uname, m.gname, m.mtime) for m in ms] == [
            ("opt", tarfile.DIRTYPE, 0o755, 0, 0, "", "", 1700000000),
            ("opt/model", tarfile.DIRTYPE, 0o755, 7, 0, "", "", 1700000000),
            ("opt/model/x.bin", tarfile.REGTYPE, 0o644, 7, 0, "", "", 1700000000),
        ]
        assert all(m.pax_headers == {} for m in ms)
        f = tf.extractfile("opt/model/x.bin")
        assert f is not None and f.read() == b"hello"


def test_header_over_8gib_uses_pax_size_record() -> None:
    size = 9 * 2**30
    header = encode_header(TarMember("opt/model/big.safetensors", size=size), mtime=0)
    assert b"size=9663676416\n" in header  # the PAX record carries the real size
    with tarfile.open(fileobj=io.BytesIO(header), mode="r|") as tf:
        m = tf.next()
        assert m is not None and m.size == size and m.name == "opt/model/big.safetensors"
        assert set(m.pax_headers) == {"size"}
    small = encode_header(TarMember("opt/model/small", size=2**33 - 1), mtime=0)
    assert len(small) == 512  # still fits ustar: no extended header


def test_long_path_and_non_ascii_use_pax_path() -> None:
    name = "opt/model/" + "d" * 120 + "/ü.json"
    header = encode_header(TarMember(name, size=1), mtime=0)
    with tarfile.open(fileobj=io.BytesIO(header), mode="r|") as tf:
        m = tf.next()
        assert m is not None and m.name == name
        assert set(m.pax_headers) == {"path"}


@pytest.mark.parametrize("mtime", [1.5, -1])
def test_non_integer_mtime_rejected(mtime: float) -> None:
    with pytest.raises(ImageError, match="mtime"):
        encode_header(TarMember("a", size=0), mtime=mtime)  # type: ignore[arg-type]


@pytest.mark.parametrize("dest", ["relative/x", "/opt/../etc/passwd", "/"])
def test_unsafe_paths_rejected(dest: str) -> None:
    with pytest.raises(ImageError, match="absolute path"):
        tar_members([SourceFile(dest, 0, data=b"")], owner=Owner(), prefix="/opt/model")


def test_gnu_tar_lists_the_layer(tmp_path: Path) -> None:
    tar = require_tool("tar")
    src = tmp_path / "w.bin"
    src.write_bytes(b"w" * 1000)
    members = tar_members([SourceFile("/opt/model/w.bin", 1000, source=src)],
                          owner=Owner(1000, 0), prefix="/opt/model")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    layer = write_layer(tar_pieces(members, mtime=0), blobs, compression="gzip")
    out = subprocess.run([tar, "-tvzf", str(layer.path), "--numeric-owner", "--full-time"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[-1].split() == ["-rw-r--r--", "1000/0", "1000", "1970-01-01", "00:00:00",
                               "opt/model/w.bin"]


names = st.text(alphabet="abcXYZ019._-", min_size=1, max_size=12).filter(lambda s: s not in (".", ".."))
trees = st.dictionaries(st.lists(names, min_size=1, max_size=3).map("/".join),
                        st.binary(max_size=2000), min_size=1, max_size=8)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=trees, compression=st.sampled_from(["none", "gzip", "zstd"]), mtime=st.integers(0, 2**33))
def test_round_trip(tree: dict[str, bytes], compression: str, mtime: int) -> None:
    # a path can't be both a file and a directory: drop files that are someone's parent
    tree = {k: v for k, v in tree.items() if not any(o.startswith(k + "/") for o in tree)}
    with tempfile.TemporaryDirectory() as tmp:
        root, blobs = Path(tmp) / "src", Path(tmp) / "blobs"
        blobs.mkdir()
        files = []
        for i, (rel, data) in enumerate(sorted(tree.items())):
            (root / f"{i}").parent.mkdir(parents=True, exist_ok=True)
            (root / f"{i}").write_bytes(data)
            files.append(SourceFile(f"/opt/model/{rel}", len(data), source=root / f"{i}"))
        members = tar_members(files, owner=Owner(), prefix="/opt/model")
        tee = Path(tmp) / "tee.tar"
        layer = write_layer(tar_pieces(members, mtime=mtime), blobs, compression=compression,
                            tee=tee if compression == "zstd" else None)
        blob = layer.path.read_bytes()
        assert layer.size == len(blob) and layer.digest == "sha256:" + hashlib.sha256(blob).hexdigest()
        assert layer.media_type == MEDIA_TYPES[compression]
        tar = {"none": lambda b: b, "gzip": gzip.decompress,
               "zstd": lambda b: tee.read_bytes()}[compression](blob)
        assert layer.diff_id == "sha256:" + hashlib.sha256(tar).hexdigest()
        assert len(tar) == tar_size(members, mtime=mtime)
        with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
            got = {m.name: tf.extractfile(m).read() for m in tf if m.isfile()}  # type: ignore[union-attr]
            names_in_order = [m.name for m in tf.getmembers()]
        assert got == {f"opt/model/{k}": v for k, v in tree.items()}
        assert names_in_order == sorted(names_in_order)


def test_file_changed_size_is_reported(tmp_path: Path) -> None:
    src = tmp_path / "w.bin"
    src.write_bytes(b"abc")
    members = tar_members([SourceFile("/opt/model/w.bin", 5, source=src)], owner=Owner(),
                          prefix="/opt/model")
    (tmp_path / "blobs").mkdir()
    for compression in ("none", "gzip"):
        with pytest.raises(ImageError, match=r"w\.bin: is 3 bytes, the plan expected 5"):
            write_layer(tar_pieces(members, mtime=0), tmp_path / "blobs", compression=compression)
    assert list((tmp_path / "blobs").iterdir()) == []  # no temp file left behind


def _tarfile_archive(tree: dict[str, bytes], fmt: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in tree.items():
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.uid, ti.mtime = len(data), 0o640, 1234, 99
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


long_names = st.lists(names, min_size=1, max_size=12).map("/".join)


@settings(max_examples=30, deadline=None)
@given(tree=st.dictionaries(long_names, st.binary(max_size=3000), min_size=1, max_size=6),
       fmt=st.sampled_from([tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT]))
def test_tar_reader_agrees_with_tarfile(tree: dict[str, bytes], fmt: int) -> None:
    if fmt == tarfile.USTAR_FORMAT:  # ustar can't hold long names: keep the short ones
        tree = {k: v for k, v in tree.items() if len(k) <= 100} or {"a": b"x"}
    data = _tarfile_archive(tree, fmt)
    got = []
    reader = TarReader(io.BytesIO(data))
    for m in reader:
        content = b"".join(reader.chunks()) if tree.get(m.name) else None  # others: skipped
        got.append((m.name, m.size, m.mode, m.uid, m.mtime, content))
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        want = [(m.name, m.size, m.mode, m.uid, m.mtime,
                 tf.extractfile(m).read() if tree.get(m.name) else None)  # type: ignore[union-attr]
                for m in tf.getmembers()]
    assert got == want


def test_tar_reader_rejects_truncation_and_bad_checksum() -> None:
    data = _tarfile_archive({"a/b": b"x" * 600}, tarfile.PAX_FORMAT)
    with pytest.raises(tarfile.ReadError, match="truncated"):
        for _ in TarReader(io.BytesIO(data[:900])):
            pass
    broken = bytearray(data)
    broken[10] ^= 0xFF
    with pytest.raises(tarfile.HeaderError):
        list(TarReader(io.BytesIO(bytes(broken))))


def test_copy_falls_back_when_kernel_copy_is_refused(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "w.bin"
    src.write_bytes(bytes(range(256)) * 5000)
    members = tar_members([SourceFile("/opt/model/w.bin", src.stat().st_size, source=src)],
                          owner=Owner(), prefix="/opt/model")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    fast = write_layer(tar_pieces(members, mtime=0), tmp_path / "a", compression="none")

    def refuse(*_args: object) -> int:
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    slow = write_layer(tar_pieces(members, mtime=0), tmp_path / "b", compression="none")
    assert slow.digest == fast.digest == slow.diff_id
    assert slow.path.read_bytes() == fast.path.read_bytes()
