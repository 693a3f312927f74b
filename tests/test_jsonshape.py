"""packer.util.jsonshape: bounded parsing and one-line shape faults with their JSON path."""

from __future__ import annotations

import re
import time

import pytest

from packer.errors import ImageError
from packer.reading import parse_json
from packer.util.jsonshape import SIZE, STR, ListOf, MapOf, Nullable, Obj, check_shape

DOC = Obj(required={"items": ListOf(Obj(required={"name": STR}, optional={"size": SIZE}))},
          optional={"labels": MapOf(STR), "cmd": Nullable(ListOf(STR))})


@pytest.mark.parametrize(("doc", "message"), [
    ([], "f: top level: expected an object, got an array"),
    ({}, "f: items: expected an array (required), got nothing"),
    ({"items": [{"name": 1}]}, "f: items[0].name: expected a string, got the number 1"),
    ({"items": [{"name": "a", "size": -1}]}, "f: items[0].size: expected a size in bytes"),
    ({"items": [{"name": "a", "size": True}]}, "f: items[0].size: expected a size in bytes (an integer from 0 to "
                                                "2**53), got true"),
    ({"items": [], "labels": {"a.b": None}}, 'f: labels["a.b"]: expected a string, got null'),
    ({"items": [], "cmd": "ls"}, "f: cmd: expected an array or null, got the string 'ls'"),
])
def test_first_fault_is_one_line(doc: object, message: str) -> None:
    with pytest.raises(ImageError, match=re.escape(message)):
        check_shape(doc, DOC, where="f", error=ImageError)


def test_well_formed_and_extension_keys_pass() -> None:
    check_shape({"items": [{"name": "a", "size": 0, "x": [[]]}], "cmd": None, "other": 1}, DOC, where="f",
                error=ImageError)


@pytest.mark.parametrize(("raw", "message"), [
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper than 8"),
    (b"[" * 100_000, "nested deeper than 8"),
    (b'{"a": "' + b"[" * 1000 + b'"}', None),  # brackets inside a string do not count
    (b"x" * 65, "65 bytes, over the limit of 64"),
    (b"{", "unbalanced"),
    (b'{"a": }', "not JSON"),
    (b"[[[[[[[[[]]]]]]]]]", "nested deeper than 8"),
    (b"[[[[[[[[]]]]]]]]", None),
])
def test_parse_bounds(raw: bytes, message: str | None) -> None:
    max_bytes = 64 if len(raw) < 100 else len(raw)
    if message is None:
        parse_json(raw, where="f", error=ImageError, max_bytes=max_bytes, max_depth=8)
        return
    with pytest.raises(ImageError, match=f"f: .*{message}"):
        parse_json(raw, where="f", error=ImageError, max_bytes=max_bytes, max_depth=8)


def test_parse_is_bounded_in_time_on_hostile_strings() -> None:
    """Unterminated strings full of escaped quotes: one pass, not one scan per quote."""
    raw = b'"' + b'\\"' * 2_000_000
    start = time.perf_counter()
    with pytest.raises(ImageError, match="not JSON"):
        parse_json(raw, where="f", error=ImageError, max_bytes=len(raw), max_depth=8)
    assert time.perf_counter() - start < 20  # quadratic would be hours; this is ~1 s
