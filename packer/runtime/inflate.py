"""Bounded decompression: the one loop every compressed input's output grows through.

A compressed input is a claim about its size that costs nothing to make: a few megabytes of
gzip or zstd become gigabytes. So no decoder here is asked for "everything" nor for "up to the
cap" in one call (zlib's ``max_length`` allocates that much at once, and a copy of it doubles
the peak): output comes in pieces of at most :data:`STEP` bytes, each checked against the cap
*before* it is kept, and one buffer holds them. Running out of memory on the way is the same
refusal as the cap, one line, never a ``MemoryError`` traceback. A container's memory limit
(its cgroup's, v1 or v2) does not raise ``MemoryError``: the kernel kills the process. So where
one is set, the cap is also at most half of it (:func:`memory_budget`), checked the same way.

Used by :mod:`.remote` (a registry layer, gzip or zstd) and :mod:`.bundle_reader` (the bundle's
zstd frames, which it walks and checks first).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator

from .reading import read_kernel_text

STEP = 1 << 20  # one piece of output: what a decoder may hand over at once
NO_LIMIT = 1 << 62  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


class InflateError(ValueError):
    """Compressed data refused: over its cap, out of memory, or malformed (one line)."""


class OverCapError(InflateError):
    """Compressed data whose output would pass its cap (what it declares, or what it yields)."""


def collect(pieces: Iterable[bytes], cap: int) -> bytearray:
    """The pieces a decoder yields (each at most :data:`STEP` bytes) in one buffer, at most
    ``cap`` bytes.

    Raises:
        OverCapError: the output would pass ``cap`` (checked before a piece is kept).
        InflateError: memory ran out on the way.
    """
    budget = memory_budget()
    why = f"the cap of {cap} bytes"
    if budget is not None and budget < cap:
        cap, why = budget, f"{budget} bytes, half this process's memory limit (its cgroup's)"
    out = bytearray()
    try:
        for piece in pieces:
            if len(out) + len(piece) > cap:
                raise OverCapError(f"decompresses to more than {why}")
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


def memory_budget() -> int | None:
    """Half the smallest memory limit set on this process's cgroups or their parents (v1
    ``memory.limit_in_bytes``, v2 ``memory.max``), in bytes; None where none is set or readable.

    Half, because the buffer growing to it may be copied once as it grows, and the process
    holds more than the buffer. Read from ``/proc/self/cgroup`` and the usual mount points
    (``/sys/fs/cgroup``, its ``unified`` and ``memory`` folders).
    """
    table = read_kernel_text("/proc/self/cgroup") or ""
    limits = []
    for line in table.splitlines():
        _, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers == "" and path.startswith("/"):  # cgroup v2
            places = [("/sys/fs/cgroup", "memory.max"), ("/sys/fs/cgroup/unified", "memory.max")]
        elif "memory" in controllers.split(",") and path.startswith("/"):
            places = [("/sys/fs/cgroup/memory", "memory.limit_in_bytes")]
        else:
            continue
        for mount, name in places:
            limits += _limits_up(mount, path, name)
    return min(limits) // 2 if limits else None


def _limits_up(mount: str, path: str, name: str) -> list[int]:
    """The limits ``name`` sets in the cgroup at ``path`` under ``mount`` and in its parents."""
    out = []
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    for depth in range(len(parts), -1, -1):
        text = read_kernel_text("/".join([mount, *parts[:depth], name]))
        value = (text or "").strip()
        if value.isdigit() and 0 < int(value) < NO_LIMIT:
            out.append(int(value))
    return out
