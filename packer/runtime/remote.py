"""The streamed load: a build's weights read straight from its image in a registry.

``load_weights(root="oci://HOST/REPO@sha256:...")`` (and every verb that takes ``root``)
sees the build through a :class:`~.view_registry.RegistryView` (:func:`~.view_open.open_view`),
whose image and byte sources are made here:

1. :meth:`RemoteImage.fetch` fetches the image manifest (its sha256 must be the pinned digest;
   a tag is resolved once and the digest reported) and its config.
2. :meth:`RemoteImage.materialize` fetches packer's small layers (the compressed ones its
   config's history names as packer's: config, tokenizer, chunk table, manifest, loader; never
   a base image's), each proven by its digest, and writes their files under the image's
   model prefix into a new private directory: the root of the small files, as a mounted
   image's model directory has them, plus ``packer-stream.json`` naming the digest-pinned
   reference. No byte of the weights is written anywhere.
3. A weight file the manifest places in a layer blob (``blob`` + ``offset``) becomes a
   :class:`RemoteFile`: a read of any span is one or more HTTP ``Range`` requests for the
   chunks covering it (the build's chunk table, pinned by the loader's manifest), each chunk
   hashed as it arrives and refused by the one prover (:func:`~.proof.prove_chunk`), naming
   file, chunk, blob and rank, unless it is the table's. Edge chunks shared by two reads are
   kept (a few) and fetched once. The reader threads of the ring or the CPU copy run several
   requests at once; a bulk read is cut into requests of about :data:`REQUEST` bytes on the chunks'
   edges (:meth:`RemoteFile.spans`).

What is proven: the loader's embedded manifest pins the chunk table's sha256 and each weight
file's place; the table pins every chunk. So every byte a load uses is proven before it is
used, whatever the registry serves, and a byte nobody reads is never fetched (a
tensor-parallel rank fetches its share). A registry that answers a ``Range`` request with
the whole blob (a pull-through cache that does not hold it yet) is read once, in order, by the
blob's :class:`~.blob_reader.BlobReader`: only the spans the load reads are kept, each chunk
proven as above. ``PACKER_STREAM_WHOLE=1`` fetches whole blobs into memory instead, each proven
by its digest.

Standard library only (:mod:`.registry` for HTTP); torch is not imported here.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .blob_reader import BlobReader
from .chunks import FileChunks
from .env import STREAM_FILE, ArtifactMismatchError, printable
from .inflate import InflateError, OverCapError, gunzip, memory_budget
from .place import FilePlace
from .proof import hash_span, prove_chunk
from .registry import MAX_DOC, MAX_LAYERS, OciRef, Registry, RegistryError, parse_ref

MAX_SMALL_LAYER = 1 << 30  # a packer small layer (tokenizer, bundle, loader) compressed: far above any
MAX_SMALL_FILES = 2 << 30  # their files, decompressed
_TAR_LAYERS = ("application/vnd.oci.image.layer.v1.tar", "application/vnd.docker.image.rootfs.diff.tar")
_GZIP = ("application/vnd.oci.image.layer.v1.tar+gzip", "application/vnd.docker.image.rootfs.diff.tar.gzip")
_ZSTD = ("application/vnd.oci.image.layer.v1.tar+zstd",)
_EDGES = 8  # verified edge chunks kept per file for the neighbouring read (8 MiB at 1 MiB chunks)
# One Range request of a bulk read: Debian's docker-registry spends about 4 ms of CPU per request
# whatever its size, what it spends on 8.6 MiB of payload (benchmarks/RESULTS.md, issue 40)
REQUEST = 64 << 20


@dataclass
class StreamStats:
    """What a streamed load fetched: bytes off the network (resumed reads' bytes again), the
    bytes and chunks hashed (each chunk proven once per read that fetched it), and of answers
    that ignored ``Range`` (:mod:`.blob_reader`): the bytes read off them (``passed``) and those
    no read wanted (``unused``)."""

    fetched: int = 0
    hashed: int = 0
    chunks: int = 0
    passed: int = 0
    unused: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, fetched: int = 0, hashed: int = 0, chunks: int = 0) -> None:
        with self.lock:
            self.fetched, self.hashed, self.chunks = self.fetched + fetched, self.hashed + hashed, self.chunks + chunks

    def add_pass(self, passed: int, unused: int) -> None:
        with self.lock:
            self.passed, self.unused = self.passed + passed, self.unused + unused


class RemoteFile:
    """One weight file inside a registry blob; every read proven chunk by chunk.

    Args:
        image: the image (its registry and stats).
        place: the file's place (``blob`` and ``offset``), as the loader's manifest gives it.
        chunks: the file's chunk digests (the build's table).
        rank: the reader's name in messages (``"rank 1 of 2"``; "" for one process).

    Offsets given to :meth:`read_at` are in the blob (``place.offset`` + the file offset), as a
    local shard's reads are in its blob or file.
    """

    def __init__(self, image: RemoteImage, place: FilePlace, chunks: FileChunks, rank: str = "") -> None:
        self.image, self.place, self.chunks, self.rank = image, place, chunks, rank
        self.digest = place.blob_digest or ""
        self.label = f"{image.ref}: {place.rel}"
        self._edges: OrderedDict[int, bytes | threading.Event] = OrderedDict()
        self._lock = threading.Lock()

    def spans(self, at: int, n: int) -> list[tuple[int, int]]:
        """``[(start, length)]`` (starts relative to ``at``) cutting a bulk read of blob bytes
        ``[at, at + n)`` into requests of about :data:`REQUEST` bytes, each cut moved back to the
        start of the chunk it falls in (the table's chunk edges), so that no chunk is fetched by
        two of them."""
        fc, lo = self.chunks, at - self.place.offset
        step = max(REQUEST // fc.chunk, 1) * fc.chunk
        edges = (max(lo, fc.bounds(fc.holding(p))[0]) for p in range((lo // step + 1) * step, lo + n, step))
        cuts = [lo, *edges, lo + n]
        return [(a - lo, b - a) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]

    def read_at(self, view: memoryview, at: int) -> None:
        """Fill ``view`` with the file's bytes at blob offset ``at``, every covering chunk proven.

        Raises:
            ArtifactMismatchError: a chunk whose sha256 is not the table's, or a span outside
                the file; RegistryError: the registry cannot serve it.
        """
        fc, lo = self.chunks, at - self.place.offset
        hi = lo + len(view)
        if lo < 0 or hi > fc.size:
            raise ArtifactMismatchError(f"{self.label}: bytes [{lo}, {hi}) are outside its {fc.size} bytes")
        todo = fc.cover(lo, hi)
        first, last = todo.start, todo.stop
        if first == last:
            return
        # an edge chunk (part of it outside the read) is fetched once and kept for the neighbour
        # read, which waits for it rather than fetching it again; whole chunks land in ``view``
        if fc.bounds(first)[0] < lo:
            self._copy(first, self._edge(first), view, lo)
            first += 1
        if last > first and fc.bounds(last - 1)[1] > hi:
            self._copy(last - 1, self._edge(last - 1), view, lo)
            last -= 1
        if first < last:
            a, b = fc.bounds(first)[0], fc.bounds(last - 1)[1]
            dst = view[a - lo: b - lo]
            self.image.reader(self.digest).read(self.place.offset + a, dst)
            for i in range(first, last):
                c0, c1 = fc.bounds(i)
                self._prove(i, dst[c0 - a: c1 - a])

    def _edge(self, i: int) -> bytes:
        """Chunk ``i``, proven: kept from a read before, awaited from one in flight, or fetched."""
        for _ in range(2):
            with self._lock:
                got = self._edges.get(i)
                if isinstance(got, bytes):
                    self._edges.move_to_end(i)
                    return got
                if got is None:
                    self._edges[i] = mine = threading.Event()
                    break
            got.wait()  # another reader fetches it; if that failed, fetch it here
        else:
            mine = threading.Event()
        try:
            a, b = self.chunks.bounds(i)
            buf = bytearray(b - a)
            self.image.reader(self.digest).read(self.place.offset + a, memoryview(buf))
            self._prove(i, buf)
            data = bytes(buf)
            with self._lock:
                self._edges[i] = data
                kept = [k for k, v in self._edges.items() if isinstance(v, bytes)]
                for k in kept[: max(len(kept) - _EDGES, 0)]:
                    del self._edges[k]
            return data
        except BaseException:
            with self._lock:
                if self._edges.get(i) is mine:
                    del self._edges[i]
            raise
        finally:
            mine.set()

    def _copy(self, i: int, data: bytes | bytearray, view: memoryview, lo: int) -> None:
        a, b = self.chunks.bounds(i)
        s, e = max(a, lo), min(b, lo + len(view))
        view[s - lo: e - lo] = memoryview(data)[s - a: e - a]

    def _prove(self, i: int, data: memoryview | bytearray) -> None:
        got = hash_span(data, 0, len(data), self.label)
        self.image.stats.add(hashed=len(data), chunks=1)
        prove_chunk(self.label, self.chunks, i, got, rank=self.rank, source=f" from blob {self.digest[:19]}...",
                    why="the registry's copy is corrupt or not this build's")


class WholeBlob:
    """A weight file read from its whole blob, fetched once into memory and proven by its digest
    (``PACKER_STREAM_WHOLE=1``, for a registry that ignores ``Range``)."""

    def __init__(self, image: RemoteImage, place: FilePlace) -> None:
        self.image, self.place = image, place
        self.label = f"{image.ref}: {place.rel}"

    def read_at(self, view: memoryview, at: int) -> None:
        blob = self.image.whole(self.place.blob_digest or "")
        if at + len(view) > len(blob):
            raise ArtifactMismatchError(f"{self.label}: bytes up to {at + len(view)} are past its blob's end")
        view[:] = memoryview(blob)[at: at + len(view)]


def _remove_written(root: Path, made: bool) -> None:
    """Remove what was written into ``root`` (and ``root`` itself when ``made``); a cleanup error
    never replaces the error behind it."""
    import shutil

    with contextlib.suppress(OSError):
        if made:
            shutil.rmtree(root)
            return
        for entry in list(root.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()


class RemoteImage:
    """A packer image in a registry, pinned by digest: its layers and its small files.

    Made by :meth:`fetch`; ``ref`` is the digest-pinned reference (a tag resolved).
    """

    def __init__(self, ref: OciRef, registry: Registry, manifest: dict[str, Any], config: dict[str, Any]) -> None:
        self.ref, self.registry = ref, registry
        self.manifest, self.config = manifest, config
        self.layers: dict[str, tuple[int, str]] = {}  # digest -> (size, media type)
        for d in manifest.get("layers") or []:
            if isinstance(d, dict) and isinstance(d.get("digest"), str) and type(d.get("size")) is int:
                self.layers[d["digest"]] = (d["size"], str(d.get("mediaType", "")))
        annotations = manifest.get("annotations")
        self.prefix = str((annotations if isinstance(annotations, dict) else {}).get("dev.model-packer.prefix")
                          or "/models")
        self.stats = StreamStats()
        self.whole_blobs = registry.settings.stream_whole
        self._whole: dict[str, bytearray] = {}
        self._whole_lock = threading.Lock()
        self._readers: dict[str, BlobReader] = {}

    @classmethod
    def fetch(cls, text: str, registry: Registry | None = None) -> RemoteImage:
        """The image ``text`` (``oci://HOST/REPO@sha256:...`` or ``:TAG``) names: manifest and
        config fetched and proven; a tag's digest reported on stderr once.

        Raises:
            RegistryError: not a reference, not reachable, refused, or not a packer image.
        """
        ref = parse_ref(text)
        reg = registry or Registry(ref)
        data, digest = reg.manifest()
        if ref.digest is None:
            sys.stderr.write(f"packer: {ref} resolved to {digest}; pin it: oci://{ref.host}/{ref.repo}@{digest}\n")
        pinned = OciRef(ref.host, ref.repo, None, digest)
        reg.ref = pinned
        manifest = _json(data, f"{pinned}: the image manifest")
        layers = manifest.get("layers")
        if isinstance(layers, list) and len(layers) > MAX_LAYERS:
            raise RegistryError(f"{pinned}: the image manifest lists {len(layers)} layers, over the cap of "
                                f"{MAX_LAYERS} (no runnable image has more); refused before any is fetched")
        for d in layers if isinstance(layers, list) else []:  # a size of -2 would reach read(-1): unbounded
            size = d.get("size") if isinstance(d, dict) else None
            if type(size) is not int or size < 0:
                raise RegistryError(f"{pinned}: the image manifest has a layer descriptor whose size is "
                                    f"{printable(repr(size)[:40])}, not a count of bytes")
        desc = manifest.get("config")
        desc = desc if isinstance(desc, dict) else {}
        size, cdigest = desc.get("size"), desc.get("digest")
        if type(size) is not int or not 0 < size <= MAX_DOC or not isinstance(cdigest, str):
            raise RegistryError(f"{pinned}: the image manifest's config descriptor is malformed")
        config = _json(reg.blob(cdigest, size), f"{pinned}: the image config")
        return cls(pinned, reg, manifest, config)

    def stats_fetched(self, n: int) -> None:
        self.stats.add(fetched=n)

    def reader(self, digest: str) -> BlobReader:
        """The reader of layer blob ``digest`` (one per blob and load: by Range, or by one pass
        of a whole answer shared by every read of the blob)."""
        with self._whole_lock:
            if digest not in self._readers:
                self._readers[digest] = BlobReader(self.registry, digest, self.layers[digest][0], self.stats_fetched,
                                                   self.stats.add_pass)
            return self._readers[digest]

    def end_load(self) -> None:
        """A load is over: its blob readers are closed and forgotten, so the next load asks by
        Range first (a cache that has stored a blob meanwhile serves ranges)."""
        with self._whole_lock:
            readers, self._readers = list(self._readers.values()), {}
        for r in readers:
            r.close()

    def range_ignored(self) -> int:
        """Blobs whose registry answered a Range request with the whole blob (read in a pass)."""
        with self._whole_lock:
            return sum(1 for r in self._readers.values() if r.passes)

    def packer_layers(self) -> list[tuple[str, int, str]]:
        """``[(digest, size, media type)]`` of the layers packer wrote, in order: the layers
        whose history entries (the config's, pinned by the manifest) say ``packer: ADD``."""
        history = [h for h in self.config.get("history") or [] if isinstance(h, dict) and not h.get("empty_layer")]
        descs = [d for d in self.manifest.get("layers") or [] if isinstance(d, dict)]
        media = str((self.manifest.get("config") or {}).get("mediaType", ""))
        if media not in ("application/vnd.oci.image.config.v1+json", "application/vnd.docker.container.image.v1+json"):
            raise RegistryError(f"{self.ref}: not a runnable image (its config is {media[:80]!r}: the ModelPack "
                                "view?); stream the image's digest, the first one `packer push` prints")
        if len(history) != len(descs):
            raise RegistryError(f"{self.ref}: {len(descs)} layers but {len(history)} history entries; "
                                "not an image packer built")
        out = [(str(d.get("digest")), self.layers.get(str(d.get("digest")), (0, ""))[0], str(d.get("mediaType")))
               for d, h in zip(descs, history, strict=True) if str(h.get("created_by", "")).startswith("packer: ")]
        if not out:
            raise RegistryError(f"{self.ref}: no layer of the image is packer's; stream an image `packer build` made")
        return out

    def materialize(self, dest: str | Path | None = None) -> Path:
        """Write the image's small files (every packer layer but the weights') into ``dest``
        (an empty or new directory; default a new private one in the temp directory), with
        ``packer-stream.json`` naming this image; return it.

        Raises:
            RegistryError: a layer not proven by its digest, over its cap, malformed, a file in
                two layers (or a file in one and a folder in another), or the files cannot be
                written (what was written into ``dest`` is removed, and ``dest`` if made here).
        """
        from .bundle_reader import Bundle, BundleFormatError, write_members

        prefix = tuple(p for p in self.prefix.split("/") if p)
        members: dict[tuple[str, ...], tuple[memoryview, bool]] = {}
        total = 0
        budget = memory_budget()  # a container's limit: past it the kernel kills, nothing refuses
        for digest, size, media in self.packer_layers():
            if media in _TAR_LAYERS:
                continue  # a weight layer: streamed, never fetched whole
            if media not in _GZIP + _ZSTD:
                raise RegistryError(f"{self.ref}: layer {digest[:19]}... is {media!r}; packer's layers are tar, "
                                    "tar+gzip or tar+zstd")
            if size > MAX_SMALL_LAYER:
                raise RegistryError(f"{self.ref}: layer {digest[:19]}... of {size} bytes is over the cap of "
                                    f"{MAX_SMALL_LAYER} for a small layer (image.single_layer builds cannot stream)")
            cap = MAX_SMALL_FILES - total
            if budget is not None:  # what is held at once: the tars so far, this blob, its tar
                if total + size >= budget:
                    raise RegistryError(f"{self.ref}: layer {digest[:19]}... of {size} bytes (after {total} "
                                        f"bytes of small files) is over {budget} bytes, half this process's "
                                        "memory limit (its cgroup's)")
                cap = min(cap, budget - total - size)
            held = "" if cap == MAX_SMALL_FILES - total else (
                ": what half this process's memory limit (its cgroup's) leaves beside the layer and the files so far")
            raw = self.registry.blob(digest, size)
            self.stats.add(fetched=size)
            try:
                tar = _inflate(raw, media, cap)
                del raw  # the compressed copy: only one of the two is held from here on
                total += len(tar)
                layer = Bundle.from_tar(tar).subtree(prefix)
            except (BundleFormatError, InflateError) as e:
                why, kind = held if isinstance(e, OverCapError) else "", media.rpartition("+")[2]
                raise RegistryError(f"{self.ref}: layer {digest[:19]}... ({kind}): {e}{why}") from None
            twice = [p for p, (_, d) in layer.items() if p in members and not (d and members[p][1])]
            if twice:
                raise RegistryError(f"{self.ref}: {'/'.join(twice[0])} is in two layers")
            members.update(layer)
        files = {p for p, (_, is_dir) in members.items() if not is_dir}
        for p in members:  # a file of one layer that another's file would lie under
            if top := next((p[:i] for i in range(1, len(p)) if p[:i] in files), None):
                raise RegistryError(f"{self.ref}: {'/'.join(top)} is a file in one layer and a folder in another")
        made = dest is None or not Path(dest).exists()
        try:
            root = Path(dest) if dest is not None else Path(tempfile.mkdtemp(prefix="packer-stream-"))
            root.mkdir(mode=0o700, exist_ok=True)
            empty = made or not any(root.iterdir())
        except OSError as e:
            raise RegistryError(f"{self.ref}: cannot make a folder for its small files "
                                f"({printable(str(dest or tempfile.gettempdir()))}): "
                                f"{printable(e.strerror or str(e))}") from None
        members[(STREAM_FILE,)] = (memoryview(json.dumps({"ref": str(self.ref)}).encode() + b"\n"), False)
        try:
            write_members(root, members)
        except BaseException as e:
            if empty:  # nothing half-written: what was written goes, and the folder if made here
                _remove_written(root, made)
            if isinstance(e, OSError):
                raise RegistryError(f"{self.ref}: cannot write its small files into {root}: "
                                    f"{printable(e.strerror or str(e))}") from None
            raise
        return root

    def source(self, place: FilePlace, chunks: FileChunks | None, rank: str = "") -> RemoteFile | WholeBlob:
        """The reader of the weight file at ``place`` (a blob of this image).

        Raises:
            ArtifactMismatchError: the image holds no such blob, or it ends before the file;
                the build has no chunk digests of the file (and whole blobs were not asked for).
        """
        digest = place.blob_digest
        size = self.layers.get(digest or "", (None, ""))[0]
        if size is None:
            raise ArtifactMismatchError(f"{self.ref}: the manifest places {place.rel} in blob {digest}, which the "
                                        "image does not hold: the loader and the image are of different builds")
        if place.offset + place.size > size:
            raise ArtifactMismatchError(f"{self.ref}: blob {digest} is {size} bytes; {place.rel} ends at byte "
                                        f"{place.offset + place.size}")
        if self.whole_blobs:
            return WholeBlob(self, place)
        if chunks is None:
            raise ArtifactMismatchError(f"{self.ref}: the build has no chunk digests of {place.rel} (built before "
                                        "packer-chunks.json): pull the image and load it from disk, or set "
                                        "PACKER_STREAM_WHOLE=1 to fetch whole blobs")
        return RemoteFile(self, place, chunks, rank)

    def whole(self, digest: str) -> bytearray:
        """Blob ``digest`` fetched whole into memory, once, proven by its digest."""
        with self._whole_lock:
            if digest not in self._whole:
                sys.stderr.write(f"packer: {self.ref}: fetching blob {digest[:19]}... whole into memory "
                                 "(PACKER_STREAM_WHOLE=1)\n")
                self._whole[digest] = self.registry.read_whole(digest, self.layers[digest][0])
                self.stats.add(fetched=len(self._whole[digest]), hashed=len(self._whole[digest]))
            return self._whole[digest]


def stream_ref(root: Path) -> str | None:
    """The reference a streamed model directory's weights come from (its ``packer-stream.json``),
    or None for a directory that is not one.

    Raises:
        ArtifactMismatchError: the file is there but is not ``{"ref": "oci://..."}``.
    """
    path = root / STREAM_FILE
    if not path.is_file():
        return None
    from .reading import read_bytes

    doc = _json(read_bytes(path, "json"), str(path))
    ref = doc.get("ref")
    if not isinstance(ref, str):
        raise ArtifactMismatchError(f"{path}: no \"ref\" naming the image the weights stream from")
    return ref


def _json(data: bytes, where: str) -> dict[str, Any]:
    from .reading import loads_json

    doc = loads_json(data, where)
    if not isinstance(doc, dict):
        raise RegistryError(f"{where}: not a JSON object")
    return doc


def _inflate(data: bytes, media: str, cap: int) -> bytearray:
    """A compressed small layer's tar, at most ``cap`` bytes: one bounded path for gzip and zstd.

    Raises:
        InflateError, BundleFormatError: over the cap, out of memory, or malformed (one line).
    """
    if media in _GZIP:
        return gunzip(data, cap)
    from .bundle_reader import decompress

    return decompress(data, cap)
