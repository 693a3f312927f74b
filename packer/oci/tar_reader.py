"""A streaming tar reader for verification: headers and PAX records, data in large chunks.

``tarfile``'s stream mode joins and slices its buffer on every read, which costs more than
hashing the data; this reader hands out the file data in the chunks it was read in and
never seeks, so it works on a decompressing stream. It parses, it does not extract.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from typing import Protocol

BLOCK = 512
CHUNK = 16 * 2**20
_DATA_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)


class Readable(Protocol):
    def read(self, n: int = -1) -> bytes | memoryview: ...


def parse_pax(data: bytes) -> dict[str, str]:
    """Parse PAX extended header records (``"<len> <key>=<value>\\n"``)."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos:pos + 1] != b"\0":
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        record = data[space + 1 : pos + length]
        if length <= 0 or not record.endswith(b"\n") or b"=" not in record:
            raise tarfile.HeaderError(f"malformed PAX record at offset {pos}")
        key, _, value = record[:-1].partition(b"=")
        records[key.decode("utf-8")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


class TarReader:
    """Iterate a tar stream's members; read the current member's data with :meth:`chunks`."""

    def __init__(self, stream: Readable) -> None:
        self.stream = stream
        self._left = 0
        self._pad = 0
        self.pos = 0  # bytes of the stream consumed: a member's data starts here when it is yielded

    def _exact(self, n: int) -> bytes | memoryview:
        data = self.stream.read(n)
        while len(data) < n:
            more = self.stream.read(n - len(data))
            if not more:
                raise tarfile.ReadError(f"truncated tar stream: wanted {n} bytes, got {len(data)}")
            data = bytes(data) + bytes(more)
        self.pos += n
        return data

    def chunks(self) -> Iterator[bytes | memoryview]:
        """The rest of the current member's data, in chunks of up to 16 MiB."""
        while self._left:
            data = self._exact(min(CHUNK, self._left))
            self._left -= len(data)
            yield data

    def _skip(self) -> None:
        for _ in self.chunks():
            pass
        if self._pad:
            self._exact(self._pad)
            self._pad = 0

    def __iter__(self) -> Iterator[tarfile.TarInfo]:
        pax: dict[str, str] = {}
        while True:
            self._skip()
            block = bytes(self._exact(BLOCK))  # the stream may hand out views
            if block == bytes(BLOCK):
                if self._exact(BLOCK) != bytes(BLOCK):
                    raise tarfile.ReadError("a single zero block inside the tar stream")
                return
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
            if info.type == tarfile.XHDTYPE:
                pax = parse_pax(bytes(self._exact(info.size + (-info.size % BLOCK))[: info.size]))
                continue
            if "path" in pax:
                info.name = pax["path"]
            if "size" in pax:
                info.size = int(pax["size"])
            info.pax_headers = pax
            info.offset_data = self.pos
            pax = {}
            has_data = info.type in _DATA_TYPES or info.type not in tarfile.SUPPORTED_TYPES
            self._left = info.size if has_data or info.type == tarfile.XGLTYPE else 0
            self._pad = -self._left % BLOCK
            yield info
