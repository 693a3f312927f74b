"""Fuzzing the checkpoint parsers: random and mutated inputs give a result or a PackerError.

Any other exception, a hang or unbounded memory is a bug. The number of examples comes from
``PACKER_FUZZ_EXAMPLES`` (default 200, spread over the tests here); set it high for a long
run. One test runs the reader in a subprocess under RLIMIT_AS to show memory stays capped.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packer.checkpoint import CheckpointContents, read_checkpoint
from packer.checkpoint.pickle_vm import run_pickle
from packer.checkpoint.records import DTYPE_SIZES
from packer.errors import PackerError
from tests.ckpt_factory import random_tensor, views_state_dict, zip_members

TOTAL = int(os.environ.get("PACKER_FUZZ_EXAMPLES", "200"))
FUZZ = settings(
    max_examples=max(1, TOTAL // 6), deadline=None, derandomize="PACKER_FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _seed(fmt: str) -> bytes:
    buf = io.BytesIO()
    sd = views_state_dict()
    sd["i8"] = random_tensor(torch.int8, (3,))
    torch.save(sd, buf, _use_new_zipfile_serialization=fmt == "zip")
    return buf.getvalue()


def _safetensors_seed() -> bytes:
    from safetensors.torch import save

    return save({"a": random_tensor(torch.float16, (2, 3)), "b": torch.zeros(0)}, metadata={"k": "v"})


ZIP = _seed("zip")
LEGACY = _seed("legacy")
SAFETENSORS = _safetensors_seed()
PKL = next(m.data for m in zip_members(ZIP) if m.name.endswith("data.pkl"))


@st.composite
def mutated(draw: st.DrawFn, seed: bytes) -> bytes:
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "int"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[pos:]
        elif op == "int" and pos + 8 <= len(data):  # a length field set to an extreme
            value = draw(st.sampled_from([0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1]))
            width = draw(st.sampled_from([2, 4, 8]))
            data[pos : pos + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")
    return bytes(data)


def _check_sane(got: CheckpointContents, size: int) -> None:
    # A result is only acceptable if every record lies inside its storage and the file.
    for rec in got.tensors:
        rng = rec.storage
        assert rng.offset >= 0 and rng.offset + rng.nbytes <= size
        if rec.numel:
            last = rec.storage_offset + sum((d - 1) * s for d, s in zip(rec.shape, rec.stride, strict=True))
            assert (last + 1) * DTYPE_SIZES[rec.dtype] <= rng.nbytes


def _read(tmp: Path, data: bytes) -> None:
    path = tmp / "fuzz.bin"
    path.write_bytes(data)
    try:
        got = read_checkpoint(path)
    except PackerError:
        return
    _check_sane(got, len(data))


def _vm(data: bytes) -> None:
    with contextlib.suppress(PackerError):
        run_pickle(data, where="fuzz: data.pkl", persistent_load=lambda pid: pid)


@FUZZ
@given(st.binary(max_size=256) | st.binary(max_size=64).map(lambda b: b"\x80\x02" + b))
def test_vm_random_bytes(data: bytes) -> None:
    _vm(data)


@FUZZ
@given(mutated(PKL))
def test_vm_mutated_torch_pickle(data: bytes) -> None:
    _vm(data)


@FUZZ
@given(mutated(ZIP))
def test_zip_mutations(tmp_path: Path, data: bytes) -> None:
    _read(tmp_path, data)


@FUZZ
@given(mutated(LEGACY))
def test_legacy_mutations(tmp_path: Path, data: bytes) -> None:
    _read(tmp_path, data)


@FUZZ
@given(mutated(SAFETENSORS))
def test_safetensors_mutations(tmp_path: Path, data: bytes) -> None:
    _read(tmp_path, data)


@FUZZ
@given(st.recursive(st.none() | st.integers() | st.text(max_size=8) | st.floats(),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                    max_leaves=12))
def test_safetensors_random_headers(tmp_path: Path, header: object) -> None:
    import json

    body = json.dumps(header).encode()
    _read(tmp_path, struct.pack("<Q", len(body)) + body + b"\x00" * 8)


_RLIMIT_SCRIPT = """
import resource, sys
from pathlib import Path
from packer.checkpoint import read_checkpoint
from packer.errors import PackerError
vm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmSize:')) * 1024
cap = vm + 256 * 2**20
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
for p in sys.argv[1:]:
    try:
        read_checkpoint(Path(p))
        print('ok')
    except PackerError:
        print('refused')
"""


def test_memory_stays_capped_under_rlimit_as(tmp_path: Path) -> None:
    inputs = {
        "string-4gib.pt": ZIP.replace(PKL, b"\x80\x04\x8d" + struct.pack("<Q", 4 << 30) + b"a" * (len(PKL) - 11)),
        "marks.legacy": LEGACY[:100] + b"(" * 100_000,
        "legacy-count.legacy": LEGACY,
        "header.safetensors": struct.pack("<Q", 2**40) + b"{}",
        "big-json.safetensors": SAFETENSORS,
    }
    rng = random.Random(0)
    for i in range(6):
        data = bytearray(ZIP if i % 2 else LEGACY)
        for _ in range(3):
            data[rng.randrange(len(data))] = rng.randrange(256)
        inputs[f"mut{i}.pt"] = bytes(data)
    paths = []
    for name, data in inputs.items():
        (tmp_path / name).write_bytes(data)
        paths.append(str(tmp_path / name))
    out = subprocess.run([sys.executable, "-c", _RLIMIT_SCRIPT, *paths], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert set(out.stdout.split()) <= {"ok", "refused"} and len(out.stdout.split()) == len(paths)


def test_seeds_are_valid() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for data in (ZIP, LEGACY, SAFETENSORS):
            path = Path(tmp) / "seed"
            path.write_bytes(data)
            assert read_checkpoint(path).tensors
