"""The attack corpus: every hostile checkpoint is refused, with the reason, and runs nothing.

Each builder writes one file whose payload, if executed, would create ``canary`` (or import
a module we can see in ``sys.modules``). Each case asserts the reader raises a
CheckpointError (UnsafeInputError where code was asked for) whose one-line message names the
file and the reason, that the canary does not exist and that no module was imported.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import io
import marshal
import os
import pickle
import pkgutil
import pydoc
import runpy
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from packer.checkpoint import read_checkpoint
from packer.checkpoint.pickle_vm import Limits, run_pickle
from packer.errors import CheckpointError, UnsafeInputError
from tests.ckpt_factory import (
    FakeStorage,
    FakeTensor,
    Member,
    build_zip,
    legacy_file,
    save,
    simple_tensor_dict,
    tensor_pickle,
    torch_zip,
    zip_members,
)

Builder = Callable[[Path, Path], bytes]  # (tmp dir, canary) -> file content


class Reduce:
    """Pickles as ``func(*args)``: what an attacker's __reduce__ returns."""

    def __init__(self, func: object, *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.func, self.args


def touch(canary: Path) -> Reduce:
    return Reduce(os.system, f"touch {canary}")


def in_zip(pkl: bytes, storages: dict[str, bytes] | None = None) -> bytes:
    return torch_zip(pkl, storages or {})


def good_pickle(protocol: int = 2) -> bytes:
    return tensor_pickle(simple_tensor_dict(FakeStorage("0", 4)), protocol=protocol)


def good_zip(pkl: bytes | None = None, **kw: object) -> list[Member]:
    members = zip_members(torch_zip(pkl or good_pickle(), {"0": bytes(16)}))
    for m in members:
        for k, v in kw.items():
            if m.name.endswith("data.pkl"):
                setattr(m, k, v)
    return members


def frame_lie(delta: int) -> bytes:
    pkl = bytearray(good_pickle(protocol=4))
    assert pkl[2] == 0x95  # FRAME right after PROTO 4
    (n,) = struct.unpack_from("<Q", pkl, 3)
    struct.pack_into("<Q", pkl, 3, n + delta)
    return bytes(pkl)


def memo_fanout() -> bytes:
    # L0 = [tensor]; L(i+1) = [Li, Li]: 2**64 paths through 65 small lists.
    out = bytearray(good_pickle()[:-2])  # stack: {}, "w", tensor (SETITEM and STOP dropped)
    out += b"q\x00" + b"00"  # memo[0] = tensor; pop the tensor and "w"
    out += b"X\x01\x00\x00\x00x" + b"]h\x00aq\x010"  # key "x"; memo[1] = [tensor]
    for i in range(1, 65):
        out += b"]h" + bytes([i]) + b"ah" + bytes([i]) + b"aq" + bytes([i + 1]) + b"0"
    out += b"hA" + b"s."  # memo[65] = L64 as the value of "x"
    return bytes(out)


def fanout_persid() -> bytes:
    # a persistent id holding L64, where L(i+1) = [Li, Li]: 2**64 paths for str() to print
    out = bytearray(b"\x80\x02]q\x000")
    for i in range(64):
        out += b"]h" + bytes([i]) + b"ah" + bytes([i]) + b"aq" + bytes([i + 1]) + b"0"
    return bytes(out + b"h\x40\x85Q.")


def deep_json() -> bytes:
    body = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return struct.pack("<Q", len(body)) + body


def legacy_with(main: bytes, count: int = 4, raw: bytes = bytes(16), **kw: object) -> bytes:
    return legacy_file(main, ["0"], [(count, raw)], **kw)  # type: ignore[arg-type]


LEGACY_MAIN = tensor_pickle(simple_tensor_dict(FakeStorage("0", 4)), legacy=True)


def lying(offset: int = 0, size: tuple[int, ...] = (4,), stride: tuple[int, ...] = (1,),
          numel: int = 4, nbytes: int = 16) -> bytes:
    pkl = tensor_pickle(simple_tensor_dict(FakeStorage("0", numel), offset, size, stride))
    return torch_zip(pkl, {"0": bytes(nbytes)})


def torchscript(tmp: Path) -> bytes:
    path = tmp / "ts.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path))
    return path.read_bytes()


def reduce_at(protocol: int) -> Builder:
    return lambda t, c: in_zip(pickle.dumps({"w": touch(c)}, protocol=protocol))


def with_flag(bit: int) -> Builder:
    return lambda t, c: build_zip(good_zip(flags=0x808 | bit))


G = "c{}\n{}\n"  # a protocol-0 GLOBAL


def glob(module: str, name: str) -> bytes:
    return G.format(module, name).encode()


CASES: list[tuple[str, str, Builder]] = [
    # -- pickles that run code -----------------------------------------------------------
    *[(f"reduce-protocol-{p}", "global posix.system is not allowed", reduce_at(p)) for p in (0, 2, 4, 5)],
    ("reduce-in-legacy-main", "global posix.system is not allowed",
     lambda t, c: legacy_with(pickle.dumps({"w": touch(c)}, protocol=2))),
    ("inst-opcode", "global os.system is not allowed (opcode INST",
     lambda t, c: in_zip(f"(Vtouch {c}\nios\nsystem\n.".encode())),
    ("obj-opcode", "opcode OBJ is not allowed",
     lambda t, c: in_zip(b"(" + glob("collections", "OrderedDict") + b"o.")),
    ("obj-opcode-evil-global", "global os.system is not allowed",
     lambda t, c: in_zip(b"(" + glob("os", "system") + f"Vtouch {c}\no.".encode())),
    ("newobj", "opcode NEWOBJ is not allowed",
     lambda t, c: in_zip(b"\x80\x02" + glob("collections", "OrderedDict") + b")\x81.")),
    ("newobj-ex", "opcode NEWOBJ_EX is not allowed",
     lambda t, c: in_zip(b"\x80\x04" + glob("collections", "OrderedDict") + b")}\x92.")),
    ("ext1-copyreg-registry", "opcode EXT1 is not allowed", lambda t, c: in_zip(b"\x80\x02\x82\x01.")),
    ("memo-hidden-names", "global os.system is not allowed",
     lambda t, c: in_zip(b"\x80\x04\x8c\x02os\x94\x8c\x06system\x94h\x00h\x01\x93"
                         + f"\x8c{chr(len(f'touch {c}'))}touch {c}".encode("latin-1") + b"\x85R.")),
    ("stack-global-dotted", "global pathlib.os.system is not allowed",
     lambda t, c: in_zip(b"\x80\x04\x8c\x07pathlib\x8c\x09os.system\x93" + b"N\x85R.")),
    ("stack-global-path-touch", "global pathlib.Path.touch is not allowed",
     lambda t, c: in_zip(pickle.dumps(Reduce(pathlib_touch(), c), protocol=4))),
    ("importlib-import-module", "global importlib.import_module is not allowed",
     lambda t, c: in_zip(pickle.dumps(Reduce(importlib.import_module, "antigravity"), protocol=2))),
    ("inspect-getattr-static", "global inspect.getattr_static is not allowed",
     lambda t, c: in_zip(pickle.dumps(Reduce(inspect.getattr_static, "x", "system"), protocol=2))),
    ("pkgutil-resolve-name", "global pkgutil.resolve_name is not allowed",
     lambda t, c: in_zip(pickle.dumps(Reduce(pkgutil.resolve_name, "os:system"), protocol=4))),
    ("marshal-loads", "global marshal.loads is not allowed",
     lambda t, c: in_zip(pickle.dumps(Reduce(marshal.loads, marshal.dumps(compile("1", "x", "eval"))), protocol=2))),
    ("types-function-type", "global types.FunctionType is not allowed",
     lambda t, c: in_zip(b"\x80\x02" + glob("types", "FunctionType") + b")R.")),
    ("runpy-run-path", "global runpy.run_path is not allowed",
     lambda t, c: in_zip(pickle.dumps(Reduce(runpy.run_path, str(c)), protocol=2))),
    ("pydoc-locate", "global pydoc.locate is not allowed",
     lambda t, c: in_zip(pickle.dumps(Reduce(pydoc.locate, "os.system"), protocol=2))),
    ("partial-of-torch-load", "global functools.partial is not allowed",
     lambda t, c: in_zip(pickle.dumps({"w": functools.partial(torch.load, str(c))}, protocol=2))),
    ("builtin-alias-eval", "global __builtin__.eval is not allowed",
     lambda t, c: in_zip(glob("__builtin__", "eval") + f"(Vopen('{c}','w')\ntR.".encode())),
    ("builtins-getattr", "global builtins.getattr is not allowed",
     lambda t, c: in_zip(b"\x80\x02" + glob("builtins", "getattr") + b")R.")),
    ("reduce-on-a-value-global", "REDUCE on torch.float32 is not allowed",
     lambda t, c: in_zip(b"\x80\x02" + glob("torch", "float32") + b")R.")),
    ("append-on-a-global", "APPEND on Global (only lists allowed)",
     lambda t, c: in_zip(b"\x80\x02" + glob("collections", "OrderedDict") + b"N" + b"a.")),
    ("build-on-a-list", "BUILD on list would set object state", lambda t, c: in_zip(b"\x80\x02]}b.")),
    ("benign-then-malicious", "bytes of junk after STOP",
     lambda t, c: in_zip(good_pickle() + pickle.dumps(touch(c), protocol=2), {"0": bytes(16)})),
    ("junk-after-stop", "3 bytes of junk after STOP", lambda t, c: in_zip(good_pickle() + b"xyz", {"0": bytes(16)})),
    ("frame-too-long", "FRAME", lambda t, c: in_zip(frame_lie(+5), {"0": bytes(16)})),
    ("frame-too-short", "crosses the end of its FRAME", lambda t, c: in_zip(frame_lie(-15), {"0": bytes(16)})),
    ("unknown-opcode", "unknown opcode 0xff", lambda t, c: in_zip(b"\x80\x02\xff.")),
    ("persid-not-a-storage-zip", "persistent id is not a storage",
     lambda t, c: in_zip(tensor_pickle(simple_tensor_dict(FakeStorage("0", 4)),
                                       pid=lambda s: ("module", "os", "system", "")), {"0": bytes(16)})),
    # -- placeholders (plain-data types) stay inert: never called, never a callable ---------
    ("reduce-on-a-placeholder", "REDUCE on Placeholder is not allowed",
     lambda t, c: in_zip(b"\x80\x02" + glob("argparse", "Namespace") + b")R" + f"(Vtouch {c}\ntR.".encode())),
    ("reduce-on-a-dict-placeholder", "REDUCE on PlaceholderDict is not allowed",
     lambda t, c: in_zip(b"\x80\x02" + glob("collections", "Counter") + b")R)R.")),
    ("placeholder-with-evil-argument", "global posix.system is not allowed",
     lambda t, c: in_zip(b"\x80\x02" + glob("argparse", "Namespace") + glob("posix", "system") + b"\x85R.")),
    ("numpy-scalar-with-evil-dtype", "global builtins.eval is not allowed",
     lambda t, c: in_zip(b"\x80\x02" + glob("numpy.core.multiarray", "scalar") + glob("builtins", "eval")
                         + f"Vopen('{c}','w')\n\x86R.".encode())),
    ("newobj-on-tensor-machinery", "opcode NEWOBJ is not allowed on torch._utils._rebuild_tensor_v2",
     lambda t, c: in_zip(b"\x80\x02" + glob("torch._utils", "_rebuild_tensor_v2") + b")\x81.")),
    ("newobj-on-a-placeholder-instance", "opcode NEWOBJ is not allowed on Placeholder",
     lambda t, c: in_zip(b"\x80\x02" + glob("argparse", "Namespace") + b")R)\x81.")),
    ("reconstructor-of-a-non-placeholder", "copyreg._reconstructor of torch.float32 is not allowed",
     lambda t, c: in_zip(b"\x80\x02" + glob("copyreg", "_reconstructor") + glob("torch", "float32")
                         + glob("builtins", "object") + b"N\x87R.")),
    ("placeholder-as-persistent-id", "persistent id is not a storage",
     lambda t, c: in_zip(b"\x80\x02" + glob("argparse", "Namespace") + b")RQ.")),
    ("from-type-v2-placeholder-type", "type argument is not torch.Tensor",
     lambda t, c: in_zip(b"\x80\x02" + glob("torch._tensor", "_rebuild_from_type_v2") + b"("
                         + glob("torch._utils", "_rebuild_tensor_v2") + glob("argparse", "Namespace")
                         + b")}tR.")),
    ("from-type-v2-placeholder-func", "first argument is not a torch tensor rebuild function",
     lambda t, c: in_zip(b"\x80\x02" + glob("torch._tensor", "_rebuild_from_type_v2") + b"("
                         + glob("argparse", "Namespace") + glob("torch", "Tensor") + b")}tR.")),
    ("inert-value-global-reduced", "REDUCE on builtins.object is not allowed",
     lambda t, c: in_zip(b"\x80\x02" + glob("builtins", "object") + b")R.")),
    ("persid-fanout-graph", "persistent id is not a storage: ([[[...], [...]], [[...], [...]]],)",
     lambda t, c: in_zip(fanout_persid())),
    ("legacy-persid-fanout-graph", "persistent id '?' is not a storage",
     lambda t, c: legacy_with(fanout_persid())),
    # -- torch zip structure ---------------------------------------------------------------
    ("torchscript-archive", "TorchScript archive", lambda t, c: torchscript(t)),
    ("constants-pkl", "constants.pkl: TorchScript archive",
     lambda t, c: build_zip(good_zip() + [Member("archive/constants.pkl", pickle.dumps(touch(c)))])),
    ("code-dir", "archive/code/m.py: TorchScript archive",
     lambda t, c: build_zip(good_zip() + [Member("archive/code/m.py", b"import os")])),
    ("extra-pickle", "archive/extra.pkl: extra pickle not allowed",
     lambda t, c: build_zip(good_zip() + [Member("archive/extra.pkl", pickle.dumps(touch(c)))])),
    ("compressed-entry", "compressed (method 8)", lambda t, c: build_zip(good_zip(method=8))),
    *[(f"flag-0x{bit:x}", f"flag 0x{bit:x}", with_flag(bit)) for bit in (0x1, 0x20, 0x40)],
    ("descriptor-lies", "data descriptor disagrees", lambda t, c: build_zip(good_zip(descriptor_size=7))),
    ("bad-crc", "data.pkl: CRC mismatch", lambda t, c: build_zip(good_zip(crc=1234))),
    ("duplicate-names", "duplicate name",
     lambda t, c: build_zip(good_zip() + [Member("archive/data.pkl", pickle.dumps(touch(c)))])),
    ("two-prefixes", "expected one archive prefix",
     lambda t, c: build_zip(good_zip() + [Member("other/data.pkl", good_pickle())])),
    ("cd-name-differs", "local header name differs",
     lambda t, c: build_zip(good_zip(local_name="archive/evil.pkl"))),
    ("junk-before-shifted", "junk before the archive",
     lambda t, c: build_zip(good_zip(), junk_before=b"MZ" * 50, shift_offsets=True)),
    ("junk-before-unshifted", "bad zip64 end-of-central-directory record",
     lambda t, c: build_zip(good_zip(), junk_before=b"#!/bin/sh\n")),
    ("junk-after", "12 bytes of junk after the archive", lambda t, c: build_zip(good_zip(), junk_after=b"x" * 12)),
    ("missing-storage", "member archive/data/0 is missing", lambda t, c: in_zip(good_pickle())),
    ("big-endian", "only little-endian", lambda t, c: build_zip(
        [m if not m.name.endswith("byteorder") else Member(m.name, b"big") for m in good_zip()])),
    ("truncated-zip", "no end-of-central-directory", lambda t, c: build_zip(good_zip())[:-30]),
    # -- legacy format ---------------------------------------------------------------------
    ("legacy-computed-magic", "global builtins.int is not allowed",
     lambda t, c: legacy_with(LEGACY_MAIN, magic=b"\x80\x02" + glob("builtins", "int")
                              + b"X\x16\x00\x00\x000x1950a86a20f9469cfc6cK\x10\x86R.")),
    ("legacy-wrong-magic", "not the torch legacy magic number",
     lambda t, c: legacy_with(LEGACY_MAIN, magic=pickle.dumps(0x1950A86A20F9469CFC6D, protocol=2))),
    ("legacy-storage-count-past-eof", "but only 16 remain in the file",
     lambda t, c: legacy_with(tensor_pickle(simple_tensor_dict(FakeStorage("0", 2**40)), legacy=True), count=2**40)),
    ("legacy-count-disagrees", "holds 5 elements, the pickle declares 4",
     lambda t, c: legacy_with(LEGACY_MAIN, count=5)),
    ("legacy-persid-module", "persistent id 'module' is not a storage",
     lambda t, c: legacy_with(tensor_pickle({"m": FakeStorage("0", 4)},
                                            pid=lambda s: ("module", "Linear", "x.py", "import os")))),
    ("legacy-trailing-pickle", "bytes of junk after the last storage",
     lambda t, c: legacy_with(LEGACY_MAIN, tail=pickle.dumps(touch(c), protocol=2))),
    ("legacy-keys-mismatch", "does not match the storages used",
     lambda t, c: legacy_file(LEGACY_MAIN, ["1"], [(4, bytes(16))])),
    # -- records that lie ------------------------------------------------------------------
    ("extent-past-storage", "past the end of its 16-byte storage", lambda t, c: lying(offset=1)),
    ("extent-past-storage-strided", "view ends at byte 56", lambda t, c: lying(size=(2, 2), stride=(12, 1))),
    ("negative-stride", "negative stride", lambda t, c: lying(stride=(-1,))),
    ("negative-offset", "negative shape (4,) or storage offset -1", lambda t, c: lying(offset=-1)),
    ("int64-overflow-shape", "overflow int64", lambda t, c: lying(size=(2**40, 2**40), stride=(0, 0))),
    ("int64-overflow-extent", "overflows int64", lambda t, c: lying(size=(2, 2), stride=(2**62, 1))),
    ("storage-size-disagrees", "declares 20 bytes but the member holds 16", lambda t, c: lying(numel=5)),
    ("rank-mismatch", "differ in rank", lambda t, c: lying(size=(2, 2), stride=(1,))),
    ("dtype-mismatch-same-key", "used as both", lambda t, c: in_zip(tensor_pickle(
        {"a": FakeTensor(FakeStorage("0", 4), 0, (4,), (1,)),
         "b": FakeTensor(FakeStorage("0", 16, torch.ByteStorage), 0, (4,), (1,))}), {"0": bytes(16)})),
    # -- resource bombs --------------------------------------------------------------------
    ("deep-mark-nesting", "MARK nested deeper than 1000", lambda t, c: in_zip(b"\x80\x02" + b"(" * 200_000 + b".")),
    ("memo-fanout", "choose a key: x (1000000000000 tensors)", lambda t, c: in_zip(memo_fanout(), {"0": bytes(16)})),
    ("string-4gib", "declares 4294967296 bytes but only",
     lambda t, c: in_zip(b"\x80\x04\x8d" + struct.pack("<Q", 4 << 30) + b"abc")),
    ("bytes-4gib", "declares 4294967295 bytes but only", lambda t, c: in_zip(b"\x80\x03B\xff\xff\xff\xff" + b"x" * 64)),
    ("long4-huge", "LONG of 1073741824 bytes", lambda t, c: in_zip(b"\x80\x02\x8b" + struct.pack("<i", 1 << 30))),
    ("frame-4gib", "declares 4294967296 bytes", lambda t, c: in_zip(b"\x80\x04\x95" + struct.pack("<Q", 4 << 30))),
    ("safetensors-header-4gib", "declares 4294967296 bytes",
     lambda t, c: struct.pack("<Q", 4 << 30) + b"{" + b" " * 64 + b"}"),
    ("safetensors-deep-json", "invalid JSON",
     lambda t, c: deep_json()),
]


def pathlib_touch() -> object:
    import pathlib

    return pathlib.Path.touch


@pytest.mark.parametrize(("case", "reason", "build"), CASES, ids=[c[0] for c in CASES])
def test_hostile_input_is_refused(tmp_path: Path, case: str, reason: str, build: Builder) -> None:
    canary = tmp_path / "canary"
    path = tmp_path / f"{case}.pt"
    path.write_bytes(build(tmp_path, canary))
    modules = set(sys.modules)
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(path)
    message = str(e.value)
    assert reason in message
    assert message.startswith(f"{path}: ") and "\n" not in message
    assert not canary.exists()
    # nothing was imported but packer's own lazily imported modules (the guidance of a refusal)
    assert {m for m in set(sys.modules) - modules if not m.startswith("packer.")} == set()
    if "not allowed" in reason or "TorchScript" in reason:
        assert isinstance(e.value, UnsafeInputError)


def test_corpus_is_large_enough() -> None:
    assert len({c[0] for c in CASES}) == len(CASES) >= 70


def test_torch_refuses_none_of_the_benign_builders(tmp_path: Path) -> None:
    # The builders are trustworthy: their benign forms load in torch and in packer alike.
    for name, data in [("zip", build_zip(good_zip())), ("legacy", legacy_with(LEGACY_MAIN))]:
        path = tmp_path / f"{name}.pt"
        path.write_bytes(data)
        assert torch.load(path, weights_only=True)["w"].shape == (4,)
        assert [r.name for r in read_checkpoint(path).tensors] == ["w"]
    save({"w": torch.zeros(4)}, tmp_path / "real.pt")


@pytest.mark.parametrize(
    ("limits", "data", "reason"),
    [
        (Limits(max_ops=1000), b"\x80\x02" + b"N0" * 2000 + b"N.", "more than 1000 opcodes"),
        (Limits(max_memo=100), b"\x80\x04N" + b"\x94" * 200 + b".", "more than 100 memo entries"),
        (Limits(max_stack=100), b"\x80\x02" + b"N" * 200 + b".", "stack deeper than 100"),
        (Limits(max_line=64), b"c" + b"a" * 100 + b"\nb\n.", "longer than the line cap"),
        # a memoised 10,000-item list reduced again and again: each REDUCE walks it
        (Limits(max_ops=100_000), b"\x80\x02]q\x00(" + b"N" * 10_000 + b"e"
         + (b"c__builtin__\nset\nh\x00\x85R0") * 50 + b"N.", "counting the work of REDUCE"),
    ],
    ids=["ops", "memo", "stack", "line", "reduce-work"],
)
def test_vm_caps(limits: Limits, data: bytes, reason: str) -> None:
    with pytest.raises(CheckpointError, match=reason):
        run_pickle(data, where="x: data.pkl", limits=limits)


def test_protocol_zero_persid_is_refused() -> None:
    buf = io.BytesIO(b"Pstorage\n.")
    with pytest.raises(UnsafeInputError, match="opcode PERSID is not allowed"):
        run_pickle(buf.getvalue(), where="x: data.pkl", persistent_load=lambda pid: pid)
