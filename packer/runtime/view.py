"""One view of a build: what it holds, where a file's bytes lie, how a span is read and proven.

Every reader of a build (the :class:`~.loading.Loader`, ``model_dir()``, ``packer stream``,
``packer verify``, ``packer inspect``) asks a :class:`BuildView` the same four questions:

* its **manifest** (the files it pins, the weights section);
* a file's **place** (:class:`~.place.FilePlace`: a file of its own, or a span of a layer blob);
* a **byte source** per weight file that reads a span at an offset (:meth:`BuildView.open_weight`
  gives it as a checked :class:`~.shards.Shard`: an open file, or a source that proves every
  chunk it serves);
* the **chunk table** (:meth:`BuildView.chunk_table`) every chunk is proven by, with the one
  prover of :mod:`.proof`.

How the bytes are fetched is all that differs between kinds of source, as in
go-containerregistry's ``partial``: a small core per kind (:meth:`~BuildView.held`,
:meth:`~BuildView.locate`, :meth:`~BuildView.open_weight`, :meth:`~BuildView.proof_buffers`,
:meth:`~BuildView.fetched`), and this class's shared rest. The kinds are
:class:`~.view_local.LocalView` (OUT, an image's model directory) and
:class:`~.view_registry.RegistryView` (a registry image, or a directory ``packer stream`` made);
:func:`~.view_open.open_view` picks one for any root, and nothing else decides local or registry
(``tests/test_one_view.py`` holds the rest of the code to it). The contract knows nothing of
HTTP and imports nothing above it (never the loader, never the signature module).
"""

from __future__ import annotations

import copy
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .chunks import FileChunks, parse_table, table_in_tree
from .env import ArtifactMismatchError
from .place import FilePlace, place_of
from .proof import SpanCheck, check_sha256, hash_span
from .reading import PositionalSource, check_rel, open_regular, read_bytes

if TYPE_CHECKING:
    from types import ModuleType

    import torch

    from .shards import Shard
    from .timeline import Timeline


class BuildView:
    """A read-only view of one build: its manifest and the bytes of its files.

    Args:
        manifest: the build's manifest (the loader's embedded one, or the one the build ships).
        root: the directory of its small files (OUT, a model directory, a streamed directory).
        named: the manifest as a refusal of one of its entries names it (its path, for a
            reader that opened the build's own ``manifest.json``).

    Class attributes a kind of source sets:
        proves_reads: its weight sources prove every chunk they serve (nothing to hash after).
        min_readers: reader threads a load through it wants at least (a network's latency).
    """

    proves_reads = False
    min_readers = 0

    def __init__(self, manifest: dict[str, Any], root: str | Path, *, named: str = "the manifest") -> None:
        self.manifest = manifest
        self.root = Path(root)
        self.named = named
        self._places: dict[str, FilePlace] = {}  # files entries read so far (:meth:`place`)
        self._chunks: dict[str, FileChunks] | None = None  # the chunk table, read once

    def with_manifest(self, manifest: dict[str, Any]) -> BuildView:
        """The same source seen with ``manifest`` (a component's weights section, a manifest
        a caller changed): its places and chunk table read anew from it."""
        other = copy.copy(self)
        other.manifest, other._places, other._chunks = manifest, {}, None
        return other

    # --- the core: one answer per kind of source -----------------------------------------

    def held(self, rel: str) -> FilePlace | None:
        """The place of ``rel`` when its bytes are read inside a layer blob, else None."""
        raise NotImplementedError

    def locate(self, rel: str) -> tuple[Path, int]:
        """Where the artifact ``rel``'s bytes are on this machine: ``(file, offset in it)``."""
        raise NotImplementedError

    def open_weight(self, rel: str, tensors: dict[str, Any], *, random_access: bool = False) -> Shard:
        """The weight file ``rel`` opened, its size and header checked against ``tensors``."""
        raise NotImplementedError

    def proof_buffers(self, torch: ModuleType, shards: list[Shard],
                      timeline: Timeline) -> list[tuple[torch.Tensor, int]]:
        """Per shard a CPU buffer of its bytes whose chunks :mod:`.proven` proves when first used."""
        raise NotImplementedError

    def fetched(self) -> int:
        """Bytes this view fetched from elsewhere so far (0: it reads files in place)."""
        return 0

    def fetch_line(self, timeline: Timeline, before: int, started: float) -> None:
        """Record what a load fetched since ``started`` (``before``: :meth:`fetched` then)."""

    @property
    def origin(self) -> str:
        """Where the build's bytes come from, in words: its root, or its image's pinned reference."""
        return str(self.root)

    def open_bytes(self, rel: str) -> tuple[int | PositionalSource, int, str]:
        """``(source, offset of the file's first byte in it, name for messages)`` of the file
        ``rel``, unchecked (its header not read): for a reader of raw spans (``packer verify``);
        close a descriptor with :func:`close_source`."""
        raise NotImplementedError

    def served_dir(self) -> Path | None:
        """A directory engines read as it is (``model_dir()``), or None: one is made of links."""
        return None

    # --- shared by every kind --------------------------------------------------------------

    def place(self, rel: str) -> FilePlace | None:
        """The files entry of ``rel`` read by the one rule (:func:`~.place.place_of`), or None
        for a file the manifest does not list.

        Raises:
            ArtifactMismatchError: ``rel`` is not a plain relative path, or its entry is malformed.
        """
        check_rel(rel, "the manifest's files")
        if rel not in self.manifest["files"]:
            return None
        if rel not in self._places:  # each entry read once
            self._places[rel] = place_of(rel, self.manifest["files"][rel], self.named)
        return self._places[rel]

    def path(self, rel: str) -> Path:
        """Where the artifact ``rel`` is on this machine (:meth:`locate` without the offset)."""
        return self.locate(rel)[0]

    def check_small(self, rel: str, verify: bool) -> None:
        """Check the plain artifact ``rel`` (index, bundle): present, its size; sha256 when ``verify``.

        Raises:
            ArtifactMismatchError: missing, or another size or sha256 than the manifest's.
        """
        (path, base), meta = self.locate(rel), self.manifest["files"].get(rel) or self.manifest["bundle"]
        try:
            fd = open_regular(path)  # a FIFO or a device is refused by type, never read
        except FileNotFoundError:
            raise ArtifactMismatchError(f"{rel}: missing (looked for {path})") from None
        try:
            size = os.fstat(fd).st_size - base  # in a layer blob: what follows the file is the blob's
            where = os.path.abspath(path) + (f" (at offset {base})" if base else "")
            if size < meta["size"] if base else size != meta["size"]:
                raise ArtifactMismatchError(f"{where}: {size} bytes, the manifest says {meta['size']}")
            if verify:
                check_sha256(where, hash_span(fd, base, meta["size"], where), meta["sha256"])
        finally:
            os.close(fd)

    def chunk_table(self) -> dict[str, FileChunks]:
        """The build's chunk table (:mod:`.chunks`), read once; empty for a build without one.

        Its bytes must have the sha256 the manifest pins for it (a file ``model.sig`` signs:
        under ``PACKER_REQUIRE_SIGNATURE`` the signature proves it), and each record the size
        and sha256 the manifest pins for its weight file.

        Raises:
            ArtifactMismatchError: the table is missing, over its cap, or does not match.
        """
        if self._chunks is None:
            pairs = table_in_tree(self.manifest["weights"])
            self._chunks = {} if not pairs else self._read_table(pairs[0][1])
        return self._chunks

    def _read_table(self, rel: str) -> dict[str, FileChunks]:
        path = self.path(rel)
        try:
            data = read_bytes(path, "chunks")
        except FileNotFoundError:
            raise ArtifactMismatchError(f"{rel}: missing (looked for {path})") from None
        where = os.path.abspath(path)
        check_sha256(where, hash_span(data, 0, len(data), where), self.manifest["files"][rel]["sha256"])
        return parse_table(data, where, self.manifest["files"])

    def span_check(self, rank: str = "") -> SpanCheck | None:
        """A :class:`~.proof.SpanCheck` of the chunk table, or None without one (an older build:
        its readers verify whole files). ``rank`` names the reader in messages."""
        table = self.chunk_table()
        return SpanCheck(table, rank) if table else None

    def verify_shards(self, shards: list[Shard], readers: int, timeline: Timeline) -> None:
        """Every byte of ``shards``: chunk by chunk with the chunk table (a changed byte named by
        its chunk), else each file's sha256. A shard proven as it is read needs nothing here."""
        shards = [s for s in shards if not s.proven_as_read]
        if not shards:
            return
        table = self.chunk_table()
        if table and all(s.rel in table for s in shards):
            with timeline.stage("verify chunks") as box, ThreadPoolExecutor(readers) as ex:
                checks = [SpanCheck(table) for _ in shards]  # one per thread: its counts are its own
                list(ex.map(lambda i: checks[i].check_file(shards[i].rel, shards[i].fd, shards[i].base,
                                                           shards[i].label), range(len(shards))))
                box["bytes"], box["chunks"] = sum(c.hashed for c in checks), sum(c.chunks for c in checks)
            return
        with timeline.stage("verify sha256") as box, ThreadPoolExecutor(readers) as ex:
            # hashlib releases the GIL: shards hash in parallel; inside a layer blob, the pinned range
            digests = list(ex.map(lambda s: hash_span(s.fd, s.base, s.size, s.label), shards))
            for s, digest in zip(shards, digests, strict=True):
                s.check_sha256(digest, self.manifest["files"][s.rel]["sha256"])
                box["bytes"] += s.size


def close_source(src: int | PositionalSource) -> None:
    """Close what :meth:`BuildView.open_bytes` opened (a descriptor; a source holds none)."""
    if isinstance(src, int):
        os.close(src)
