"""The CPU target: zero-copy views of a private mapping, private copies, page-cache prefetch.

Mapped tensors keep their ``mmap`` alive through ``torch.frombuffer`` (no SIGBUS after the
loader is gone); private copies are read by the reader threads straight into anonymous memory.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

from .env import ArtifactMismatchError
from .reading import open_regular
from .settings import MIB
from .shards import Shard
from .timeline import Timeline

if TYPE_CHECKING:  # the ring's modules are imported by the copy paths only (mapping needs none)
    from types import ModuleType

    import torch

    from .ring import Read


def _anonymous(torch: ModuleType, nbytes: int, hugepages: bool) -> tuple[torch.Tensor, bool]:
    """A private CPU buffer, and whether it is on transparent huge pages (``MADV_HUGEPAGE``
    applied; asked for only with ``hugepages``, ``PACKER_HUGEPAGES=1``).

    Huge pages fault fresh memory in far faster on an idle host, but on a virtual machine
    whose balloon hands free pages back to the host they fault in several times slower than
    4 KiB pages (benchmarks/fresh_memory.py). A kernel without them refuses the advice: the
    load goes on with 4 KiB pages and the ``read`` stage says so. The tensor keeps the
    mapping alive.
    """
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8), False
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    applied = False
    if hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            mm.madvise(mmap.MADV_HUGEPAGE)
            applied = True
    return torch.frombuffer(mm, dtype=torch.uint8), applied


def map_shards(torch: ModuleType, shards: list[Shard], timeline: Timeline) -> list[tuple[torch.Tensor, int]]:
    """Views of a private copy-on-write mapping per shard (of its bytes only, where a layer blob
    holds it at a page offset); the tensors keep it alive."""
    out = []
    with timeline.stage("map"):
        for s in shards:
            if s.proven_as_read:
                raise TypeError(f"{s.label}: a file proven as it is read cannot be mapped")  # the caller reads it
            mm = mmap.mmap(cast(int, s.fd), s.size, access=mmap.ACCESS_COPY, offset=s.base)
            out.append((torch.frombuffer(mm, dtype=torch.uint8), len(s.head)))
    return out


def fetch_on_use(torch: ModuleType, shards: list[Shard], timeline: Timeline) -> list[tuple[torch.Tensor, int]]:
    """Per streamed shard an empty private buffer of its size, for :mod:`.proven` to fill a chunk
    at a time when first used (untouched pages take no memory); the header in place now."""
    out = []
    with timeline.stage("map"):
        for s in shards:
            buf, _ = _anonymous(torch, s.size, False)
            buf[: len(s.head)] = torch.frombuffer(bytearray(s.head), dtype=torch.uint8)
            out.append((buf, len(s.head)))
    return out


def read_shards(torch: ModuleType, shards: list[Shard], readers: int, timeline: Timeline, *,
                hugepages: bool = False) -> list[tuple[torch.Tensor, int]]:
    """Private CPU buffers filled by the reader threads straight from the files; the ``read``
    stage's ``hugepages`` counts the buffers on transparent huge pages."""
    from .engines import host_view
    from .ring import Read

    with timeline.stage("read") as box:
        made = [_anonymous(torch, s.data_size, hugepages) for s in shards]
        box["hugepages"] = sum(applied for _, applied in made)
        out = [(b, 0) for b, _ in made]
        read_into([Read(s.fd, s.data_start, host_view(b), s.label)
                   for s, (b, _) in zip(shards, out, strict=True)], readers)
        box["bytes"] = sum(s.data_size for s in shards)
    return out


def read_into(reads: list[Read], readers: int) -> None:
    """Parallel preadv of ``reads`` straight into CPU memory."""
    from .ring import Latch, Readers

    pool, latch = Readers(readers, piece=8 * MIB), Latch()
    try:
        pool.submit_many(latch, [r for r in reads if len(r.view)])
        latch.wait()
    finally:
        pool.close()


def prefetch_files(paths: list[Path], threads: int, timeline: Timeline) -> None:
    """Warm the page cache with ``paths``: fadvise WILLNEED, then parallel reads (advisory)."""
    start, blocks, fds = time.perf_counter(), queue.SimpleQueue(), []  # type: ignore[var-annotated]
    total = 0
    for p in paths:
        try:
            fd = open_regular(p)
        except (OSError, ArtifactMismatchError):
            continue  # advisory: the load itself reports missing files
        fds.append(fd)
        size = os.fstat(fd).st_size
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
        for off in range(0, size, 16 * MIB):
            blocks.put((fd, off))
        total += size

    def work() -> None:
        scratch = bytearray(16 * MIB)
        while True:
            try:
                fd, off = blocks.get_nowait()
            except queue.Empty:
                return
            os.preadv(fd, [scratch], off)

    workers = [threading.Thread(target=work, daemon=True) for _ in range(max(threads, 1))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for fd in fds:
        os.close(fd)
    timeline.add("prefetch", start, time.perf_counter(), total, lane=3)
