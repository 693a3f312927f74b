"""A build's view over a registry image: small files fetched and proven, weights read by Range.

The image (:class:`~.remote.RemoteImage`, pinned by digest) gives the small files (config,
tokenizer, chunk table, manifest, loader), each layer proven by its digest and written into a
directory of their own (:meth:`~.remote.RemoteImage.materialize`): the view's root. A weight file
the manifest places in a layer blob is never written anywhere: its source is a
:class:`~.remote.RemoteFile`, which fetches the chunks covering a read and proves each one
(:func:`~.proof.prove_chunk`) before the reader sees a byte. HTTP lives in :mod:`.registry`,
below :mod:`.remote`; this module knows only the source contract.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from .chunks import rank_name
from .env import torch_dtype
from .place import FilePlace
from .reading import PositionalSource
from .shards import CPU_ALIGN, Shard, read_header
from .view_local import LocalView

if TYPE_CHECKING:
    from types import ModuleType

    import torch

    from .remote import RemoteImage
    from .timeline import Timeline

STREAM_READERS = 16  # benchmarks/stream_load.py: 2 readers took 2.8x the time of 16 for 1 GB on loopback


class RegistryView(LocalView):
    """The build of the registry image ``image``; its small files under ``root``.

    Args:
        manifest: the build's manifest (the loader's, or the one the image ships).
        root: the directory of the image's small files (:meth:`~.remote.RemoteImage.materialize`).
        image: the image, pinned by digest.

    Every weight file the manifest holds in a layer blob is read from the registry, whatever
    lies under ``root``: a file beside never stands in for a proven chunk.
    """

    proves_reads = True
    min_readers = STREAM_READERS  # the readers wait on the network, not the disk

    def __init__(self, manifest: dict[str, Any], root: str | Path, image: RemoteImage) -> None:
        super().__init__(manifest, root)
        self.image = image
        self._marks = (0, 0)  # the image's passed and unused bytes when the last load ended

    @property
    def ref(self) -> str:
        """The digest-pinned reference of the image (``oci://HOST/REPO@sha256:...``)."""
        return str(self.image.ref)

    def held(self, rel: str) -> FilePlace | None:
        place = self.place(rel)
        return place if place is not None and place.in_blob else None

    def open_weight(self, rel: str, tensors: dict[str, Any], *, random_access: bool = False) -> Shard:
        """The weight file ``rel``: its header read through its source (proven, chunk by chunk)."""
        place = self.held(rel)
        if place is None:
            return super().open_weight(rel, tensors, random_access=random_access)
        src = self.image.source(place, self.chunk_table().get(rel), rank_name())
        return read_header(rel, self.root / rel, src, place.size, tensors, base=place.offset, label=src.label,
                           proven_as_read=True)

    @property
    def origin(self) -> str:
        return self.ref

    def open_bytes(self, rel: str) -> tuple[int | PositionalSource, int, str]:
        """A weight file held in a blob: its source, which proves every chunk it serves."""
        place = self.held(rel)
        if place is None:
            return super().open_bytes(rel)
        src = self.image.source(place, self.chunk_table().get(rel), rank_name())
        return src, place.offset, src.label

    def proof_buffers(self, torch: ModuleType, shards: list[Shard],
                      timeline: Timeline) -> list[tuple[torch.Tensor, int]]:
        """Empty private buffers whose chunks are fetched (and proven) when first used; the
        tensors that must be copied to be aligned are read now."""
        from .cpu import fetch_on_use
        from .engines import host_view

        bufs = fetch_on_use(torch, shards, timeline)
        for s, (buf, base) in zip(shards, bufs, strict=True):
            view, src = host_view(buf), cast(PositionalSource, s.fd)  # opened here: a source
            for e in s.tensors:
                at = base + e.begin
                if e.end > e.begin and ((buf.data_ptr() + at) % CPU_ALIGN
                                        or at % torch_dtype(e.code, e.name)[1]):
                    src.read_at(view[at: base + e.end], s.base + at)
        return bufs

    def fetched(self) -> int:
        return self.image.stats.fetched

    def fetch_line(self, timeline: Timeline, before: int, started: float) -> None:
        """The ``fetch (registry, proven)`` stage; where the registry ignored ``Range``, the
        load's ``range_ignored`` (blobs), ``passed`` (bytes of whole answers read) and ``unused``
        (of those, bytes no read wanted), and one line on stderr saying what that cost. The
        load's blob readers end here (:meth:`~.remote.RemoteImage.end_load`)."""
        st, ignored = self.image.stats, self.image.range_ignored()
        self.image.end_load()
        passed, unused = st.passed - self._marks[0], st.unused - self._marks[1]
        self._marks = (st.passed, st.unused)
        fetched = st.fetched - before
        if fetched <= 0:
            return
        facts = {"range_ignored": ignored, "passed": passed, "unused": unused} if ignored else {}
        timeline.add("fetch (registry, proven)", started, time.perf_counter(), fetched,
                     chunks=st.chunks, requests=self.image.registry.requests, resumed=self.image.registry.resumed,
                     **facts)
        if ignored:
            kept = fetched - unused
            sys.stderr.write(f"packer: {self.ref}: the registry ignored Range for {ignored} blob(s) (answered the "
                             f"whole blob: a pull-through cache not holding it yet?): this load fetched {fetched} "
                             f"bytes for the {kept} it read ({fetched / max(kept, 1):.2f}x); once the cache holds "
                             "the blob, a load reads by Range again\n")

    def served_dir(self) -> Path | None:
        """The directory of the small files: engines read it as is and stream the weights."""
        return self.root
