"""The build's own re-read of its weight blobs, and the final verification that builds on it.

The weights stage's sandboxed writer hashes nothing it writes as a layer blob: it reads each
span back as it lands and compares it with its source, and leaves the blob unnamed. The build
compares each blob's tar framing with the one it computes itself, and hashes the blob (which
names it) and the file inside it side by side, each thread reading its own bytes
(``packer.oci.reread``, :func:`packer.hashing.sha256_range`). The final
``verify`` takes both digests for a blob that stat shows unwritten since, and hashes anything
else; ``packer verify`` on its own hashes the blob and the file inside it. A span that lands
wrong is refused by the writer, framing that lands wrong by the re-read, a blob cut short or
rewritten during the re-read (its mtime put back) by the re-read, a byte changed after the
re-read by the final verification, and every digest published is what the bytes hash to,
whatever the writer says.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import packer.building
import packer.oci.reread
import packer.oci.verify
import packer.weights.stage
import packer.weights.writer
from packer.build_stages import STAGES
from packer.building import build
from packer.errors import VerifyError, WeightsError
from packer.hashing import sha256_range
from packer.oci.reread import reread_blobs
from packer.recipe import demo_recipe
from packer.stage import StageContext, StageOutput
from packer.util.fsutil import FileEntry
from packer.verifying import verify
from tests.built import weight_bytes

WEIGHTS = "weights/model.safetensors"


def _held(out: StageOutput) -> FileEntry:
    (entry,) = [f for f in out.files if f.blob]
    return entry


def _flip(path: Path, at: int, *, keep_mtime: bool = False) -> None:
    """Invert one byte of ``path`` in place (the same inode); optionally put its mtime back."""
    st = path.stat()
    with path.open("r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@given(data=st.binary(max_size=3 * 2**20 + 7), cuts=st.tuples(st.integers(0, 2**22), st.integers(0, 2**22)))
def test_sha256_range_is_hashlib_over_the_slice(tmp_path_factory: pytest.TempPathFactory, data: bytes,
                                                cuts: tuple[int, int]) -> None:
    path = tmp_path_factory.mktemp("range") / "blob"
    path.write_bytes(data)
    start, end = sorted(min(c, len(data)) for c in cuts)  # across the 1 MiB reads too
    fd = os.open(path, os.O_RDONLY)
    try:
        assert sha256_range(fd, start, end) == hashlib.sha256(data[start:end]).hexdigest()
        with pytest.raises(EOFError, match=f"ends at byte {len(data)}, before byte {len(data) + 1}"):
            sha256_range(fd, start, len(data) + 1)  # a file shorter than asked: never a short digest
        if start < end:
            with pytest.raises(ValueError, match="not a range of bytes"):
                sha256_range(fd, end, start)
    finally:
        os.close(fd)


def _during_the_re_read(monkeypatch: pytest.MonkeyPatch, act: Any) -> list[int | None]:
    """Run ``act(fd)`` as the re-read starts hashing the blob (what a process the child left
    behind could do); the hash of the file inside it starts late. Returns the inode that hasher
    still sees through its descriptor when it ends (None: the descriptor was gone)."""
    real, real_chunked = packer.oci.reread.sha256_range, packer.oci.reread.sha256_chunked
    seen: list[int | None] = []

    def hash_range(fd: int, start: int, end: int) -> str:  # the blob's hasher
        act(fd)
        return real(fd, start, end)

    def hash_file(fd: int, start: int, end: int, chunk: int,
                  cuts: tuple[int, ...] = ()) -> tuple[str, tuple[str, ...]]:  # the file's
        time.sleep(0.2)  # still reading when the blob's hash has failed
        try:
            return real_chunked(fd, start, end, chunk, cuts)
        finally:
            try:
                seen.append(os.fstat(fd).st_ino)
            except OSError:
                seen.append(None)

    monkeypatch.setattr(packer.oci.reread, "sha256_range", hash_range)
    monkeypatch.setattr(packer.oci.reread, "sha256_chunked", hash_file)
    return seen


def _blob_of(fd: int) -> tuple[str, int]:
    return os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_ino


def test_a_blob_cut_short_during_the_re_read_is_refused_and_nothing_is_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blob: list[int] = []

    def truncate(fd: int) -> None:
        path, inode = _blob_of(fd)
        blob.append(inode)
        os.truncate(path, os.fstat(fd).st_size // 2)

    seen = _during_the_re_read(monkeypatch, truncate)
    with pytest.raises(WeightsError, match=r"image/unnamed/weights/model\.safetensors: shrank while the build "
                                           r"re-read it \(the file ends at byte \d+, before byte \d+\)"):
        build(demo_recipe(), tmp_path / "out", sandbox=False)
    assert seen == blob  # the other hasher ended before its descriptor closed: it read the blob
    assert list(tmp_path.iterdir()) == []


def test_a_blob_rewritten_with_its_mtime_put_back_during_the_re_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def rewrite(fd: int) -> None:
        path, _ = _blob_of(fd)
        _flip(Path(path), os.fstat(fd).st_size // 2, keep_mtime=True)  # size and mtime as they were

    _during_the_re_read(monkeypatch, rewrite)
    with pytest.raises(WeightsError, match=r"model\.safetensors: written while the build re-read it"):
        build(demo_recipe(), tmp_path / "out", sandbox=False)
    assert list(tmp_path.iterdir()) == []


def test_a_blob_that_cannot_be_read_is_named_in_the_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))  # what a failing disk returns

    _during_the_re_read(monkeypatch, fail)
    with pytest.raises(WeightsError, match=r"model\.safetensors: cannot re-read the layer blob: Input/output error"):
        build(demo_recipe(), tmp_path / "out", sandbox=False)
    assert list(tmp_path.iterdir()) == []


def _writer_then(monkeypatch: pytest.MonkeyPatch, after: Any) -> list[StageOutput]:
    """Run ``after(staging, writer's output) -> output`` as the (sandboxed) writer returns, before
    the build re-reads its blobs; returns the writer's outputs as they came."""
    seen: list[StageOutput] = []
    real = packer.weights.stage.convert_layout

    def convert_layout(src: Path, staging: Path, *args: Any, **kwargs: Any) -> StageOutput:
        out = real(src, staging, *args, **kwargs)
        seen.append(out)
        return after(staging, out) or out

    monkeypatch.setattr(packer.weights.stage, "convert_layout", convert_layout)
    return seen


def test_the_writer_leaves_both_digests_to_the_build_which_hashes_the_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _writer_then(monkeypatch, lambda staging, out: None)
    result = build(demo_recipe(), tmp_path / "out")  # the sandboxed writer, as the CLI runs it
    held = _held(seen[0])  # two hash passes fewer in the writer: it names neither the file nor the blob
    assert (held.sha256, held.blob) == ("", f"image/unnamed/{WEIGHTS}")
    assert f"layer:{WEIGHTS}" not in seen[0].digests
    out = tmp_path / "out"
    entry = result.manifest["files"][WEIGHTS]
    assert entry["sha256"] == hashlib.sha256(weight_bytes(out)).hexdigest()
    blob = out / json.loads((out / "manifest.json").read_bytes())["files"][WEIGHTS]["blob"]
    assert blob.name == hashlib.sha256(blob.read_bytes()).hexdigest()
    assert not (out / "image/unnamed").exists()
    assert verify(out)["bytes"] == result.checked["bytes"]


def test_a_writer_that_misreports_the_file_sha256_is_not_believed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def lying(staging: Path, out: StageOutput) -> StageOutput:
        files = tuple(replace(f, sha256="ab" * 32) if f.blob else f for f in out.files)
        return replace(out, files=files)

    _writer_then(monkeypatch, lying)
    result = build(demo_recipe(), tmp_path / "out", sandbox=False)
    data = weight_bytes(tmp_path / "out")
    assert result.manifest["files"][WEIGHTS]["sha256"] == hashlib.sha256(data).hexdigest() != "ab" * 32
    loader = json.loads((tmp_path / "out/manifest.json").read_bytes())["files"][WEIGHTS]
    assert loader["sha256"] == hashlib.sha256(data).hexdigest()
    verify(tmp_path / "out")  # what the build published, packer verify accepts


def test_a_span_that_lands_wrong_is_refused_by_the_writer_and_nothing_is_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = packer.weights.writer._kernel_copy

    def copy_then_flip(src_fd: int, dst_fd: int, src_pos: int, dst_pos: int, n: int) -> int:
        done = real(src_fd, dst_fd, src_pos, dst_pos, n)
        meant = os.pread(src_fd, 1, src_pos)
        os.pwrite(dst_fd, bytes([meant[0] ^ 0xFF]), dst_pos)  # what landed is not what was meant
        return done

    monkeypatch.setattr(packer.weights.writer, "_kernel_copy", copy_then_flip)
    with pytest.raises(WeightsError, match=r"tensor '.*': bytes read back at offset \d+ differ from what was written"):
        build(demo_recipe(), tmp_path / "out", sandbox=False)
    assert list(tmp_path.iterdir()) == []  # no OUT, no staging


@pytest.mark.parametrize(("where", "why"), [
    (lambda e: e.offset + e.size, "the tar framing around 'weights/model.safetensors' is not what this build writes"),
    (lambda e: 100, "the tar framing around"),  # the file's tar header
    (None, "not its layer"),  # bytes appended after the end blocks
])
def test_a_blob_whose_framing_landed_wrong_is_refused_and_nothing_is_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: Any, why: str
) -> None:
    def spoil(staging: Path, out: StageOutput) -> None:  # bytes no read-back of a span covers
        entry = _held(out)
        if where is None:
            with (staging / entry.blob).open("ab") as f:
                f.write(b"\0" * 1024)
        else:
            _flip(staging / entry.blob, where(entry))

    _writer_then(monkeypatch, spoil)
    with pytest.raises(WeightsError, match=why):
        build(demo_recipe(), tmp_path / "out", sandbox=False)
    assert list(tmp_path.iterdir()) == []


def test_a_blob_the_writer_changed_after_its_read_back_is_named_and_pinned_by_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def flip(staging: Path, out: StageOutput) -> None:  # what a lying writer could have written
        entry = _held(out)
        _flip(staging / entry.blob, entry.offset + entry.size // 2)

    seen = _writer_then(monkeypatch, flip)
    build(demo_recipe(), tmp_path / "out", sandbox=False)
    out = tmp_path / "out"
    entry = json.loads((out / "manifest.json").read_bytes())["files"][WEIGHTS]
    blob = (out / entry["blob"]).read_bytes()
    assert entry["blob"] == f"image/blobs/sha256/{hashlib.sha256(blob).hexdigest()}"
    assert entry["sha256"] == hashlib.sha256(weight_bytes(out)).hexdigest()
    assert _held(seen[0]).blob.startswith("image/unnamed/")
    verify(out)  # whatever the writer did, what the build published packer verify accepts


def _after_the_weights_stage(monkeypatch: pytest.MonkeyPatch, then: Any) -> None:
    def weights(ctx: StageContext, run: Any = STAGES[0].run) -> StageOutput:
        out = run(ctx)
        then(ctx, out)
        return out

    assert STAGES[0].name == "weights"
    monkeypatch.setattr(packer.building, "STAGES", (replace(STAGES[0], run=weights), *STAGES[1:]))


def test_a_blob_written_after_the_re_read_is_hashed_again_and_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _after_the_weights_stage(monkeypatch, lambda ctx, out: _flip(ctx.staging / _held(out).blob, 5000))
    with pytest.raises(VerifyError, match=r"image/blobs/sha256/[0-9a-f]{64}.*: blob does not match its descriptor"):
        build(demo_recipe(), tmp_path / "out", sandbox=False)
    assert list(tmp_path.iterdir()) == []


class _Counted:
    """Bytes that the image walk's hashers took (``blob``: blobs' digests; ``file``: files inside layers)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = {"blob": 0, "file": 0}
        thread, counts = packer.oci.verify.HashThread, self.bytes

        class Thread(thread):  # type: ignore[misc, valid-type]
            def update(self, data: bytes | memoryview) -> None:
                counts["blob"] += len(data)
                super().update(data)

        class Counting:
            def __init__(self, data: bytes = b"") -> None:
                self.h = hashlib.sha256(data)
                counts["file"] += len(data)

            def update(self, more: bytes | memoryview) -> None:
                counts["file"] += len(more)
                self.h.update(more)

            def hexdigest(self) -> str:
                return self.h.hexdigest()

        class Hashlib:
            sha256 = Counting

        monkeypatch.setattr(packer.oci.verify, "HashThread", Thread)
        monkeypatch.setattr(packer.oci.verify, "hashlib", Hashlib)


def test_the_final_verification_hashes_no_weight_byte_the_re_read_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = _Counted(monkeypatch)
    result = build(demo_recipe(), tmp_path / "out")
    size = result.manifest["files"][WEIGHTS]["size"]
    # both digests came from the weights stage's re-read: the walk hashed the small layers only
    assert counted.bytes["blob"] + counted.bytes["file"] < size // 4, counted.bytes
    assert result.checked["bytes"] > size  # and still counts every byte as checked
    counted.bytes.update(blob=0, file=0)
    verify(tmp_path / "out")  # on its own: the blob and the file inside it, both hashed
    assert counted.bytes["blob"] > size and counted.bytes["file"] > size, counted.bytes


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("built") / "out"
    build(demo_recipe(), out, sandbox=False)
    return out


def _framing_of(out: Path) -> Any:
    """The build's framing of the weight file, as read off its blob (what the build computes)."""
    e = json.loads((out / "manifest.json").read_bytes())["files"][WEIGHTS]
    blob = (out / e["blob"]).read_bytes()
    around = (blob[:e["offset"]], blob[e["offset"] + e["size"]:])
    return lambda rel, size: around if (rel, size) == (WEIGHTS, e["size"]) else (b"", b"")


def _unnamed(out: Path) -> FileEntry:
    """The weight file's entry as the writer gives it, its blob copied back to where it is left."""
    e = json.loads((out / "manifest.json").read_bytes())["files"][WEIGHTS]
    (out / "image/unnamed/weights").mkdir(parents=True, exist_ok=True)
    shutil.copy2(out / e["blob"], out / "image/unnamed" / WEIGHTS)  # another inode, as written
    return FileEntry(WEIGHTS, e["size"], "", f"image/unnamed/{WEIGHTS}", e["offset"])


def test_a_vouch_is_taken_only_for_the_file_it_read(built: Path) -> None:
    entry = _unnamed(built)
    (files, vouched) = reread_blobs(built, (entry,), _framing_of(built))
    assert files[0].blob == json.loads((built / "manifest.json").read_bytes())["files"][WEIGHTS]["blob"]
    assert not (built / "image/unnamed").exists()
    ((digest, vouch),) = vouched.items()
    assert verify(built, vouched=vouched)["bytes"] > entry.size
    moved = replace(vouch, identity=(0, 0, 0, 0))  # not the file read: both digests hashed again
    assert verify(built, vouched={digest: moved})["bytes"] > entry.size
    wrong = replace(vouch, sha256="0" * 64)  # a vouch for other bytes disagrees with the manifest
    with pytest.raises(VerifyError, match=r"models/model\.safetensors: size/sha256 .* differ"):
        verify(built, vouched={digest: wrong})


@pytest.mark.parametrize(("change", "why"), [
    ({"blob": "image/unnamed/../../../etc/passwd"}, "is not where a layer blob of it is left"),
    ({"blob": "image/blobs/sha256/" + "0" * 64}, "is not where a layer blob of it is left"),  # no name from it
    ({"blob": "/etc/passwd"}, "is not where a layer blob of it is left"),
    ({"path": "weights/../../passwd"}, "is not a relative file name"),
    ({"offset": -1}, "is not where a layer blob of it is left"),
    ({"offset": "4096"}, "is not where a layer blob of it is left"),
    ({"offset": 2**40}, "not its layer"),
    ({"size": 1}, "not its layer"),
])
def test_a_blob_place_from_the_writer_is_checked_before_it_is_read(
    built: Path, change: dict[str, Any], why: str
) -> None:
    entry = _unnamed(built)
    with pytest.raises(WeightsError, match=why):
        reread_blobs(built, (replace(entry, **change),), _framing_of(built))
    shutil.rmtree(built / "image/unnamed")


def test_a_blob_named_twice_or_anything_else_left_unnamed_is_refused(built: Path) -> None:
    entry = _unnamed(built)
    with pytest.raises(WeightsError, match="names a layer blob in .*image/unnamed twice"):
        reread_blobs(built, (entry, entry), _framing_of(built))
    with pytest.raises(WeightsError, match="names layer blobs in .*image/unnamed; none was asked for"):
        reread_blobs(built, (entry,), None)
    (built / "image/unnamed/weights/stray").write_bytes(b"x")
    with pytest.raises(WeightsError, match="image/unnamed: holds more than the layer blobs .*stray was not named"):
        reread_blobs(built, (entry,), _framing_of(built))
    shutil.rmtree(built / "image/unnamed")
    verify(built)  # the blob the re-read moved onto its own name is the same bytes


def test_a_symlink_the_writer_left_on_the_way_to_a_blob_or_its_name_is_refused(
    built: Path, tmp_path: Path
) -> None:
    entry = _unnamed(built)
    elsewhere = tmp_path / "elsewhere"
    (built / "image/unnamed/weights").rename(elsewhere)
    (built / "image/unnamed/weights").symlink_to(elsewhere)  # a file outside OUT, to be moved into it
    with pytest.raises(WeightsError, match="image/unnamed/weights/model.safetensors: the layer blob's place "
                                           "passes through a symlink"):
        reread_blobs(built, (entry,), _framing_of(built))
    assert (elsewhere / "model.safetensors").is_file()
    shutil.rmtree(built / "image/unnamed")
    image, framing = built / "image", _framing_of(built)
    for moved in ("blobs/sha256", "blobs"):  # the blob would be moved out of OUT
        entry = _unnamed(built)
        saved, target = (tmp_path / f"{moved.replace('/', '-')}-{what}" for what in ("saved", "target"))
        (image / moved).rename(saved)
        target.mkdir()
        (image / moved).symlink_to(target)
        try:
            with pytest.raises(WeightsError, match=f"image/{moved}: not a folder .*: the layer blobs cannot be named"):
                reread_blobs(built, (entry,), framing)
            assert list(target.iterdir()) == []  # nothing made or moved outside OUT
        finally:
            (image / moved).unlink()
            saved.rename(image / moved)
            shutil.rmtree(built / "image/unnamed")
    verify(built)


def test_a_blob_that_is_a_hard_link_is_refused(built: Path, tmp_path: Path) -> None:
    entry = _unnamed(built)
    outside = tmp_path / "outside.bin"
    os.link(built / "image/unnamed" / WEIGHTS, outside)  # the same inode outside staging
    with pytest.raises(WeightsError, match="model.safetensors: 2 hard links; a layer blob must be a file of its own"):
        reread_blobs(built, (entry,), _framing_of(built))
    shutil.rmtree(built / "image/unnamed")
    assert outside.is_file()
