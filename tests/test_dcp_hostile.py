"""A torch.distributed.checkpoint folder from an attacker: each fault found by a review, as a
real folder that ``dcp.save`` wrote and the test then edited (its own ``.metadata`` re-pickled,
its ``.distcp`` files rewritten), refused in one line with nothing written, or converted whole.

The faults: a ``.distcp`` (or a folder on its way) linked outside the checkpoint; chunks whose
bytes overlap (one tensor's twice, another's inside it: silent copies); an expanded chunk split
in two to get past ``weights.max_expansion``; a pairwise tiling check that a 5.7 MB metadata made
run for most of an hour; a zip64 local-header offset past 2**63 (and a central directory claimed
larger than its entries, read whole before); a lone surrogate in a file name;
a tensor saved beside the chosen part and dropped without a word; a row larger than memory
gathered in one block.
"""

from __future__ import annotations

import io
import pickle
import struct
import subprocess
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from packer.checkpoint.dcp import MAX_CELLS, _check_tiling
from packer.checkpoint.dcp_meta import Chunk, DcpTensor
from packer.checkpoint.reader import read_checkpoint
from packer.checkpoint.records import Piece, StorageRange, TensorRecord
from packer.errors import CheckpointError, WeightsError
from packer.recipe import WeightsConfig
from packer.weights import assemble
from packer.weights.plan import PlannedTensor, plan_weights

dcp = pytest.importorskip("torch.distributed.checkpoint")
md = pytest.importorskip("torch.distributed.checkpoint.metadata")
fs = pytest.importorskip("torch.distributed.checkpoint.filesystem")


def saved(folder: Path, state: dict[str, Any] | None = None) -> Path:
    """A DCP folder as ``dcp.save`` writes it in one process (default: two small tensors of a model)."""
    torch.manual_seed(0)
    state = state or {"model": {"a.weight": torch.randn(4, 6), "b.weight": torch.randn(8)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(folder))
    return folder


def metadata(folder: Path) -> Any:
    return pickle.loads((folder / ".metadata").read_bytes())  # the test's own file, written by torch


def put(folder: Path, meta: Any) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


def archive(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def convert(folder: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", "packer", "convert", str(folder), "-o", str(out), *extra],
                       capture_output=True, text=True, check=False)
    assert not out.exists() or r.returncode == 0
    return r


def refused(r: subprocess.CompletedProcess[str], out: Path) -> str:
    """The one line of a refusal, with nothing left where OUT would be."""
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "internal error" not in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]
    return lines[0]


def one_file(meta: Any, name: str, place: tuple[int, int] | None = None, rel: str | None = None) -> Any:
    """``meta`` with the storage entry of every chunk of ``name`` moved to ``rel`` / ``place``."""
    for index, info in list(meta.storage_data.items()):
        if index.fqn == name:
            at, length = place if place is not None else (info.offset, info.length)
            meta.storage_data[index] = fs._StorageInfo(rel or info.relative_path, at, length)
    return meta


@pytest.mark.parametrize("how", ["file", "folder"])
def test_a_distcp_linked_outside_the_folder_is_refused(tmp_path: Path, how: str) -> None:
    folder = saved(tmp_path / "ck")
    outside = saved(tmp_path / "elsewhere")  # the bytes an attacker wants converted
    data = next(folder.glob("*.distcp")).name
    if how == "file":
        (folder / data).unlink()
        (folder / data).symlink_to(outside / data)
        named = data
    else:
        (folder / "sub").symlink_to(outside)
        named = f"sub/{data}"
        meta = metadata(folder)
        for name in ("model.a.weight", "model.b.weight"):
            one_file(meta, name, rel=named)
        put(folder, meta)
    line = refused(convert(folder, tmp_path / "out"), tmp_path / "out")
    assert f"'{named}' named in {folder}/.metadata" in line and "leads outside" in line, line


def test_a_distcp_linked_inside_the_folder_still_converts(tmp_path: Path) -> None:
    folder = saved(tmp_path / "ck")
    data = next(folder.glob("*.distcp"))
    (folder / "real").mkdir()
    data.rename(folder / "real" / data.name)
    data.symlink_to(Path("real") / data.name)
    assert convert(folder, tmp_path / "out").returncode == 0


def test_a_chunk_that_names_another_tensors_bytes_is_refused(tmp_path: Path) -> None:
    """b's storage entry names a's chunk: b would come out as a silent copy of a."""
    folder = saved(tmp_path / "ck", {"model": {"a.weight": torch.randn(4, 6), "b.weight": torch.randn(4, 6)}})
    meta = metadata(folder)
    a = next(v for i, v in meta.storage_data.items() if i.fqn == "model.a.weight")
    put(folder, one_file(meta, "model.b.weight", (a.offset, a.length)))
    line = refused(convert(folder, tmp_path / "out"), tmp_path / "out")
    assert f"the chunks of tensor 'model.a.weight' (bytes [{a.offset}, {a.offset + a.length})) and of tensor " \
           f"'model.b.weight' (bytes [{a.offset}, {a.offset + a.length})) overlap" in line, line


def test_a_chunk_inside_another_tensors_bytes_is_refused(tmp_path: Path) -> None:
    """A's tensor data is itself B's archive (a stored zip keeps its members' bytes as they are),
    so a window inside A's chunk parses as B's."""
    inner = archive(torch.tensor([1.5, 2.5, 3.5, 4.5]))
    outer = archive(torch.frombuffer(bytearray(inner), dtype=torch.uint8))
    at = outer.find(inner)
    folder = saved(tmp_path / "ck", {"model": {"A": torch.zeros(1), "B": torch.zeros(1)}})
    next(folder.glob("*.distcp")).write_bytes(outer)
    meta = metadata(folder)
    ta, tb = meta.state_dict_metadata["model.A"], meta.state_dict_metadata["model.B"]
    ta.size = ta.chunks[0].sizes = torch.Size([len(inner)])
    ta.properties.dtype = torch.uint8
    tb.size = tb.chunks[0].sizes = torch.Size([4])
    one_file(meta, "model.A", (0, len(outer)))
    put(folder, one_file(meta, "model.B", (at, len(inner))))
    line = refused(convert(folder, tmp_path / "out"), tmp_path / "out")
    assert f"'model.A' (bytes [0, {len(outer)})) and of tensor 'model.B' (bytes [{at}, {at + len(inner)})) " \
           "overlap" in line, line


def test_one_tensors_two_chunks_on_the_same_bytes_are_refused(tmp_path: Path) -> None:
    folder = saved(tmp_path / "ck", {"model": {"w": torch.arange(4.0)}})
    meta = metadata(folder)
    w = next(iter(meta.storage_data.values()))
    meta.state_dict_metadata["model.w"].size = torch.Size([8])
    meta.state_dict_metadata["model.w"].chunks = [md.ChunkStorageMetadata(torch.Size([o]), torch.Size([4]))
                                                  for o in (0, 4)]
    meta.storage_data = {md.MetadataIndex("model.w", torch.Size([o]), i):
                         fs._StorageInfo(w.relative_path, w.offset, w.length) for i, o in enumerate((0, 4))}
    put(folder, meta)
    line = refused(convert(folder, tmp_path / "out"), tmp_path / "out")
    assert "the chunks of tensor 'model.w' (bytes [" in line and "and of tensor 'model.w'" in line, line
    assert line.endswith("overlap; each chunk of a checkpoint has bytes of its own"), line


def test_an_expanded_chunk_split_in_two_is_bounded_like_one(tmp_path: Path) -> None:
    """Two chunks, each a 4-byte storage expanded to 2**38 elements: 2 TiB from 8 bytes."""
    n = 2**38
    folder = saved(tmp_path / "ck", {"model": {"w": torch.zeros(1)}})
    blob = archive(torch.zeros(1).expand(n))
    data = next(folder.glob("*.distcp"))
    data.write_bytes(blob + blob)
    meta = metadata(folder)
    meta.state_dict_metadata["model.w"].size = torch.Size([2 * n])
    meta.state_dict_metadata["model.w"].chunks = [md.ChunkStorageMetadata(torch.Size([i * n]), torch.Size([n]))
                                                  for i in range(2)]
    meta.storage_data = {md.MetadataIndex("model.w", torch.Size([i * n]), i):
                         fs._StorageInfo(data.name, i * len(blob), len(blob)) for i in range(2)}
    put(folder, meta)
    with pytest.raises(WeightsError, match=r"holds 2199023255552 bytes over the storages of its 2 chunks, 8 bytes; "
                                           r"with it the output would be 2199023255552 bytes from 8 bytes"):
        plan_weights([read_checkpoint(folder)], WeightsConfig())
    line = refused(convert(folder, tmp_path / "out"), tmp_path / "out")
    assert "weights.max_expansion" in line


def _vector(chunks: int, *, overlap_last: bool = False) -> DcpTensor:
    cs = [Chunk((i,), (1,), "f.distcp", 0, 0) for i in range(chunks)]
    if overlap_last:  # the last two chunks name the same element: the volumes still add up
        cs[-1] = Chunk((chunks - 2,), (1,), "f.distcp", 0, 0)
    return DcpTensor("w", ("w",), "float32", (chunks,), tuple(cs))


def test_the_tiling_check_is_linear_in_the_chunks() -> None:
    """65536 chunks (the cap) of one element each: checked by the grid they cut, never pairwise
    (2**31 pairs took 43 minutes a tensor before)."""
    _check_tiling("w", _vector(65536))
    with pytest.raises(CheckpointError, match=r"^w: chunks at \[65534\] and \[65534\] overlap$"):
        _check_tiling("w", _vector(65536, overlap_last=True))
    # a 2-D grid of 256 x 256 blocks is 65536 cells; chunks cut at 2**10 distinct places in both
    # dimensions (staggered bricks) would be a million: not what sharding makes, refused unread
    grid = tuple(Chunk((i, j), (1, 1), "f", 0, 0) for i in range(256) for j in range(256))
    _check_tiling("g", DcpTensor("g", ("g",), "float32", (256, 256), grid))
    bricks = tuple(Chunk((i, o), (1, n), "f", 0, 0) for i in range(1000)
                   for o, n in ((0, 1 + i * 7 % 999), (1 + i * 7 % 999, 1999 - i * 7 % 999)))
    with pytest.raises(CheckpointError, match=rf"cut it into \d+ blocks \(at most {MAX_CELLS}\)"):
        _check_tiling("b", DcpTensor("b", ("b",), "float32", (1000, 2000), bricks))


def _zip64_offset(members: list[tuple[str, bytes]], offset: int) -> bytes:
    """A stored zip of ``members`` whose first central entry puts its local header at ``offset``
    through a zip64 extra field (the 32-bit field 0xFFFFFFFF)."""
    out, cd = bytearray(), bytearray()
    for i, (name, data) in enumerate(members):
        raw, crc, lho = name.encode(), zlib.crc32(data), len(out)
        out += struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 0, 0, 0, crc, len(data), len(data), len(raw), 0)
        out += raw + data
        extra, field = (struct.pack("<HHQ", 1, 8, offset), 0xFFFFFFFF) if i == 0 else (b"", lho)
        cd += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, crc, len(data), len(data),
                          len(raw), len(extra), 0, 0, 0, 0, field) + raw + extra
    start = len(out)
    return bytes(out + cd + struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(members), len(members), len(cd),
                                        start, 0))


@pytest.mark.parametrize("offset", [2**63, 2**62, 2**64 - 1])
def test_a_zip64_local_header_offset_past_any_file_is_one_line(tmp_path: Path, offset: int) -> None:
    import zipfile

    with zipfile.ZipFile(io.BytesIO(archive(torch.arange(4.0)))) as z:
        members = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    model = tmp_path / "model"
    model.mkdir()
    (model / "pytorch_model.bin").write_bytes(_zip64_offset(members, offset))
    for extra in ((), ("--no-sandbox",)):
        line = refused(convert(model, tmp_path / "out", *extra), tmp_path / "out")
        assert line == (f"error: {model}/pytorch_model.bin: member {members[0][0]}: local header missing "
                        "or out of bounds"), line


def test_a_lone_surrogate_in_a_chunk_file_name_is_one_line(tmp_path: Path) -> None:
    folder = saved(tmp_path / "ck")
    meta = metadata(folder)
    one_file(meta, "model.a.weight", rel="\ud800.distcp")
    put(folder, meta)
    line = refused(convert(folder, tmp_path / "out"), tmp_path / "out")
    assert r"'\ud800.distcp' is not a relative file name" in line and "lone surrogate" in line, line


def test_a_tensor_saved_beside_the_chosen_part_is_named(tmp_path: Path) -> None:
    folder = saved(tmp_path / "ck", {"model": {"a.weight": torch.randn(3)}, "lm_head.weight": torch.randn(2),
                                     "step": 3})
    c = read_checkpoint(folder)
    assert [r.name for r in c.tensors] == ["a.weight"] and c.left_out == ("lm_head.weight",)
    r = convert(folder, tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert "not converted (beside the selected key): lm_head.weight" in r.stderr + r.stdout


def test_a_row_larger_than_a_block_is_gathered_in_bounded_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A [3, 2, 40] tensor in column pieces, with blocks of 64 bytes: a row (320 bytes) is more
    than a block, so each block is a run inside one row; every block is at most 64 bytes and the
    blocks, joined, are the tensor row-major."""
    monkeypatch.setattr(assemble, "CHUNK", 64)
    full = np.arange(3 * 2 * 40, dtype="<u4").reshape(3, 2, 40)
    parts = {(0, 0, 0): full[:, :, :15], (0, 0, 15): full[:, :, 15:]}
    views: dict[str, np.ndarray] = {}
    pieces = []
    for offsets, part in parts.items():
        key = f"piece{offsets}"
        views[key] = part
        rec = TensorRecord(key, "U32", part.shape, (), StorageRange(key, Path("f"), 0, part.nbytes), 0)
        pieces.append(Piece(offsets, rec))
    whole = TensorRecord("w", "U32", full.shape, (80, 40, 1), StorageRange("dcp:w", Path("m"), 0, full.nbytes), 0,
                         tuple(pieces))
    blocks = list(assemble.piece_blocks(PlannedTensor("w", whole, "U32", 0, full.nbytes),
                                        lambda r: views[r.storage.key]))
    assert max(b.nbytes for b in blocks) <= 64
    assert b"".join(np.ascontiguousarray(b).tobytes() for b in blocks) == full.tobytes()


def test_a_central_directory_claimed_larger_than_its_entries_is_refused_unread(tmp_path: Path) -> None:
    """One entry whose directory is said to start at byte 0 and run to the end record: the whole
    file would be read into memory as the directory."""
    data = bytearray(_zip64_offset([("archive/data/0", bytes(300_000))], 0))  # more than one entry can be
    data[-22:] = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 1, 1, len(data) - 22, 0, 0)
    model = tmp_path / "model"
    model.mkdir()
    (model / "pytorch_model.bin").write_bytes(data)
    line = refused(convert(model, tmp_path / "out", "--no-sandbox"), tmp_path / "out")
    assert line == f"error: {model}/pytorch_model.bin: zip: central directory claims 1 entries in {len(data) - 22} " \
                   "bytes"
