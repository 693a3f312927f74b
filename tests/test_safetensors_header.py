"""packer's safetensors input agrees with the safetensors library on every header it refuses.

The library (Rust, serde_json) is the oracle. Hypothesis draws valid headers and mutates their
text where parsers differ: numbers (``-0``, ``1.0``, ``01``, 2**64...), string escapes (lone
surrogates, NUL), structure, dtypes, the declared length and the data size. Whatever the library
refuses, ``read_checkpoint`` must refuse with a :class:`CheckpointError`; where both accept, they
see the same tensors. packer may be stricter (duplicate keys, unknown fields, leading blanks).
"""

from __future__ import annotations

import json
import re
import struct
import tempfile
from pathlib import Path

import pytest
import safetensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packer.checkpoint import read_checkpoint
from packer.errors import CheckpointError

DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
          "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8}
NUMBERS = ["-0", "-1", "1.0", "1e1", "1E0", "01", "+1", "0.0", "-0.0", "18446744073709551616",
           "9223372036854775808", "NaN", "Infinity", "null", "true", '"1"', "[]"]
ESCAPES = ["\\ud800", "\\udc00", "\\udbff\\udfff", "\\ud800\\u0041", "\\u0000", "\\x41", "\\/", "\\U0041",
           "\x01", "\x7f", "\\uD83D", "\\ud83d\\ude00"]
TOKENS = {",": [",,", ""], ":": ["::", ","], "}": ["}}", "]"], "[": ["[[", "{"], '"dtype"': ['"Dtype"', '"dtype "'],
          '"shape"': ['"shapes"'], '"data_offsets"': ['"offsets"'], '"F32"': ['"f32"', '"F128"', '"F32 "', "32"]}


@st.composite
def headers(draw: st.DrawFn) -> tuple[dict[str, object], bytes]:
    """A valid header (names of any text, every dtype, small shapes, tiled offsets) and its data."""
    header: dict[str, object] = {}
    pos = 0
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.text(max_size=6).filter(lambda n: n != "__metadata__"))
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        n = DTYPES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2))
    return header, bytes(pos)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """The file bytes of a drawn header, its JSON text mutated in one or two places (or not)."""
    header, data = draw(headers())
    text = json.dumps(header, ensure_ascii=draw(st.booleans()))
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from(["number", "escape", "token", "pad"]))
        if kind == "number" and (spots := list(re.finditer(r"(?<![\w.\\])\d+(?![\w.])", text))):
            m = draw(st.sampled_from(spots))
            text = text[: m.start()] + draw(st.sampled_from(NUMBERS)) + text[m.end():]
        elif kind == "escape" and (quotes := [m.end() for m in re.finditer(r'(?<=[{,])\s*"', text)]):
            at = draw(st.sampled_from(quotes))
            text = text[:at] + draw(st.sampled_from(ESCAPES)) + text[at:]
        elif kind == "token" and (present := [t for t in TOKENS if t in text]):
            token = draw(st.sampled_from(present))
            spots = [m.start() for m in re.finditer(re.escape(token), text)]
            at = draw(st.sampled_from(spots))
            text = text[:at] + draw(st.sampled_from(TOKENS[token])) + text[at + len(token):]
        elif kind == "pad":
            text = draw(st.sampled_from([" ", "\t", "x", "{}", ""])) + text + draw(st.sampled_from([" ", "x", "\n"]))
    raw = text.encode("utf-8", "surrogatepass")
    declared = len(raw) + draw(st.sampled_from([0, 0, 0, -1, 1, 8]))
    data += draw(st.sampled_from([b"", b"", b"", b"\0"]))
    return struct.pack("<Q", max(declared, 0)) + raw + data


def _library(path: Path) -> dict[str, tuple[str, list[int]]] | None:
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            return {k: (f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())) for k in f.keys()}  # noqa: SIM118
    except Exception:  # noqa: BLE001 - any refusal by the oracle is what we compare with
        return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_whatever_the_library_refuses_packer_refuses(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.safetensors"
        path.write_bytes(data)
        oracle = _library(path)
        try:
            got = read_checkpoint(path)
        except CheckpointError:
            return
        assert oracle is not None, f"the library refuses what packer accepts: {data[:300]!r}"
        assert {r.name: (r.dtype, list(r.shape)) for r in got.tensors} == oracle


@pytest.mark.parametrize(("header", "reason"), [
    ('{"a":{"dtype":"F32","shape":[4],"data_offsets":[-0,16]}}', "signed integer -0"),
    ('{"a":{"dtype":"F32","shape":[-0,4],"data_offsets":[0,0]}}', "signed integer -0"),
    ('{"\\ud800":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', "lone surrogate"),
    ('{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"__metadata__":{"k":"\\udc00"}}', "lone surrogate"),
])
def test_the_reported_differentials_are_refused_by_both(tmp_path: Path, header: str, reason: str) -> None:
    raw = header.encode()
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16 if "16" in header else 0))
    assert _library(path) is None
    with pytest.raises(CheckpointError, match=f"m.safetensors: safetensors header: .*{reason}"):
        read_checkpoint(path)


def test_a_surrogate_pair_escape_is_one_valid_character(tmp_path: Path) -> None:
    raw = b'{"\\ud83d\\ude00":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))
    assert _library(path) == {"\U0001f600": ("F32", [4])}
    assert [r.name for r in read_checkpoint(path).tensors] == ["\U0001f600"]
