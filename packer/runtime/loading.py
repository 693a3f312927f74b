"""The :class:`Loader`: a build's artifacts under a root, checked against its manifest.

Not ``loader.py``: that is the entry of the emitted ``packer_loader.py`` (its docstring,
public functions such as ``load_weights`` and ``load_into``, ``__all__`` and command line),
which drive a default :class:`Loader` made here.

The Loader plans and copies: where the bytes lie, how a span is read and how a chunk is
proven are its build's view's (:mod:`.view`, opened by :func:`~.view_open.open_view`: local
files or a registry image, one contract). It drives the CPU target (``cpu``), the staging ring
and its engines (``ring``, ``engines``), ``load_into`` (``assign`` matches the module's
tensors, ``into`` fills real ones) and the bundle reader, recording every stage on a
:class:`Timeline`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .assign import LoadResult, TensorSlot, assign_device, assign_tensors, copy_targets, match_slots, module_slots
from .bundle_cache import cache_root, cached
from .chunks import FileChunks, rank_name
from .cpu import map_shards, prefetch_files, read_shards
from .env import ArtifactMismatchError
from .place import FilePlace
from .proof import SpanCheck, running_sha256
from .served import check_extracted
from .settings import RuntimeSettings
from .shards import CPU_ALIGN, Shard, shard_tensors
from .timeline import TIMELINE, Timeline, import_torch
from .view import BuildView
from .view_local import LocalView

# The ring, its engines and the copy-into paths are imported where they are used: the stub
# compiles every runtime module from its checked source at each start (no bytecode is trusted),
# and a CPU load by mapping needs none of them.

if TYPE_CHECKING:
    from types import ModuleType

    import torch

    from .engines import CopyEngine
    from .layout import Layout
    from .ring import Chunk, RingStats, Segment


class Loader:
    """A build's artifacts, seen through ``view``, checked against ``manifest``; the loader's verbs.

    Args:
        manifest: the embedded manifest (files, weights tensor table, aliases, bundle); a
            component's loader has the component's weights section and its build's view.
        root: artifact root; weight files resolve under ``weights_dir`` when given (the view
            made when none is given: :class:`~.view_local.LocalView`).
        weights_dir: directory that holds the ``model*.safetensors`` files (mounted weights).
        timeline: where stage timings go (the process-wide one by default).
        view: the build's view (:func:`~.view_open.open_view`; a registry image's proves every
            chunk it serves, so ``verify`` costs nothing more).
        settings: the knobs (default: from the environment over ``manifest["runtime"]``);
            ``slots``, ``chunk`` and ``readers`` start from them and may be set per loader.
        With ``settings.require_signature`` every load checks sha256 (the signature pins
        digests; :func:`default_loader` checks the signature itself, for the whole build).
    """

    def __init__(self, manifest: dict[str, Any], root: str | Path, *,
                 weights_dir: str | Path | None = None,
                 timeline: Timeline | None = None, settings: RuntimeSettings | None = None,
                 view: BuildView | None = None) -> None:
        if view is None:
            view = LocalView(manifest, root, weights_dir)
        self.view = view if view.manifest is manifest else view.with_manifest(manifest)
        self.timeline = timeline or TIMELINE
        self.last_stats: RingStats | None = None
        self.last_copied: list[str] = []  # tensors the last load copied to aligned memory (CPU)
        self.auto_flush = True  # print the stage table after each verb (the self-test prints once)
        self.settings = settings or RuntimeSettings.from_sources(os.environ, manifest.get("runtime"))
        self.slots = self.settings.ring_slots
        self.chunk = self.settings.chunk_bytes
        self.readers = max(self.settings.readers, self.view.min_readers)  # a registry's: requests in flight
        self.make_engine: Callable[[torch.device], CopyEngine] = _make_engine  # tests slow the engine down
        self.component_loaders: dict[str, Loader] = {}  # by components.component_loader, made once
        self._checked_bundles: set[Path] = set()  # extracted bundles checked by this loader

    @property
    def manifest(self) -> dict[str, Any]:
        """The manifest this loader loads (its view's: a component's weights section, for one)."""
        return self.view.manifest

    @manifest.setter
    def manifest(self, manifest: dict[str, Any]) -> None:
        self.view = self.view.with_manifest(manifest)

    @property
    def root(self) -> Path:
        """The directory of the build's small files (the view's root)."""
        return self.view.root

    @property
    def weights_dir(self) -> Path | None:
        """Where the weight files are mounted, when not under the root."""
        return getattr(self.view, "weights_dir", None)

    def path(self, rel: str) -> Path:
        """Where the artifact ``rel`` (a manifest path) is on this machine (:meth:`.BuildView.path`)."""
        return self.view.path(rel)

    def locate(self, rel: str) -> tuple[Path, int]:
        """Where the artifact ``rel``'s bytes are: ``(file, offset)`` (:meth:`.BuildView.locate`)."""
        return self.view.locate(rel)

    def held(self, rel: str) -> FilePlace | None:
        """The place of ``rel`` when its bytes lie in a layer blob (:meth:`.BuildView.held`)."""
        return self.view.held(rel)

    def open_shards(self, verify: bool = False, *, random_access: bool = False) -> list[Shard]:
        """Open and check every weight file (size, header; the index file's sha256 when ``verify``);
        ``random_access``: readahead off (see ``open_shard``)."""
        w = self.manifest["weights"]
        shards: list[Shard] = []
        with self.timeline.stage("headers") as box:
            try:
                for rel in w["files"]:
                    shards.append(self.view.open_weight(rel, w["tensors"], random_access=random_access))
                    box["bytes"] += len(shards[-1].head)
                if w.get("index"):
                    self.check_file(w["index"], verify)
            except BaseException:
                for s in shards:
                    s.close()
                raise
        return shards

    def check_file(self, rel: str, verify: bool) -> None:
        """Check the plain artifact ``rel`` (:meth:`.BuildView.check_small`)."""
        self.view.check_small(rel, verify)

    def chunk_table(self) -> dict[str, FileChunks]:
        """The build's chunk table, read once (:meth:`.BuildView.chunk_table`)."""
        return self.view.chunk_table()

    def span_check(self, rank: str = "") -> SpanCheck | None:
        """A check of the chunk table, or None without one (:meth:`.BuildView.span_check`)."""
        return self.view.span_check(rank)

    def _verify_shards(self, shards: list[Shard]) -> None:
        """Every byte of ``shards`` proven (:meth:`.BuildView.verify_shards`)."""
        self.view.verify_shards(shards, self.readers, self.timeline)

    def load_weights(self, device: str = "cuda", *, dtype: torch.dtype | None = None, verify: bool = False,
                     pipeline: bool | None = None, copy: bool = False,
                     proven: bool = False) -> dict[str, torch.Tensor]:
        """Load every tensor; aliases of tied tensors are the same tensor object.

        Args:
            device: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``.
            dtype: cast floating-point tensors to this torch dtype (on the device).
            verify: also check every file's sha256 (a full read; always with
                ``PACKER_REQUIRE_SIGNATURE``).
            pipeline: use the staging ring (default: only for CUDA); on CPU this runs the
                CUDA scheduling against the CPU engine.
            copy: CPU only: private materialised tensors read with parallel preadv instead
                of views of a mapping.
            proven: CPU views of the mapping, verifying: with the build's chunk table each
                chunk is proven when its bytes are first used (:mod:`.proven`; a vLLM rank
                under tensor parallelism uses its slices only); without one, every file whole.

        Returns:
            ``{name: tensor}`` including the alias names, in file order (each shard's
            tensors by offset), the aliases last. Through the ring (CUDA, or
            ``pipeline=True``) every non-empty tensor starts at a 256-byte aligned address,
            as safetensors' own loader gives them. On CPU every tensor starts 64-byte aligned,
            as torch's allocator gives them (CPU kernels round differently below that): a view
            where the file offset is aligned (packer lays out every tensor whose size allows it
            so), a private copy where not (their names: ``last_copied``).

        Raises:
            ArtifactMismatchError: a file is missing, has another size, header or sha256.
        """
        torch = import_torch(self.timeline)
        dev = self._device(torch, device)
        verify = verify or bool(self.settings.require_signature)
        use_ring = dev.type != "cpu" if pipeline is None else pipeline
        before, started = self.view.fetched(), time.perf_counter()
        shards = self.open_shards(verify=verify)
        try:
            # a view whose sources prove every read proves on use for free: no verify needed
            check = self._proof_on_use((verify or self.view.proves_reads) and proven and dtype is None
                                       and not copy and not use_ring)
            if dev.type == "cpu" and check is not None:
                out = self._proven(torch, shards, check)
            elif dev.type == "cpu" and not use_ring:
                if verify:
                    self._verify_shards(shards)
                bufs = (read_shards(torch, shards, self.readers, self.timeline, hugepages=self.settings.hugepages)
                        if copy or any(s.proven_as_read for s in shards) else map_shards(torch, shards, self.timeline))
                out = self._tensors(torch, shards, bufs, dtype)
            else:
                out = self._ringed(torch, dev, shards, verify, dtype)
        finally:
            for s in shards:
                s.close()
        self.view.fetch_line(self.timeline, before, started)
        if self.auto_flush:
            self.timeline.flush()
        return out

    def _proof_on_use(self, wanted: bool) -> SpanCheck | None:
        """The check of a load whose chunks are proven on use, if ``wanted`` and the build has a table."""
        if not wanted:
            return None
        return self.span_check(rank_name())

    def _proven(self, torch: ModuleType, shards: list[Shard], check: SpanCheck) -> dict[str, torch.Tensor]:
        from .proven import prove_mapped

        bufs = self.view.proof_buffers(torch, shards, self.timeline)
        return prove_mapped(torch, shards, bufs, self._tensors(torch, shards, bufs, None), self.chunk_table(), check)

    def _device(self, torch: ModuleType, device: str) -> torch.device:
        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"packer_loader: device {device!r}: only 'cpu', 'cuda' and 'cuda:N'")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"packer_loader: device {device!r} asked for but CUDA is not available "
                               "(torch.cuda.is_available() is False); use device='cpu'")
        if dev.type == "cuda" and not _has_context(torch, dev):
            with self.timeline.stage("CUDA init"):  # driver, context, allocator: paid once
                torch.cuda.init()
                torch.empty(1, device=dev)  # a real allocation: the device's context exists now
        return dev

    def _ringed(self, torch: ModuleType, dev: torch.device, shards: list[Shard], verify: bool,
                dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """Through the ring into one device buffer per shard, every tensor ``ALIGN``-aligned;
        with ``verify`` the hash thread checks each file as its chunks pass, in file order."""
        from .layout import plan_layout
        from .ring import plan_chunks, ring_chunk

        engine = self.make_engine(dev)
        layouts = [plan_layout(s.tensors, s.data_size) for s in shards]
        with self.timeline.stage("device alloc", sum(x.nbytes for x in layouts)):
            bufs = [engine.device_buffer(x.nbytes) for x in layouts]
        segs = _segments(shards, layouts, bufs)
        hashers = ({i: running_sha256(s.head) for i, s in enumerate(shards)}
                   if verify and not any(s.proven_as_read for s in shards) else None)
        self._run_ring(shards, plan_chunks(segs, ring_chunk(self.chunk)), engine, hashers)
        if hashers is not None:
            for i, s in enumerate(shards):
                s.check_sha256(hashers[i].hexdigest(), self.manifest["files"][s.rel]["sha256"])
        return self._tensors(torch, shards, [(b, 0) for b in bufs], dtype, offsets=[x.offsets for x in layouts])

    def _run_ring(self, shards: list[Shard], chunks: list[Chunk], engine: CopyEngine,
                  hashers: dict[int, Any] | None) -> None:
        from .ring import ring_chunk, run_ring

        self.last_stats = run_ring(shards, chunks, engine, slots=self.slots, chunk=ring_chunk(self.chunk),
                                   readers=self.readers, hashers=hashers, timeline=self.timeline)

    def _tensors(self, torch: ModuleType, shards: list[Shard], bufs: list[tuple[torch.Tensor, int]],
                 dtype: torch.dtype | None, *, offsets: list[dict[str, int]] | None = None) -> dict[str, torch.Tensor]:
        """The tensors out of ``bufs``; the ones copied to be aligned are ``last_copied`` and,
        when there are any, an ``aligned copies`` stage (their bytes and count)."""
        self.last_copied = []
        start = time.perf_counter()
        out = shard_tensors(torch, shards, bufs, dtype, self.manifest["weights"].get("aliases", {}),
                            offsets=offsets, copied=self.last_copied)
        if self.last_copied:
            nbytes = sum(out[n].numel() * out[n].element_size() for n in self.last_copied)
            self.timeline.add("aligned copies", start, time.perf_counter(), nbytes,
                              tensors=len(self.last_copied))
        return out

    def load_into(self, module: torch.nn.Module, *, device: str | None = None, strict: bool = True,
                  verify: bool = False, pipeline: bool | None = None,
                  key: Callable[[str], str] | None = None) -> LoadResult:
        """Load the weights into ``module``: parameters on ``meta`` are assigned, real ones filled.

        Build the module under :func:`init_empty` so its parameters are on ``meta``: each is
        then replaced by the loaded tensor itself (CPU: a view of the private mapping; CUDA: a
        view of the shard's device allocation), tied names stay one tensor, and real buffers
        move to ``device``. Parameters already allocated are filled by copy, as
        ``load_state_dict`` does. A key naming a non-persistent buffer is loaded into it when
        shape and dtype match, else skipped (a note either way); the module's
        ``_keys_to_ignore_on_load_missing`` / ``_unexpected`` patterns are honoured.

        Args:
            module: a ``torch.nn.Module``.
            device: where the weights go (default: where the module's real parameters are,
                else cpu); must match real parameters.
            strict: raise when keys are missing or unexpected (as ``load_state_dict``).
            verify: also check every file's sha256.
            pipeline: force (or refuse) the staging ring; CUDA always uses it.
            key: module name -> the stored name it loads from (transformers' base-model
                prefix, see ``hf_keys``); by default the names are the same.

        Returns:
            ``(missing, unexpected)`` key lists, with ``.notes`` (ties, casts, buffers).

        Raises:
            ArtifactMismatchError: artifacts that do not match; RuntimeError: key or shape
            mismatch between the weights and the module, or a module spread over devices.
        """
        verify = verify or bool(self.settings.require_signature)
        torch = import_torch(self.timeline)
        w = self.manifest["weights"]
        slots = module_slots(module)
        missing, unexpected, notes = match_slots(module, slots, w["tensors"], w.get("aliases", {}), key)
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_into: missing keys {missing[:8]}, unexpected keys "
                               f"{unexpected[:8]} (pass strict=False to load the rest)")
        if any(s.key and s.tensor.device.type == "meta" for s in slots):
            self._assign(torch, slots, device, verify, pipeline, notes)
        else:
            self._fill(torch, copy_targets(slots), device, verify, pipeline)
        if self.auto_flush:
            self.timeline.flush()
        return LoadResult(missing, unexpected, notes)

    def _fill(self, torch: ModuleType, targets: dict[str, list[torch.Tensor]], device: str | None,
              verify: bool, pipeline: bool | None) -> None:
        """Copy into a module whose tensors are all real (as ``load_state_dict`` does)."""
        from .into import into_cpu, target_device

        dev = target_device(torch, targets, device)
        shards = self.open_shards(verify=verify)
        try:
            if verify:
                self._verify_shards(shards)
            with torch.no_grad():
                if dev.type == "cpu" and not pipeline:
                    into_cpu(torch, shards, targets, self.readers, self.timeline)
                else:
                    self._into_ring(torch, dev, shards, targets)
        finally:
            for s in shards:
                s.close()

    def _assign(self, torch: ModuleType, slots: list[TensorSlot], device: str | None, verify: bool,
                pipeline: bool | None, notes: list[str]) -> None:
        """Load the weights, then make them the module's meta tensors (and fill its real ones)."""
        dev = assign_device(torch, slots, device)
        auto, self.auto_flush = self.auto_flush, False
        try:
            tensors = self.load_weights(str(dev), verify=verify, pipeline=pipeline)
        finally:
            self.auto_flush = auto
        if self.last_copied:
            notes.append(f"{len(self.last_copied)} tensors copied to {CPU_ALIGN}-byte aligned memory "
                         f"(their file offsets are not aligned): {self.last_copied[:8]}")
        assign_tensors(torch, slots, tensors, dev, self.timeline, notes)

    def _into_ring(self, torch: ModuleType, dev: torch.device, shards: list[Shard],
                   targets: dict[str, list[torch.Tensor]]) -> None:
        """Stream straight into the parameters; a staging tensor only where dtypes differ."""
        from .into import finish_into, plan_into
        from .ring import plan_chunks, ring_chunk

        engine = self.make_engine(dev)
        segs, later = plan_into(torch, engine, shards, targets)
        self._run_ring(shards, plan_chunks(segs, ring_chunk(self.chunk)), engine, None)
        finish_into(torch, later)

    def bundle_dir(self) -> Path:
        """Extract the bundle once (content-addressed cache) and return its directory.

        The cache's folder is checked at the first call of each loader: exactly the manifest's
        members as regular files of their sizes (and sha256 with ``PACKER_REQUIRE_SIGNATURE``),
        so a shared cache whose ``config.json`` was changed after extraction is refused.

        Raises:
            ArtifactMismatchError: no bundle in this build, it does not match, or the cache's
                folder holds other files than the bundle's.
        """
        b = self.manifest.get("bundle")
        if not b:
            raise ArtifactMismatchError("this build has no bundle (no tokenizer/config files)")
        rel = b["file"]
        self.check_file(rel, verify=False)
        with self.timeline.stage("bundle", b["size"]):
            try:
                hit = cached(cache_root(self.settings.bundle_cache or None), b["sha256"])
                out = hit or self._extract(rel)  # a hit needs neither the reader nor zstandard
            except OSError as e:
                raise ArtifactMismatchError(f"{rel}: {e}") from None
            if Path(out) not in self._checked_bundles and "members" in b:  # a reused folder is input too
                check_extracted(Path(out), b["members"], hashes=bool(self.settings.require_signature))
                self._checked_bundles.add(Path(out))
        if self.auto_flush:
            self.timeline.flush()
        return Path(out)

    def _extract(self, rel: str) -> Path:
        """Extract the bundle ``rel`` into the cache (a miss)."""
        from . import bundle_reader as reader

        try:
            return reader.extract_cached(self.path(rel), self.settings.bundle_cache or None,
                                         expected_sha256=self.manifest["bundle"]["sha256"])
        except reader.BundleFormatError as e:
            raise ArtifactMismatchError(f"{rel}: {e}") from None

    def prefetch(self, *, background: bool = True) -> threading.Thread | None:
        """Warm the page cache with the weight files (fadvise WILLNEED, then parallel reads).

        Returns:
            the background thread (``join()`` it to wait), or None when run in the foreground.
        """
        paths = [self.path(rel) for rel in self.manifest["weights"]["files"]]
        if not background:
            prefetch_files(paths, self.readers, self.timeline)
            return None
        t = threading.Thread(target=prefetch_files, args=(paths, self.readers, self.timeline),
                             name="packer-prefetch", daemon=True)
        t.start()
        return t

    def report(self, trace: str | Path | None = None) -> list[dict[str, Any]]:
        """The stage timings so far; with ``trace``, also a Chrome trace-event JSON file."""
        if trace is not None:
            self.timeline.chrome_trace(trace)
        return [dict(s) for s in self.timeline.stages]


def _make_engine(dev: torch.device) -> CopyEngine:
    """The copy engine of ``dev`` (``engines.make_engine``)."""
    from .engines import make_engine

    return make_engine(dev)


def _has_context(torch: ModuleType, dev: torch.device) -> bool:
    """Whether CUDA is initialised and ``dev`` has its primary context already."""
    if not torch.cuda.is_initialized():
        return False
    has = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return bool(has(index)) if has is not None else True


def _segments(shards: list[Shard], layouts: list[Layout], bufs: list[torch.Tensor]) -> list[Segment]:
    """The ring's segments into the shards' device buffers, in file order."""
    from .ring import Segment

    return [Segment(i, s.data_start + at, n, buf[dst: dst + n])
            for i, (s, lay, buf) in enumerate(zip(shards, layouts, bufs, strict=True))
            for at, dst, n in lay.segments]
