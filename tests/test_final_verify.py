"""The build's own re-read of its weight blobs, and the final verification that builds on it.

The weights stage's sandboxed writer hashes each weight layer blob from the bytes it means to
write and leaves the safetensors file's sha256 to the build: the build maps each blob once and
hashes the blob (against the digest it is named by) and the file inside it side by side
(``packer.oci.reread``). The final ``verify`` takes both digests for a blob that stat shows
unwritten since, and hashes anything else; ``packer verify`` on its own hashes the blob and the
file inside it. A byte changed after the writer is refused either way, and the manifest's
sha256 of a weight file is what its bytes hash to, whatever the writer says.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import packer.build
import packer.oci.verify
import packer.weights.stage
from packer.build import build
from packer.build_stages import STAGES
from packer.errors import VerifyError, WeightsError
from packer.fsutil import FileEntry
from packer.oci.reread import reread_blobs
from packer.recipe import demo_recipe
from packer.stage import StageContext, StageOutput
from packer.verify import verify
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


def test_the_writer_leaves_the_file_sha256_to_the_build_which_hashes_the_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _writer_then(monkeypatch, lambda staging, out: None)
    result = build(demo_recipe(), tmp_path / "out")  # the sandboxed writer, as the CLI runs it
    assert _held(seen[0]).sha256 == ""  # one hash pass fewer in the writer
    entry = result.manifest["files"][WEIGHTS]
    assert entry["sha256"] == hashlib.sha256(weight_bytes(tmp_path / "out")).hexdigest()
    assert verify(tmp_path / "out")["bytes"] == result.checked["bytes"]


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


def test_a_blob_that_does_not_match_its_name_is_refused_and_nothing_is_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def flip(staging: Path, out: StageOutput) -> None:  # the same inode, its mtime put back
        entry = _held(out)
        _flip(staging / entry.blob, entry.offset + entry.size // 2, keep_mtime=True)

    _writer_then(monkeypatch, flip)
    with pytest.raises(WeightsError, match=r"image/blobs/sha256/[0-9a-f]{64}: the layer blob does not match "
                                           r"the digest it is named by"):
        build(demo_recipe(), tmp_path / "out", sandbox=False)
    assert list(tmp_path.iterdir()) == []  # no OUT, no staging


def _after_the_weights_stage(monkeypatch: pytest.MonkeyPatch, then: Any) -> None:
    def weights(ctx: StageContext, run: Any = STAGES[0].run) -> StageOutput:
        out = run(ctx)
        then(ctx, out)
        return out

    assert STAGES[0].name == "weights"
    monkeypatch.setattr(packer.build, "STAGES", (replace(STAGES[0], run=weights), *STAGES[1:]))


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


def _entry(out: Path) -> FileEntry:
    e = json.loads((out / "manifest.json").read_bytes())["files"][WEIGHTS]
    return FileEntry(WEIGHTS, e["size"], "", e["blob"], e["offset"])


def test_a_vouch_is_taken_only_for_the_file_it_read(built: Path) -> None:
    entry = _entry(built)
    (_, vouched) = reread_blobs(built, (entry,))
    ((digest, vouch),) = vouched.items()
    assert verify(built, vouched=vouched)["bytes"] > entry.size
    moved = replace(vouch, identity=(0, 0, 0, 0))  # not the file read: both digests hashed again
    assert verify(built, vouched={digest: moved})["bytes"] > entry.size
    wrong = replace(vouch, sha256="0" * 64)  # a vouch for other bytes disagrees with the manifest
    with pytest.raises(VerifyError, match=r"models/model\.safetensors: size/sha256 .* differ"):
        verify(built, vouched={digest: wrong})


@pytest.mark.parametrize(("change", "why"), [
    ({"blob": "image/blobs/sha256/../../../etc/passwd"}, "is not a digest"),
    ({"blob": "/etc/" + "0" * 64}, "not a layer blob place"),
    ({"offset": -1}, "not a layer blob place"),
    ({"offset": 2**40}, "too short to hold"),
])
def test_a_blob_place_from_the_writer_is_checked_before_it_is_read(
    built: Path, change: dict[str, Any], why: str
) -> None:
    with pytest.raises(WeightsError, match=why):
        reread_blobs(built, (replace(_entry(built), **change),))
