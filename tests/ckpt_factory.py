"""Checkpoint fixtures for tests: torch.save'd state dicts and byte-level hostile builders.

Benign files come from torch.save itself (zip, or legacy with
``_use_new_zipfile_serialization=False``). Hostile files are assembled here byte by byte:
a stored-zip writer with every field under control, a legacy stacked-pickle writer and a
pickler that emits torch's tensor opcodes around storages we describe, so records can lie.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from hypothesis import strategies as st

SAVE_DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
    torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool,
]
CODE_TO_TORCH = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32,
    "U64": torch.uint64, "BOOL": torch.bool,
}


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs included for floats); 0/1 for bool."""
    gen = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * item,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape).clone()


def save(obj: object, path: Path, fmt: str = "zip") -> Path:
    """torch.save ``obj`` to ``path`` as ``zip`` or ``legacy``; return the path."""
    torch.save(obj, path, _use_new_zipfile_serialization=(fmt == "zip"))
    return path


def every_dtype_state_dict() -> dict[str, torch.Tensor]:
    return {str(dt).removeprefix("torch."): random_tensor(dt, (2, 3), i) for i, dt in enumerate(SAVE_DTYPES)}


def views_state_dict() -> dict[str, object]:
    """Every view kind, plus ties and non-tensor entries."""
    base = random_tensor(torch.float32, (4, 6), 1)
    emb = random_tensor(torch.bfloat16, (5, 3), 2)
    return {
        "base": base,
        "slice": base[1:3],  # storage larger than the tensor, non-zero offset
        "cols": base[:, 2:5],  # non-contiguous, offset
        "transposed": base.t(),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "embed.weight": emb,
        "lm_head.weight": emb,  # an exact tie
        "param": torch.nn.Parameter(random_tensor(torch.float16, (3,), 3)),
        "step": 7,
        "note": "hello",
    }


def nested_checkpoint() -> dict[str, object]:
    """A Lightning-like checkpoint: state_dict, an ema model, optimizer state, counters."""
    sd = {"w": random_tensor(torch.float32, (2, 2), 4), "b": random_tensor(torch.float32, (2,), 5)}
    return {
        "epoch": 3,
        "state_dict": sd,
        "model": {"ema": {"w": random_tensor(torch.float32, (2, 2), 6)}, "decay": 0.99},
        "optimizer": {"state": {0: {"exp_avg": torch.zeros(2, 2)}}, "param_groups": [{"lr": 0.1}]},
        "hparams": {"lr": 0.1, "name": "x"},
    }


@st.composite
def state_dicts(draw: st.DrawFn) -> tuple[object, str | None, dict[str, torch.Tensor]]:
    """(object to save, key to select, the flat tensor dict the key selects)."""
    flat: dict[str, object] = {}
    tensors: list[torch.Tensor] = []
    for i in range(draw(st.integers(1, 6))):
        dtype = draw(st.sampled_from(SAVE_DTYPES))
        kind = draw(st.sampled_from(["plain", "slice", "transpose", "scalar", "empty", "alias", "param"]))
        shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
        t = random_tensor(dtype, shape, draw(st.integers(0, 99)))
        if kind == "slice" and shape[0] > 1:
            t = t[1:]
        elif kind == "transpose" and len(shape) > 1:
            t = t.transpose(0, 1)
        elif kind == "scalar":
            t = t.reshape(-1)[0].clone()
        elif kind == "empty":
            t = torch.empty((0,) + shape[1:], dtype=dtype)
        elif kind == "alias" and tensors:
            t = draw(st.sampled_from(tensors))
        elif kind == "param" and dtype.is_floating_point:
            t = torch.nn.Parameter(t, requires_grad=False)
        tensors.append(t)
        flat[f"layer{i}.w"] = t
    if draw(st.booleans()):
        flat["step"] = 3
    nest = draw(st.sampled_from([None, "state_dict", "model.ema"]))
    ordered = OrderedDict(flat)
    if nest is None:
        return ordered, None, flat  # type: ignore[return-value]
    if nest == "state_dict":
        return {"state_dict": ordered, "epoch": 1}, nest, flat  # type: ignore[return-value]
    return {"model": {"ema": ordered}, "extra": {"t": torch.ones(1)}}, nest, flat  # type: ignore[return-value]


# -- byte-level builders --------------------------------------------------------------------


@dataclass
class Member:
    """One zip entry to write; every field may be set to lie."""

    name: str
    data: bytes
    method: int = 0
    flags: int = 0x808
    crc: int | None = None
    local_name: str | None = None
    descriptor_size: int | None = None  # a data descriptor that lies about the size


def build_zip(members: list[Member], *, junk_before: bytes = b"", shift_offsets: bool = False,
              junk_after: bytes = b"", zip64_fields: bool = False) -> bytes:
    """A torch-style stored zip: descriptors after data, zip64 end records.

    ``zip64_fields`` writes 0xFFFFFFFF in every central size and offset, with the real values
    in a zip64 extra field (what torch writes for members or offsets past 4 GiB).
    """
    out = io.BytesIO()
    out.write(junk_before)
    base = len(junk_before) if shift_offsets else 0
    central = io.BytesIO()
    for m in members:
        crc = zlib.crc32(m.data) if m.crc is None else m.crc
        lho = out.tell() - len(junk_before) + base
        lname = (m.local_name or m.name).encode()
        pad = (-(out.tell() + 30 + len(lname) + 4)) % 64
        extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        sizes = (0, 0, 0) if m.flags & 0x8 else (crc, len(m.data), len(m.data))
        out.write(struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, m.flags, m.method, 0, 0, *sizes,
                              len(lname), len(extra)) + lname + extra + m.data)
        if m.flags & 0x8:
            dsize = len(m.data) if m.descriptor_size is None else m.descriptor_size
            out.write(struct.pack("<4sIII", b"PK\x07\x08", crc, dsize, dsize))
        name = m.name.encode()
        size, cd_lho, cd_extra = len(m.data), lho, b""
        if zip64_fields:
            cd_extra = struct.pack("<HHQQQ", 1, 24, size, size, lho)
            size = cd_lho = 0xFFFFFFFF
        central.write(struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 0, 45, m.flags, m.method,
                                  0, 0, crc, size, size, len(name), len(cd_extra), 0, 0, 0, 0,
                                  cd_lho) + name + cd_extra)
    cd = central.getvalue()
    cd_off = out.tell() - len(junk_before) + base
    out.write(cd)
    z64 = out.tell() - len(junk_before) + base
    n = len(members)
    out.write(struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 30, 45, 0, 0, n, n, len(cd), cd_off))
    out.write(struct.pack("<4sIQI", b"PK\x06\x07", 0, z64, 1))
    out.write(struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, n, n, len(cd), cd_off, 0))
    out.write(junk_after)
    return out.getvalue()


def zip_members(data: bytes) -> list[Member]:
    """The members of a torch zip (read with zipfile; test side only)."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return [Member(i.filename, z.read(i.filename)) for i in z.infolist()]


class FakeStorage:
    """A storage as the pickle will describe it: type, key and declared element count."""

    def __init__(self, key: str, numel: int, storage_type: type = torch.FloatStorage) -> None:
        self.key, self.numel, self.storage_type = key, numel, storage_type


class FakeTensor:
    """Pickles as torch's ``_rebuild_tensor_v2`` call with whatever fields we give."""

    def __init__(self, storage: FakeStorage, offset: int, size: tuple[int, ...],
                 stride: tuple[int, ...]) -> None:
        self.args = (storage, offset, size, stride, False, OrderedDict())

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        return torch._utils._rebuild_tensor_v2, self.args


def tensor_pickle(obj: object, *, legacy: bool = False, protocol: int = 2,
                  pid: Callable[[FakeStorage], object] | None = None) -> bytes:
    """Pickle ``obj`` with FakeStorage objects written as torch persistent ids."""

    class _Pickler(pickle.Pickler):
        def persistent_id(self, o: object) -> object:
            if not isinstance(o, FakeStorage):
                return None
            if pid is not None:
                return pid(o)
            base = ("storage", o.storage_type, o.key, "cpu", o.numel)
            return base + (None,) if legacy else base

    buf = io.BytesIO()
    _Pickler(buf, protocol=protocol).dump(obj)
    return buf.getvalue()


def torch_zip(pkl: bytes, storages: dict[str, bytes], *, extra: list[Member] = (),  # type: ignore[assignment]
              prefix: str = "archive") -> bytes:
    """A torch zip holding ``pkl`` as data.pkl and the given storages."""
    members = [Member(f"{prefix}/data.pkl", pkl), Member(f"{prefix}/byteorder", b"little")]
    members += [Member(f"{prefix}/data/{k}", v) for k, v in storages.items()]
    members += [Member(f"{prefix}/version", b"3\n"), *extra]
    return build_zip(members)


MAGIC = 0x1950A86A20F9469CFC6C


def legacy_file(main: bytes, keys: list[str], storages: list[tuple[int, bytes]], *,
                magic: bytes | None = None, tail: bytes = b"") -> bytes:
    """A legacy stacked-pickle file: magic, version, sys_info, main, keys, storages."""
    sys_info = {"protocol_version": 1001, "little_endian": True,
                "type_sizes": {"short": 2, "int": 4, "long": 4}}
    parts = [magic if magic is not None else pickle.dumps(MAGIC, protocol=2),
             pickle.dumps(1001, protocol=2), pickle.dumps(sys_info, protocol=2), main,
             pickle.dumps(keys, protocol=2)]
    parts += [struct.pack("<q", count) + raw for count, raw in storages]
    return b"".join(parts) + tail


def simple_tensor_dict(storage: FakeStorage, offset: int = 0, size: tuple[int, ...] = (4,),
                       stride: tuple[int, ...] = (1,)) -> dict[str, object]:
    return {"w": FakeTensor(storage, offset, size, stride)}


def materialize(record: object) -> torch.Tensor:
    """A record's tensor rebuilt from the raw bytes of its storage range (torch.as_strided)."""
    rec = record  # TensorRecord; typed loosely so this module needs no packer import
    dtype = CODE_TO_TORCH[rec.dtype]  # type: ignore[attr-defined]
    rng = rec.storage  # type: ignore[attr-defined]
    with open(rng.path, "rb") as f:
        f.seek(rng.offset)
        raw = f.read(rng.nbytes)
    item = torch.empty((), dtype=dtype).element_size()
    usable = len(raw) // item * item
    if usable:
        flat = torch.frombuffer(bytearray(raw[:usable]), dtype=torch.uint8).view(dtype)
    else:
        flat = torch.empty(0, dtype=dtype)
    return torch.as_strided(flat, rec.shape, rec.stride, rec.storage_offset)  # type: ignore[attr-defined]


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The tensor's values as bytes in logical order (NaN-safe comparison)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def _tensor_ops(storage: FakeStorage) -> bytes:
    """The opcodes that push one tensor (a protocol-2 pickle without its header and STOP)."""
    return tensor_pickle(FakeTensor(storage, 0, (4,), (1,)))[2:-1]


def deep_nesting(depth: int, *, kind: str = "list", tensor_at_bottom: bool = False, key_len: int = 1) -> bytes:
    """A torch zip ``{"w": tensor, "deep": [[[...]]]}`` nested ``depth`` levels, built without MARK.

    The chain is pushed container by container (EMPTY_LIST / EMPTY_DICT) and closed by one
    APPEND / SETITEM per level, so the VM's MARK-depth cap never sees it: about 1 (list) or
    7 (dict) bytes per level. A dict chain's key is ``key_len`` characters, written once and
    then fetched from the memo (BINGET), so long keys cost no file size. ``tensor_at_bottom``
    puts a second tensor in the innermost container, so every level holds a tensor.
    """
    storage = FakeStorage("0", 4)
    memo = struct.pack("<I", 1_000_000)  # clear of the memo slots the tensor opcodes use
    keys = [b"X" + struct.pack("<I", key_len) + b"a" * key_len + b"r" + memo]  # LONG_BINPUT
    keys += [b"j" + memo] * depth  # LONG_BINGET
    if kind == "list":
        opens, bottom, close = b"]" * depth, _tensor_ops(storage) + b"a", b"a"
    else:
        opens = b"}" + b"".join(k + b"}" for k in keys[: depth - 1])
        bottom, close = keys[depth - 1] + _tensor_ops(storage) + b"s", b"s"
    chain = opens + (bottom if tensor_at_bottom else b"") + close * (depth - 1)
    pkl = (b"\x80\x02}" + b"X\x01\x00\x00\x00w" + _tensor_ops(storage) + b"s"
           + b"X\x04\x00\x00\x00deep" + chain + b"s.")
    return torch_zip(pkl, {"0": bytes(16)})
