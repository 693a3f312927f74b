"""The build side's one safetensors header reader (inputs in, outputs verified).

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of a JSON object
(tensor name -> ``{dtype, shape, data_offsets}``, plus an optional ``__metadata__``), then the
data. The emitted loader cannot import packer and keeps its own reader in ``packer/runtime``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO

from packer.errors import PackerError
from packer.reading import open_regular, parse_json

# safetensors refuses larger headers: MAX_HEADER_SIZE = 100_000_000 (decimal bytes, not
# 100 MiB) in huggingface/safetensors, safetensors/src/tensor.rs.
MAX_HEADER_BYTES = 100_000_000


MAX_HEADER_DEPTH = 16  # a header nests 3 deep (name, entry, shape)


class _Refused(Exception):  # noqa: N818 - not a ValueError: it passes the parser's own handling
    """Valid JSON that the safetensors library refuses (its parser is serde_json, into unsigned
    integers and Rust strings)."""


def _utf8(text: str) -> str:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise _Refused(f"string {text[:40]!r} holds a lone surrogate escape (not valid UTF-8)") from None
    return text


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        _utf8(k)
        if isinstance(v, str):
            _utf8(v)
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _unsigned(text: str) -> int:
    # json.loads reads "-0" as 0; serde_json reads it as the float -0.0, which no offset or
    # shape accepts. Every integer in a header is unsigned, so any sign is refused.
    if text.startswith("-"):
        raise _Refused(f"signed integer {text[:24]} (offsets and shapes are unsigned)")
    return int(text)


def read_header(f: BinaryIO, path: Path, size: int, *,
                error: type[PackerError], offset: int = 0) -> tuple[dict[str, Any], int]:
    """Parse the header of the open safetensors file ``f`` (``size`` bytes long, from ``offset``:
    a file inside a layer blob).

    The length is checked against the file size and :data:`MAX_HEADER_BYTES` before anything
    is allocated; duplicate keys are refused (JSON would keep the last one silently), and so
    is what the safetensors library refuses though ``json`` reads it: a signed integer
    (``-0``) and a string with a lone surrogate escape (``"\\ud800"``).

    Returns:
        ``(header, data_start)``: the header object and the offset where tensor data begins.

    Raises:
        error: ``"{path}: safetensors header: {reason}"`` for a short file, a length over the
            cap or the file, invalid JSON, a signed integer, a lone surrogate, or a header that
            is not a JSON object.
    """

    def fail(reason: str) -> PackerError:
        return error(f"{path}: safetensors header: {reason}")

    f.seek(offset)
    head = f.read(8)
    if len(head) != 8:
        raise fail("file shorter than 8 bytes")
    n = int.from_bytes(head, "little")
    if n > MAX_HEADER_BYTES or n > size - 8:
        raise fail(f"declares {n} bytes (file {size}, cap {MAX_HEADER_BYTES})")
    raw = f.read(n)
    try:
        header = parse_json(raw, where="", error=error, max_bytes=MAX_HEADER_BYTES,
                            max_depth=MAX_HEADER_DEPTH, object_pairs_hook=_no_duplicates, parse_int=_unsigned)
    except _Refused as e:
        raise fail(str(e)) from None
    except error as e:  # not JSON, or nested too deep: reworded with the file's name
        raise fail(f"invalid JSON ({str(e).removeprefix(': ').removeprefix('not JSON: ')[:80]})") from None
    if not isinstance(header, dict):
        raise fail("not a JSON object")
    return header, 8 + n


def read_header_file(path: Path, *, error: type[PackerError], offset: int = 0,
                     size: int | None = None) -> tuple[dict[str, Any], int]:
    """:func:`read_header` of the file at ``path`` (of the ``size`` bytes at ``offset`` in it:
    a weight file inside its layer blob); an unreadable file is ``error`` too.

    Returns:
        ``(header, data_start)``, ``data_start`` counted from ``offset``.
    """
    try:
        with open_regular(path, error) as f:
            whole = os.fstat(f.fileno()).st_size
            if size is not None and offset + size > whole:
                raise error(f"{path}: {whole} bytes, too short for {size} bytes at offset {offset}")
            return read_header(f, path, whole - offset if size is None else size, error=error, offset=offset)
    except OSError as e:
        raise error(f"{path}: cannot read safetensors header: {e.strerror or e}") from e
