"""Bounded decompression: the one loop every compressed input's output grows through.

A compressed input is a claim about its size that costs nothing to make: a few megabytes of
gzip or zstd become gigabytes. So no decoder here is asked for "everything" nor for "up to the
cap" in one call (zlib's ``max_length`` allocates that much at once, and a copy of it doubles
the peak): output comes in pieces of at most :data:`STEP` bytes, each checked against the cap
*before* it is kept, and one buffer holds them. Running out of memory on the way (a container's
limit below the cap) is the same refusal as the cap, one line, never a ``MemoryError``
traceback.

Used by :mod:`.remote` (a registry layer, gzip or zstd) and :mod:`.bundle_reader` (the bundle's
zstd frames, which it walks and checks first).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator

STEP = 1 << 20  # one piece of output: what a decoder may hand over at once


class InflateError(ValueError):
    """Compressed data refused: over its cap, out of memory, or malformed (one line)."""


def collect(pieces: Iterable[bytes], cap: int) -> bytearray:
    """The pieces a decoder yields (each at most :data:`STEP` bytes) in one buffer, at most
    ``cap`` bytes.

    Raises:
        InflateError: the output would pass ``cap`` (checked before a piece is kept), or memory
            ran out on the way.
    """
    out = bytearray()
    try:
        for piece in pieces:
            if len(out) + len(piece) > cap:
                raise InflateError(f"decompresses to more than the cap of {cap} bytes")
            out += piece
    except MemoryError:
        size = len(out)
        del out  # give the memory back before the error travels up
        raise InflateError(f"ran out of memory after {size} bytes decompressed (cap {cap} bytes)") from None
    return out


def gunzip(data: bytes | bytearray | memoryview, cap: int) -> bytearray:
    """gzip ``data`` (one member or several, as ``gzip`` and ``pigz`` write) decompressed, at
    most ``cap`` bytes.

    Raises:
        InflateError: over the cap, out of memory, corrupt, truncated, or trailing junk.
    """
    return collect(_gzip_pieces(memoryview(data)), cap)


def _gzip_pieces(data: memoryview) -> Iterator[bytes]:
    pos, n = 0, len(data)
    while True:  # one gzip member a turn
        d = zlib.decompressobj(wbits=31)
        while not d.eof:
            feed = data[pos: pos + STEP]  # input in pieces too: what zlib keeps unread is a copy
            try:
                piece = d.decompress(feed, STEP)
            except zlib.error as e:
                raise InflateError(f"corrupt gzip data at byte {pos} ({e})") from None
            # at the member's end zlib leaves the rest in unused_data (and, under max_length, in
            # unconsumed_tail as well): count it once
            used = len(feed) - len(d.unused_data if d.eof else d.unconsumed_tail)
            if not piece and not used:
                raise InflateError("the gzip data ends early (truncated)")
            pos += used
            yield piece
        if pos == n:
            return
        if bytes(data[pos: pos + 2]) != b"\x1f\x8b":
            raise InflateError(f"{n - pos} bytes of trailing data after the gzip data")
