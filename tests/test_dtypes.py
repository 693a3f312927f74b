"""Every dtype the safetensors library stores converts bit-exact, torch.load as the oracle.

The list comes from the library itself (``safetensors.torch._SIZE``: the torch dtypes it can
save); each is saved with torch.save, converted by packer, compared byte for byte with
``torch.load(weights_only=True)`` and read back with ``safetensors.torch.load_file``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch

from packer.checkpoint import DTYPE_SIZES, read_checkpoint
from packer.checkpoint.records import TORCH_SHAPES_KEY
from packer.recipe import WeightsConfig
from packer.weights.convert import convert
from tests.weights_validate import validate_output

LIBRARY_DTYPES = sorted((d for d in st._SIZE if d is not None), key=str)


def saved_and_converted(saved: dict[str, torch.Tensor], tmp_path: Path) -> tuple[dict[str, Any], Path]:
    """torch.save ``saved``, convert it into ``tmp_path/out/weights``: the loader's manifest and root."""
    torch.save(saved, tmp_path / "m.pt")
    root = tmp_path / "out"
    result = convert(tmp_path / "m.pt", root / "weights", WeightsConfig(), rel_root=root)
    files = {f.path: {"size": f.size, "sha256": hashlib.sha256((root / f.path).read_bytes()).hexdigest()}
             for f in result.files}
    manifest = {"name": "dtypes", "version": "1", "files": files, "weights": result.section, "bundle": None,
                "runtime": {"device": "cpu", "warmup": []}}
    return manifest, root


def code_of(dtype: torch.dtype) -> str:
    """The dtype code the safetensors library itself writes for ``dtype``."""
    t = torch.zeros(2, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else torch.zeros(1, dtype=dtype)
    header = st.save({"x": t})
    n = int.from_bytes(header[:8], "little")
    return str(json.loads(header[8 : 8 + n])["x"]["dtype"])


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    g = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def test_packer_stores_exactly_the_library_dtypes() -> None:
    assert sorted(code_of(d) for d in LIBRARY_DTYPES) == sorted(DTYPE_SIZES)


@pytest.mark.parametrize("dtype", LIBRARY_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 4), (5,), ()], ids=["2d", "1d", "0d"])
def test_every_library_dtype_converts_bit_exact(tmp_path: Path, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = sample(dtype, shape)
    src = tmp_path / "m.pt"
    torch.save({"t": t, "strided": sample(dtype, (4, 2)).t()}, src)
    oracle = torch.load(src, weights_only=True)
    out = tmp_path / "out"
    convert(src, out, WeightsConfig())
    found = validate_output(out)
    loaded = st.load_file(out / "model.safetensors")
    for name in ("t", "strided"):
        want = oracle[name]
        assert found[name]["dtype"] == code_of(dtype)
        assert found[name]["bytes"] == want.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        if want.dim() or dtype != torch.float4_e2m1fn_x2:
            assert loaded[name].dtype == dtype and loaded[name].shape == want.shape
            assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def test_zero_d_float4_is_one_byte_with_its_shape_recorded(tmp_path: Path) -> None:
    t = torch.tensor(0x3A, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    src = tmp_path / "m.pt"
    torch.save({"s": t}, src)
    out = tmp_path / "out"
    result = convert(src, out, WeightsConfig())
    found = validate_output(out)
    assert found["s"]["dtype"] == "F4" and found["s"]["shape"] == [2] and found["s"]["bytes"] == b"\x3a"
    raw = (out / "model.safetensors").read_bytes()
    meta = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])["__metadata__"]
    assert json.loads(meta[TORCH_SHAPES_KEY]) == {"s": []}
    assert result.section["tensors"]["s"]["torch_shape"] == []
    # packer's own reader gives the recorded 0-d shape back: a second conversion keeps it
    assert read_checkpoint(out / "model.safetensors").tensors[0].shape == ()
    again = tmp_path / "again"
    convert(out / "model.safetensors", again, WeightsConfig())
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_complex64_safetensors_input_is_read(tmp_path: Path) -> None:
    z = torch.randn(3, dtype=torch.complex64)
    st.save_file({"z": z}, tmp_path / "in.safetensors")
    (rec,) = read_checkpoint(tmp_path / "in.safetensors").tensors
    assert (rec.dtype, rec.shape, rec.nbytes) == ("C64", (3,), 24)


def test_complex128_is_still_refused_with_the_reason(tmp_path: Path) -> None:
    from packer.errors import CheckpointError

    torch.save({"z": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "m.pt")
    with pytest.raises(CheckpointError, match="complex dtype complex128 cannot be stored in safetensors"):
        read_checkpoint(tmp_path / "m.pt")


def test_the_runtime_loader_gives_packed_and_complex_tensors_back(tmp_path: Path) -> None:

    from packer.runtime.loading import Loader
    from packer.runtime.timeline import Timeline

    saved = {"f4": sample(torch.float4_e2m1fn_x2, (3, 2)), "f4_0d": sample(torch.float4_e2m1fn_x2, ()),
             "c64": torch.randn(2, 3, dtype=torch.complex64), "f8": sample(torch.float8_e8m0fnu, (4,))}
    manifest, root = saved_and_converted(saved, tmp_path)
    got = Loader(manifest, root, timeline=Timeline()).load_weights("cpu")
    for name, t in saved.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert got[name].reshape(-1).view(torch.uint8).tolist() == t.reshape(-1).view(torch.uint8).tolist(), name
    cast = Loader(manifest, root, timeline=Timeline()).load_weights("cpu", dtype=torch.bfloat16)
    assert cast["f4"].dtype == torch.float4_e2m1fn_x2 and cast["c64"].dtype == torch.complex64
    assert cast["f8"].dtype == torch.bfloat16


@pytest.mark.parametrize("pipeline", [False, True])
def test_the_runtime_loader_fills_a_module_with_packed_and_complex_buffers(tmp_path: Path, pipeline: bool) -> None:

    from packer.runtime.loading import Loader
    from packer.runtime.timeline import Timeline

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("f4", torch.zeros(3, 2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2))
            self.register_buffer("z", torch.zeros(2, dtype=torch.complex64))

    saved = {"f4": sample(torch.float4_e2m1fn_x2, (3, 2)), "z": torch.randn(2, dtype=torch.complex64)}
    manifest, root = saved_and_converted(saved, tmp_path)
    model = M()
    Loader(manifest, root, timeline=Timeline()).load_into(model, pipeline=pipeline)
    assert torch.equal(model.f4.view(torch.uint8), saved["f4"].view(torch.uint8))
    assert torch.equal(model.z, saved["z"])
