"""The streaming writer over hand-built records: views, dtypes, chunks, casts, hashes, checks."""

from __future__ import annotations

import hashlib
import itertools
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open

from packer.checkpoint.records import DTYPE_SIZES, CheckpointContents, StorageRange, TensorRecord
from packer.errors import VerifyError, WeightsError
from packer.recipe import WeightsConfig
from packer.weights import writer
from packer.weights.plan import WeightsPlan, plan_weights
from packer.weights.verify import verify_written
from packer.weights.writer import Sources, StagedFiles, write_shard
from tests.weights_validate import validate_output

HEAD = 13  # odd offset of the storage in the raw file: nothing is aligned


def raw_file(path: Path, nbytes: int, seed: int = 0) -> Path:
    data = hashlib.shake_256(seed.to_bytes(4, "little")).digest(HEAD + nbytes)
    path.write_bytes(data)
    return path


def rec(path: Path, name: str, dtype: str, shape: tuple[int, ...], stride: tuple[int, ...],
        offset: int = 0, key: str = "0") -> TensorRecord:
    return TensorRecord(name, dtype, shape, stride,
                        StorageRange(key, path, HEAD, path.stat().st_size - HEAD), offset)


def expected_bytes(r: TensorRecord) -> bytes:
    """The view's elements in row-major order, computed one index at a time (the oracle)."""
    raw, size = r.storage.path.read_bytes(), DTYPE_SIZES[r.dtype]
    out = []
    for idx in itertools.product(*(range(d) for d in r.shape)):
        e = r.storage_offset + sum(i * s for i, s in zip(idx, r.stride, strict=True))
        out.append(raw[r.storage.offset + e * size:r.storage.offset + (e + 1) * size])
    return b"".join(out)


def write(plan: WeightsPlan, out: Path, *, verify: bool = True) -> dict[str, str]:
    out.mkdir(exist_ok=True)
    staged, sources, digests, paths, checked = StagedFiles(out), Sources(), {}, {}, set()
    try:
        for shard in plan.shards:
            tmp = staged.temp_for(shard.filename)
            done = write_shard(shard, tmp, sources, verify=verify)
            digests[shard.filename], paths[shard.filename] = done.sha256, tmp
            checked |= done.checked
            assert done.size == shard.size == tmp.stat().st_size
        verify_written(plan, paths, sources, skip=checked)
        if plan.index is not None:
            (out / "model.safetensors.index.json").write_bytes(plan.index)
        staged.commit()
    finally:
        staged.discard()
        sources.close()
    return digests


def read_back(path: Path) -> dict[str, bytes]:
    with safe_open(str(path), framework="pt") as f:
        return {n: f.get_tensor(n).reshape(-1).view(torch.uint8).numpy().tobytes()
                for n in f.keys()}  # noqa: SIM118


VIEWS = [  # name, shape, stride, storage offset (elements)
    ("contig", (3, 4), (4, 1), 0), ("offset", (2, 3), (3, 1), 5), ("transposed", (4, 3), (1, 4), 0),
    ("stepped", (3,), (3,), 1), ("scalar", (), (), 7), ("empty", (0, 4), (4, 1), 0),
    ("broadcast", (2, 3), (0, 1), 2), ("deep", (2, 2, 2), (1, 4, 2), 0),
]


@pytest.mark.parametrize(("chunk", "span"), [(writer.CHUNK, writer.SPAN), (8, 8), (64, 24), (8, 64)])
@pytest.mark.parametrize("dtype", sorted(DTYPE_SIZES))
def test_views_of_every_dtype(tmp_path: Path, dtype: str, chunk: int, span: int,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "CHUNK", chunk)  # gathered blocks
    monkeypatch.setattr(writer, "SPAN", span)  # kernel copies and their read-back: across a block, or within
    src = raw_file(tmp_path / "raw.bin", 64 * DTYPE_SIZES[dtype])
    records = [rec(src, n, dtype, sh, st, off) for n, sh, st, off in VIEWS]
    plan = plan_weights([CheckpointContents(src, "torch-zip", tuple(records))], WeightsConfig())
    digests = write(plan, tmp_path / "out")
    found = validate_output(tmp_path / "out")
    out_file = tmp_path / "out" / "model.safetensors"
    assert digests == {"model.safetensors": hashlib.sha256(out_file.read_bytes()).hexdigest()}
    assert read_back(out_file) == {r.name: expected_bytes(r) for r in records}
    assert {n: t["bytes"] for n, t in found.items()} == {r.name: expected_bytes(r) for r in records}


def test_sharded_output_and_identical_bytes_twice(tmp_path: Path) -> None:
    src = raw_file(tmp_path / "raw.bin", 4096)
    records = tuple(rec(src, f"w{i}", "F32", (8, 8), (1, 8) if i % 2 else (8, 1), 64 * i)
                    for i in range(12))
    plan = plan_weights([CheckpointContents(src, "torch-zip", records)],
                        WeightsConfig(max_shard_size=700))
    first = write(plan, tmp_path / "a")
    second = write(plan, tmp_path / "b", verify=False)
    assert first == second and len(first) == 6  # 256-byte tensors, two per 700-byte shard
    found = validate_output(tmp_path / "a")
    assert {n: t["bytes"] for n, t in found.items()} == {r.name: expected_bytes(r) for r in records}
    for name in first:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_cast_is_chunked_and_matches_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "CHUNK", 16)
    src = tmp_path / "f32.bin"
    values = torch.randn(6, 5, dtype=torch.float32)
    values[0, 0] = float("nan")
    src.write_bytes(b"x" * HEAD + values.numpy().tobytes())
    records = (rec(src, "t", "F32", (5, 6), (1, 5)), rec(src, "c", "F32", (6, 5), (5, 1), key="1"))
    plan = plan_weights([CheckpointContents(src, "torch-zip", records)], WeightsConfig(dtype="bfloat16"))
    write(plan, tmp_path / "out")
    validate_output(tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        got_t, got_c = f.get_tensor("t"), f.get_tensor("c")
    want = values.to(torch.bfloat16)
    assert got_c.dtype == torch.bfloat16
    assert got_c.view(torch.int16).equal(want.view(torch.int16))
    assert got_t.view(torch.int16).equal(want.t().contiguous().view(torch.int16))


def test_verify_finds_a_changed_byte(tmp_path: Path) -> None:
    src = raw_file(tmp_path / "raw.bin", 256)
    records = (rec(src, "a", "U8", (16,), (1,)), rec(src, "b", "U8", (4, 4), (1, 4), 32, key="1"))
    plan = plan_weights([CheckpointContents(src, "torch-zip", records)], WeightsConfig())
    write(plan, tmp_path / "out")
    out = tmp_path / "out" / "model.safetensors"
    data = bytearray(out.read_bytes())
    data[len(plan.shards[0].header) + 20] ^= 1  # inside "b", the transposed view
    out.write_bytes(bytes(data))
    match = r"model.safetensors: tensor 'b': bytes at data offset 16"
    with Sources() as sources, pytest.raises(VerifyError, match=match):
        verify_written(plan, {"model.safetensors": out}, sources)


def test_truncated_input_is_an_error_and_leaves_nothing(tmp_path: Path) -> None:
    src = raw_file(tmp_path / "raw.bin", 64)
    record = rec(src, "a", "U8", (64,), (1,))
    src.write_bytes(src.read_bytes()[:40])  # shrinks after the record was made
    plan = plan_weights([CheckpointContents(src, "torch-zip", (record,))], WeightsConfig())
    with pytest.raises(WeightsError, match=r"raw.bin: tensor 'a': input ends at byte 40"):
        write(plan, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


DTYPES = st.sampled_from(sorted(DTYPE_SIZES))


@st.composite
def views(draw: st.DrawFn, n: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    stride = tuple(draw(st.lists(st.integers(0, 6), min_size=len(shape), max_size=len(shape))))
    numel_span = sum((d - 1) * s for d, s in zip(shape, stride, strict=True) if d)
    offset = draw(st.integers(0, max(0, n - 1 - numel_span)))
    if 0 not in shape and offset + numel_span >= n:
        shape, stride = (), ()
    return shape, stride, offset


@given(st.data())
def test_property_random_records_read_back(tmp_path_factory: pytest.TempPathFactory,
                                           data: st.DataObject) -> None:
    tmp = tmp_path_factory.mktemp("prop")
    src = raw_file(tmp / "raw.bin", 8 * 64, seed=data.draw(st.integers(0, 2**16)))
    records: list[TensorRecord] = []
    for i in range(data.draw(st.integers(0, 6))):
        if records and data.draw(st.booleans()):  # an exact alias of an earlier view
            records.append(replace(data.draw(st.sampled_from(records)), name=f"t{i}"))
            continue
        dtype = data.draw(DTYPES)
        shape, stride, offset = data.draw(views(64 * 8 // DTYPE_SIZES[dtype]))
        records.append(rec(src, f"t{i}", dtype, shape, stride, offset, key=str(i % 3)))
    shard = data.draw(st.sampled_from([10**9, 64]))
    plan = plan_weights([CheckpointContents(src, "torch-zip", tuple(records))],
                        WeightsConfig(max_shard_size=shard))
    write(plan, tmp / "out")
    validate_output(tmp / "out")
    got = {}
    for s in plan.shards:
        got.update(read_back(tmp / "out" / s.filename))
    aliases = dict(plan.aliases)
    assert set(got) | set(aliases) == {r.name for r in records}
    for r in records:
        assert got[aliases.get(r.name, r.name)] == expected_bytes(r), r.name


def test_plain_path_imports_no_torch(tmp_path: Path) -> None:
    code = f"""
import sys
from pathlib import Path
from packer.checkpoint.records import CheckpointContents, StorageRange, TensorRecord
from packer.recipe import WeightsConfig
from packer.weights.plan import plan_weights
from packer.weights.verify import verify_written
from packer.weights.writer import Sources, write_shard
tmp = Path({str(tmp_path)!r})
src = tmp / "raw.bin"
src.write_bytes(bytes(range(256)))
storage = StorageRange("0", src, 0, 256)
records = (TensorRecord("a", "BF16", (8, 8), (1, 8), storage),
           TensorRecord("b", "F32", (4,), (1,), StorageRange("1", src, 128, 16)))
plan = plan_weights([CheckpointContents(src, "torch-zip", records)], WeightsConfig())
sources = Sources()
write_shard(plan.shards[0], tmp / "model.safetensors", sources)
verify_written(plan, {{"model.safetensors": tmp / "model.safetensors"}}, sources)
assert "torch" not in sys.modules, "torch was imported"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_read_back_mismatch_fails_the_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = raw_file(tmp_path / "raw.bin", 64)
    records = (rec(src, "a", "U8", (64,), (1,)),)
    plan = plan_weights([CheckpointContents(src, "torch-zip", records)], WeightsConfig())
    real = writer.os.preadv

    def flipped(fd: int, buffers: list[memoryview], offset: int) -> int:
        n = real(fd, buffers, offset)
        if offset > 0:  # leave the header alone, damage the tensor data as if the disk had
            buffers[0][0] ^= 0xFF
        return n

    monkeypatch.setattr(writer.os, "preadv", flipped)
    with pytest.raises(WeightsError, match=r"model.safetensors: tensor 'a': bytes read back at"):
        write(plan, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []
