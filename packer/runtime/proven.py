"""Mapped tensors proven chunk by chunk when their bytes are first used (a vLLM rank under TP).

vLLM's weight loaders take each whole tensor and narrow it to the rank's slice before copying
it into the rank's parameter; which bytes a rank uses is only known there. Under verification
(``verify=True``, ``PACKER_REQUIRE_SIGNATURE``) with the build's chunk table, the loader hands
out views of the private mapping (:func:`~.cpu.map_shards`) as :class:`Proven` tensors: a view
operation (``narrow``, ``view``, indexing that keeps the storage...) gives another, unproven;
any other operation (``copy_`` into a parameter, ``to``, arithmetic) first proves the chunks
covering the bytes its :class:`Proven` arguments span, hashing them from the mapping, each chunk
once per process (:class:`~.proof.SpanCheck` counts them), and refuses a changed one naming file,
chunk and rank. Metadata (``shape``, ``dtype``, ``stride``...) reads no data and proves nothing.

torch is imported only here, when such a load runs.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from .chunks import FileChunks
from .env import ArtifactMismatchError
from .proof import SpanCheck
from .reading import PositionalSource

if TYPE_CHECKING:
    from .shards import Shard

# operations whose result may share the input's storage: wrapped again, nothing read yet
VIEWS = frozenset({"narrow", "view", "select", "__getitem__", "t", "transpose", "permute", "chunk", "split",
                   "unflatten", "flatten", "squeeze", "unsqueeze", "as_strided", "expand", "detach", "view_as",
                   "contiguous", "reshape", "unbind", "split_with_sizes", "tensor_split", "movedim", "T"})
# what reads no data: answered without a proof
METADATA = frozenset({"shape", "dtype", "device", "size", "dim", "ndim", "numel", "element_size", "stride",
                      "storage_offset", "data_ptr", "is_contiguous", "untyped_storage", "__len__", "nbytes",
                      "itemsize", "is_floating_point", "is_complex", "requires_grad", "layout", "is_cuda",
                      "is_meta", "is_quantized", "is_sparse", "names", "__hash__", "grad", "_base", "is_leaf",
                      "__class__", "name", "output_nr", "_version", "data", "is_nested", "nelement",
                      "get_device", "__torch_function__", "__reduce_ex__"})


class _Mapped:
    """One shard's mapping: where it starts in memory, its file's chunks, which are proven.

    A shard proven as it is read (a registry's, :mod:`.view_registry`) has no mapping: its
    buffer starts empty and a chunk is fetched from its source, proven as it arrives, when first
    used. The buffer's *storage* is held weakly, so a mapping whose tensors are all gone is
    dropped: the tensors share the storage, not the buffer tensor object, which may be gone
    while they live (a weak reference to it left every chunk not fetched at load time zero).
    """

    def __init__(self, shard: Shard, buf: Any, chunks: FileChunks, check: SpanCheck) -> None:
        self.rel, self.label, self.start = shard.rel, shard.label, buf.data_ptr()
        self.chunks, self.check = chunks, check
        # a source that proves what it serves fills the buffer; a mapping is hashed here
        self.source: PositionalSource | None = cast(PositionalSource, shard.fd) if shard.proven_as_read else None
        self.base = shard.base
        self.buf: Callable[[], Any] = (lambda: buf) if self.source is None else _weak_buffer(buf)
        self.proven: set[int] = set()
        self.lock = threading.Lock()

    def prove(self, lo: int, hi: int) -> None:
        """Prove file bytes ``lo:hi``: each covering chunk not proven yet, hashed from the mapping
        (streamed: fetched, consecutive chunks in one read, proven by the source)."""
        with self.lock:
            todo = [i for i in self.chunks.cover(lo, hi) if i not in self.proven]
            buf = self.buf()
            if not todo or buf is None:
                return
            view = memoryview(buf.numpy())
            if self.source is None:
                for i in todo:
                    a, b = self.chunks.bounds(i)
                    self.check.check(self.rel, None, 0, a, view[a:b], self.label)  # the whole chunk: nothing read
            else:
                runs = [[todo[0], todo[0] + 1]]
                for i in todo[1:]:
                    if i == runs[-1][1]:
                        runs[-1][1] = i + 1
                    else:
                        runs.append([i, i + 1])
                for first, last in runs:
                    a, b = self.chunks.bounds(first)[0], self.chunks.bounds(last - 1)[1]
                    self.source.read_at(view[a:b], self.base + a)
            self.proven.update(todo)


def _weak_buffer(buf: Any) -> Callable[[], Any]:
    """A callable giving ``buf`` (a 1-D uint8 tensor) again while any tensor shares its storage,
    then None: the storage is weakly held, the tensor object itself may be long gone."""
    storage, like = weakref.ref(buf.untyped_storage()), buf.new_empty(0)

    def again() -> Any:
        st = storage()
        return None if st is None else like.new_empty(0).set_(st)
    return again


_MAPPINGS: dict[int, _Mapped] = {}  # untyped storage address -> its mapping


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a property of Tensor: its descriptor's name
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return str(name)


def _extent(t: Any) -> tuple[_Mapped, int, int] | None:
    """``(mapping, first file byte, end)`` that tensor ``t`` spans; None for none (empty, another storage)."""
    storage = t.untyped_storage()
    mapped = _MAPPINGS.get(storage.data_ptr())
    if mapped is None or t.numel() == 0:
        return None
    lo = t.data_ptr() - mapped.start
    span = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    return mapped, lo, lo + span * t.element_size()


def _prove_all(values: Any, cls: type) -> None:
    stack = [values]
    while stack:
        v = stack.pop()
        if isinstance(v, cls):
            got = _extent(v)
            if got is not None:
                got[0].prove(got[1], got[2])
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())


_CLASS: list[type] = []


def proven_class(torch: Any) -> type:
    """The :class:`Proven` tensor subclass (made once, torch being imported)."""
    if _CLASS:
        return _CLASS[0]

    class Proven(torch.Tensor):
        """A view of a mapped weight file whose bytes are proven when first used."""

        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            name = _name(func)
            if name in METADATA:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            if name not in VIEWS:
                _prove_all((args, kwargs), cls)
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return _rewrap(out, args, cls)

    def _rewrap(out: Any, args: Any, cls: type) -> Any:
        if isinstance(out, torch.Tensor):
            if out.untyped_storage().data_ptr() in _MAPPINGS:
                return out.as_subclass(cls)
            _prove_all(args, cls)  # a copy was made: its source proven before the copy is used
            return out
        if isinstance(out, (tuple, list)):
            return type(out)(_rewrap(o, args, cls) for o in out)
        return out

    _CLASS.append(Proven)
    return Proven


def prove_mapped(torch: Any, shards: list[Shard], bufs: list[tuple[Any, int]], tensors: dict[str, Any],
                 table: dict[str, FileChunks], check: SpanCheck) -> dict[str, Any]:
    """``tensors`` (views of the mappings ``bufs`` of ``shards``) as :class:`Proven` tensors.

    Each shard's header is proven now; a tensor that is not a view of its mapping (copied at
    load to be aligned) is proven now, whole. Aliases stay one object.

    Raises:
        ArtifactMismatchError: a header, or a copied tensor, whose chunks differ; a shard the
            table does not hold.
    """
    cls = proven_class(torch)
    out: dict[str, Any] = {}
    made: dict[int, Any] = {}
    for s, (buf, _) in zip(shards, bufs, strict=True):
        if s.rel not in table:
            raise ArtifactMismatchError(f"{s.rel}: the chunk table holds no digests of it")
        mapped = _Mapped(s, buf, table[s.rel], check)
        _MAPPINGS[buf.untyped_storage().data_ptr()] = mapped
        mapped.prove(0, len(s.head))
        for e in s.tensors:
            t = tensors[e.name]
            if t.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr() and e.end > e.begin:
                mapped.prove(len(s.head) + e.begin, len(s.head) + e.end)
    for name, t in tensors.items():
        if id(t) not in made:
            made[id(t)] = t.as_subclass(cls) if t.untyped_storage().data_ptr() in _MAPPINGS else t
        out[name] = made[id(t)]
    return out


def release() -> tuple[int, int]:
    """Forget every mapping (the tensors keep theirs alive as long as they live) and return
    ``(bytes hashed, chunks proven)`` since the last release: for the caller's report.

    A streamed mapping whose buffer lives is kept: its unfetched chunks still arrive, proven,
    when first used (after the release they would otherwise be zeros)."""
    checks = {id(m.check): m.check for m in _MAPPINGS.values() if m.source is None}
    for key, m in list(_MAPPINGS.items()):
        if m.source is None or m.buf() is None:
            del _MAPPINGS[key]
    return sum(c.hashed for c in checks.values()), sum(c.chunks for c in checks.values())
