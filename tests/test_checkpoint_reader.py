"""read_checkpoint / inspect_checkpoint on files torch.save and safetensors wrote."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from packer.checkpoint import inspect_checkpoint, read_checkpoint
from packer.errors import CheckpointError, UnsafeInputError
from tests.ckpt_factory import (
    CODE_TO_TORCH,
    build_zip,
    every_dtype_state_dict,
    materialize,
    nested_checkpoint,
    random_tensor,
    save,
    tensor_bytes,
    torch_zip,
    views_state_dict,
    zip_members,
)

FORMATS = ["zip", "legacy"]


def _assert_matches_torch(path: Path, records: tuple, expected: dict) -> None:
    for rec in records:
        want = expected[rec.name]
        got = materialize(rec)
        assert CODE_TO_TORCH[rec.dtype] == want.dtype, rec.name
        assert got.shape == want.shape and got.stride() == want.stride(), rec.name
        assert rec.storage_offset == want.storage_offset(), rec.name
        assert tensor_bytes(got) == tensor_bytes(want), rec.name


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_dtype_matches_torch_load(tmp_path: Path, fmt: str) -> None:
    path = save(every_dtype_state_dict(), tmp_path / "m.pt", fmt)
    got = read_checkpoint(path)
    assert got.format == {"zip": "torch-zip", "legacy": "torch-legacy"}[fmt]
    assert [r.name for r in got.tensors] == list(every_dtype_state_dict())
    assert {r.dtype for r in got.tensors} == set(CODE_TO_TORCH)
    # torch's own legacy loader cannot read back float8/uint16+ (UntypedStorage has no dtype),
    # so legacy files are compared with the tensors that were saved.
    expected = torch.load(path, weights_only=True) if fmt == "zip" else every_dtype_state_dict()
    _assert_matches_torch(path, got.tensors, expected)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex32])  # complex64 is C64
def test_complex_is_an_error_naming_the_tensor(tmp_path: Path, fmt: str, dtype: torch.dtype) -> None:
    path = save({"ok": torch.ones(2), "z": torch.zeros(2, dtype=dtype)}, tmp_path / "c.pt", fmt)
    with pytest.raises(CheckpointError, match=r"tensor z: complex dtype complex\d+ cannot be stored"):
        read_checkpoint(path)
    info = inspect_checkpoint(path)
    assert [t["supported"] for t in info["tensors"]] == [True, False]


@pytest.mark.parametrize("fmt", FORMATS)
def test_views_ties_parameters_and_skipped(tmp_path: Path, fmt: str) -> None:
    sd = views_state_dict()
    path = save(sd, tmp_path / "v.pt", fmt)
    got = read_checkpoint(path)
    by = {r.name: r for r in got.tensors}
    assert got.skipped == ("step", "note")
    assert by["slice"].storage_offset == 6 and by["slice"].storage.nbytes == 96
    assert by["transposed"].stride == (1, 6)
    assert by["empty"].shape == (0, 4) and by["scalar"].shape == () and by["scalar"].stride == ()
    assert by["embed.weight"].storage == by["lm_head.weight"].storage
    assert by["param"].dtype == "F16"  # nn.Parameter unwrapped
    _assert_matches_torch(path, got.tensors, torch.load(path, weights_only=True))


@pytest.mark.parametrize("fmt", FORMATS)
def test_module_state_dict_with_metadata(tmp_path: Path, fmt: str) -> None:
    # nn.Module.state_dict() carries _metadata, written with BUILD on the OrderedDict.
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    path = save(model.state_dict(), tmp_path / "m.pt", fmt)
    got = read_checkpoint(path)
    assert [r.name for r in got.tensors] == list(model.state_dict())
    _assert_matches_torch(path, got.tensors, model.state_dict())


def test_a_pickled_whole_module_is_refused_with_the_state_dict_hint(tmp_path: Path) -> None:
    torch.save(torch.nn.Linear(3, 2), tmp_path / "whole.pt")
    with pytest.raises(CheckpointError, match=r"a pickled model object, not a state dict: .*"
                       r"\(a torch\.nn\.modules\.linear\.Linear\)"):
        read_checkpoint(tmp_path / "whole.pt")


def test_nested_without_key_lists_candidates(tmp_path: Path) -> None:
    path = save(nested_checkpoint(), tmp_path / "ckpt.pt")
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(path)
    assert str(e.value) == (
        f"{path}: not a flat tensor dict; choose a key: state_dict (2 tensors), model (1 tensor), optimizer (1 tensor)"
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_key_selection(tmp_path: Path, fmt: str) -> None:
    path = save(nested_checkpoint(), tmp_path / "ckpt.pt", fmt)
    sd = read_checkpoint(path, key="state_dict")
    assert [r.name for r in sd.tensors] == ["w", "b"] and sd.skipped == ()
    ema = read_checkpoint(path, key="model.ema")
    assert [r.name for r in ema.tensors] == ["w"]
    loaded = torch.load(path, weights_only=True)
    _assert_matches_torch(path, ema.tensors, loaded["model"]["ema"])
    hp = read_checkpoint(path, key="hparams")
    assert hp.tensors == () and hp.skipped == ("lr", "name")
    nested = r"key model: not a flat tensor dict; choose a key: model\.ema \(1 tensor\)"
    with pytest.raises(CheckpointError, match=nested):
        read_checkpoint(path, key="model")
    with pytest.raises(CheckpointError, match=r"key nope: not found; top-level entries: epoch, state_dict"):
        read_checkpoint(path, key="nope")
    with pytest.raises(CheckpointError, match=r"key epoch: holds int, not a dict of tensors"):
        read_checkpoint(path, key="epoch")


def test_key_with_literal_dots_and_int_keys(tmp_path: Path) -> None:
    obj = {"a.b": {"w": torch.ones(1)}, "opt": {0: {"m": torch.zeros(1)}}}
    path = save(obj, tmp_path / "d.pt")
    assert [r.name for r in read_checkpoint(path, key="a.b").tensors] == ["w"]
    assert [r.name for r in read_checkpoint(path, key="opt.0").tensors] == ["m"]


def test_single_tensor_file_is_an_error(tmp_path: Path) -> None:
    path = save(torch.ones(3), tmp_path / "t.pt")
    with pytest.raises(CheckpointError, match="top level: holds a single tensor"):
        read_checkpoint(path)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("protocol", [1, 2, 3, 4, 5])  # torch cannot write protocol 0
def test_pickle_protocols(tmp_path: Path, fmt: str, protocol: int) -> None:
    sd = OrderedDict(a=random_tensor(torch.float32, (3, 2)), b=random_tensor(torch.int64, (2,)))
    sd["blob"] = b"\x00\xffbytes"  # protocol 2 writes bytes through _codecs.encode
    sd["tags"] = {"x", "y"}
    sd["big"] = 2**70
    path = tmp_path / "p.pt"
    torch.save(sd, path, pickle_protocol=protocol, _use_new_zipfile_serialization=fmt == "zip")
    got = read_checkpoint(path)
    assert got.skipped == ("blob", "tags", "big")
    _assert_matches_torch(path, got.tensors, sd)  # weights_only torch.load refuses some of these


def test_plain_zipfile_archive_without_descriptors(tmp_path: Path) -> None:
    src = save({"w": random_tensor(torch.float16, (4,))}, tmp_path / "a.pt")
    out = tmp_path / "b.pt"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for m in zip_members(src.read_bytes()):
            z.writestr(m.name, m.data)
    got = read_checkpoint(out)
    _assert_matches_torch(out, got.tensors, torch.load(src, weights_only=True))


def test_zip64_central_directory_fields(tmp_path: Path) -> None:
    src = save({"w": random_tensor(torch.int32, (3, 3))}, tmp_path / "a.pt")
    out = tmp_path / "b.pt"
    out.write_bytes(build_zip(zip_members(src.read_bytes()), zip64_fields=True))
    got = read_checkpoint(out)
    assert zipfile.ZipFile(out).testzip() is None  # a valid archive for zipfile too
    _assert_matches_torch(out, got.tensors, torch.load(src, weights_only=True))


def test_storage_crc_only_checked_on_request(tmp_path: Path) -> None:
    path = save({"w": torch.zeros(64)}, tmp_path / "a.pt")
    rec = read_checkpoint(path).tensors[0]
    data = bytearray(path.read_bytes())
    data[rec.storage.offset] ^= 0xFF
    path.write_bytes(bytes(data))
    assert read_checkpoint(path).tensors == (rec,)  # storage bytes are not read by default
    with pytest.raises(CheckpointError, match=r"member a/data/0: CRC mismatch"):
        read_checkpoint(path, verify_crc=True)


def test_safetensors_input(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {"b": random_tensor(torch.bfloat16, (3, 2)), "a": random_tensor(torch.uint8, (5,)),
               "e": torch.zeros(0, 2), "s": torch.tensor(1.5)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, path, metadata={"format": "pt", "k": "v"})
    got = read_checkpoint(path)
    assert got.format == "safetensors" and dict(got.metadata) == {"format": "pt", "k": "v"}
    assert sorted(r.name for r in got.tensors) == sorted(tensors)
    _assert_matches_torch(path, got.tensors, tensors)
    with pytest.raises(CheckpointError, match="safetensors files have no nested dicts"):
        read_checkpoint(path, key="x")
    assert inspect_checkpoint(path)["format"] == "safetensors"


def test_inspect_nested(tmp_path: Path) -> None:
    obj = nested_checkpoint()
    obj["state_dict"]["tied"] = obj["state_dict"]["w"]
    path = save(obj, tmp_path / "n.pt", "legacy")
    info = inspect_checkpoint(path)
    assert json.loads(json.dumps(info)) == info
    names = [t["name"] for t in info["tensors"]]
    assert names == ["state_dict.w", "state_dict.b", "state_dict.tied", "model.ema.w",
                     "optimizer.state.0.exp_avg"]
    assert info["alias_groups"] == [["state_dict.w", "state_dict.tied"]]
    assert info["tensors"][0]["alias_group"] == 0 and info["tensors"][1]["alias_group"] is None
    assert info["tensors"][0]["nbytes"] == 16 and info["tensors"][0]["dtype"] == "F32"
    assert info["skipped"] == ["epoch", "model.decay", "optimizer.param_groups", "hparams"]
    assert {"name": "state_dict", "tensors": 3} in info["containers"]


@pytest.mark.parametrize("content", [b"", b"hello world\n" * 4, b"\x00" * 100])
def test_unrecognised_files(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "x.bin"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=r"x\.bin: not a torch zip, legacy torch or safetensors"):
        read_checkpoint(path)
    with pytest.raises(CheckpointError, match="cannot open"):
        read_checkpoint(tmp_path / "missing.pt")


def test_importing_the_reader_does_not_import_torch() -> None:
    code = "import packer.checkpoint, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(("make", "what", "fix"), [
    (lambda: torch.eye(3).to_sparse(), "a sparse tensor", "to_dense()"),
    (lambda: torch.eye(3).to_sparse_csr(), "a sparse tensor", "to_dense()"),
    (lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8),
     "a quantized tensor (qint8/quint8/qint32)", "dequantize()"),
    (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "a nested (ragged) tensor", "unbind()"),
])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_tensor_layout_safetensors_cannot_hold_is_named_with_its_fix(tmp_path: Path, make: Callable[[], object],
                                                                        what: str, fix: str) -> None:
    path = save({"dense": torch.ones(2), "t": make()}, tmp_path / "s.pt")
    for call in (read_checkpoint, inspect_checkpoint):
        with pytest.raises(CheckpointError) as err:
            call(path)
        message = str(err.value)
        assert f"holds {what}, which packer does not convert" in message and fix in message
        assert "--allow-global" not in message  # a placeholder would leave the tensor out


def test_a_global_that_is_no_python_name_gets_no_allow_hint(tmp_path: Path) -> None:
    path = tmp_path / "g.pt"
    path.write_bytes(torch_zip(b"\x80\x04\x8c\x04os x\x8c\x06system\x93.", {}))
    with pytest.raises(UnsafeInputError, match="global os x.system is not allowed.*it is not a Python name") as err:
        read_checkpoint(path)
    assert "--allow-global" not in str(err.value)
