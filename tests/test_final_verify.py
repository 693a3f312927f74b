"""The build's final verification: every weight byte hashed once more after it landed, most of
that while the later stages run, and a byte changed anywhere after the writer still refused.

The weights stage hands the build each weight layer blob with the sha256 of the file inside it
(computed from the same bytes as the blob's digest); the build re-reads each blob as the stage
returns (``sha256_unchanged``) and the final ``verify`` takes that digest for the same,
unwritten file, or hashes the blob itself when the file changed since. ``packer verify``
on its own hashes the blob and the file inside it, side by side.
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
from packer.build import build
from packer.build_stages import STAGES
from packer.errors import VerifyError
from packer.fsutil import sha256_unchanged
from packer.recipe import demo_recipe
from packer.stage import StageContext, StageOutput
from packer.verify import verify


def _blob(staging: Path, out: StageOutput) -> Path:
    (entry,) = [f for f in out.files if f.blob]
    return staging / entry.blob


def _flip(path: Path, at: int, *, keep_mtime: bool = False) -> None:
    """Invert one byte of ``path`` in place (the same inode); optionally keep its mtime."""
    st = path.stat()
    with path.open("r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _with_weights_then(monkeypatch: pytest.MonkeyPatch, after: Any) -> None:
    """Run ``after(ctx, output)`` as the weights stage returns, before the build re-reads its blobs."""
    def weights(ctx: StageContext, run: Any = STAGES[0].run) -> StageOutput:
        out = run(ctx)
        after(ctx, out)
        return out

    assert STAGES[0].name == "weights"
    monkeypatch.setattr(packer.build, "STAGES", (replace(STAGES[0], run=weights), *STAGES[1:]))


def _middle(staging: Path, out: StageOutput) -> int:
    (entry,) = [f for f in out.files if f.blob]
    return entry.offset + entry.size // 2  # a tensor byte of the safetensors file in the blob


def test_a_byte_flipped_before_the_re_read_is_refused_and_nothing_is_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the same inode, its mtime put back: only the bytes tell
    _with_weights_then(monkeypatch, lambda ctx, out: _flip(_blob(ctx.staging, out), _middle(ctx.staging, out),
                                                           keep_mtime=True))
    with pytest.raises(VerifyError, match=r"image/blobs/sha256/[0-9a-f]{64}.*blob does not match its descriptor"):
        build(demo_recipe(), tmp_path / "out", sandbox=False)
    assert list(tmp_path.iterdir()) == []  # no OUT, no staging


def test_a_blob_written_after_its_re_read_is_hashed_again_and_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reread: list[Path] = []

    def then_flip(path: Path, stop: Any) -> Any:
        got = sha256_unchanged(path, stop)
        _flip(Path(path), os.path.getsize(path) // 2)  # after its digest was taken: a later write
        reread.append(Path(path))
        return got

    monkeypatch.setattr(packer.build, "sha256_unchanged", then_flip)
    with pytest.raises(VerifyError, match="blob does not match its descriptor"):
        build(demo_recipe(), tmp_path / "out", sandbox=False)
    assert len(reread) == 1 and list(tmp_path.iterdir()) == []


class _Counted:
    """Bytes that the image walk's hashers took, by kind (``blob``: a blob's digest; ``file``: a
    file inside a layer)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = {"blob": 0, "file": 0}
        thread, counts = packer.oci.verify.HashThread, self.bytes

        class Thread(thread):  # type: ignore[misc, valid-type]
            def update(self, data: bytes | memoryview) -> None:
                counts["blob"] += len(data)
                super().update(data)

        class Hashlib:
            @staticmethod
            def sha256(data: bytes = b"") -> Any:
                h = hashlib.sha256(data)
                counts["file"] += len(data)

                class Counting:
                    def update(self, more: bytes | memoryview) -> None:
                        counts["file"] += len(more)
                        h.update(more)

                    def hexdigest(self) -> str:
                        return h.hexdigest()

                return Counting()

        monkeypatch.setattr(packer.oci.verify, "HashThread", Thread)
        monkeypatch.setattr(packer.oci.verify, "hashlib", Hashlib)


def test_the_final_verification_hashes_no_weight_byte_a_second_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = _Counted(monkeypatch)
    result = build(demo_recipe(), tmp_path / "out", sandbox=False)
    entry = result.manifest["files"]["weights/model.safetensors"]
    # the blob's digest came from its re-read, the file's sha256 from the writer: the walk hashed
    # only the small layers and files
    assert counted.bytes["blob"] + counted.bytes["file"] < entry["size"] // 4, counted.bytes
    assert result.checked["bytes"] > entry["size"]  # and still counted every byte as checked
    # packer verify on its own hashes the blob and the file inside it
    counted.bytes.update(blob=0, file=0)
    verify(tmp_path / "out")
    assert counted.bytes["blob"] > entry["size"] and counted.bytes["file"] > entry["size"], counted.bytes


def test_a_vouched_sha256_is_still_held_against_the_manifest(tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(demo_recipe(), out, sandbox=False)
    files = json.loads((out / "manifest.json").read_bytes())["files"]
    entry = files["weights/model.safetensors"]
    digest = "sha256:" + entry["blob"].rsplit("/", 1)[-1]
    right = packer.oci.verify.Vouch(entry["offset"], entry["size"], entry["sha256"])
    assert verify(out, vouched={digest: right})["bytes"] > entry["size"]
    wrong = replace(right, sha256="0" * 64)  # a vouch that disagrees with the manifest is refused
    with pytest.raises(VerifyError, match="models/model.safetensors.*differ"):
        verify(out, vouched={digest: wrong})
    elsewhere = replace(right, sha256="0" * 64, offset=right.offset + 4096)  # not the file's place: hashed
    assert verify(out, vouched={digest: elsewhere})["bytes"] > entry["size"]


def test_sha256_unchanged_gives_nothing_for_a_file_written_while_it_was_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import packer.fsutil

    path = tmp_path / "f"
    path.write_bytes(b"x" * 10_000)
    stop = threading.Event()
    assert sha256_unchanged(path, stop) is not None
    real = packer.fsutil.sha256_file

    def written_meanwhile(p: Any, s: Any) -> tuple[int, str]:
        got = real(p, s)
        with open(p, "ab") as f:
            f.write(b"y")
        return got

    monkeypatch.setattr(packer.fsutil, "sha256_file", written_meanwhile)
    assert sha256_unchanged(path, stop) is None
    assert sha256_unchanged(tmp_path / "missing", stop) is None
