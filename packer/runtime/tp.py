"""Tensor parallel loading: each rank of a process group reads the bytes of its own slices only.

``from_pretrained(model_class, tp_plan="auto")`` in a ``torch.distributed`` process group (gloo
on CPU, NCCL on GPU) builds the model as transformers' tensor-parallel plan shards it (the
plan's DTensor parameters and forward hooks are transformers' own, so the forward is exactly
its ``from_pretrained(tp_plan="auto")``) and fills every parameter with this rank's local part:

* ``Shard(0)`` (``colwise``, ``embedding_rowwise``, ``lm_head``): the rank's rows are contiguous
  in the file, read with one ``preadv``;
* ``Shard(-1)`` of a matrix (``rowwise``: ``o_proj``, ``down_proj``): the rank's columns are one
  row piece per row, often under a page, so reading them from the file reads other ranks'
  bytes too. Instead each rank reads a contiguous 1/N of the rows and one ``all_to_all`` gives
  every rank its columns: the disk sees each byte once, the process group carries
  (N-1)/N² of each such matrix per rank. No layout of its own on disk: any degree, the plain
  model directory unchanged;
* replicated tensors (norms, a rowwise bias, anything outside the plan): read whole;
* any other placement (strided or packed shards, 3-D expert weights): the whole tensor read and
  sliced by transformers' own rule (correct, but not fewer bytes).

Weight files are opened with ``POSIX_FADV_RANDOM`` before their header is read: no readahead,
a read brings in its own pages only.
``verify=True`` (and ``PACKER_REQUIRE_SIGNATURE``) checks, with the build's chunk table, only the
chunks covering what this rank reads (each header, its spans, the replicated tensors). A
build's table cuts its chunks where the ranks split (:data:`~.chunks.TP_DEGREES`, by the
:func:`~.chunks.split` this module splits with), so at those degrees a span is whole chunks and a
rank hashes its share; elsewhere (an older table, another degree) the rest of a span's edge
chunks is read for the hash. A changed byte is
refused by the rank whose span holds it (:func:`~.proof.prove_chunk` names file, chunk and
rank); the ``verify chunks`` stage reports the bytes hashed. A build without a table (older
manifests) hashes every file whole, so every rank reads everything.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NamedTuple

from .assign import module_slots
from .chunks import rank_name, split
from .env import torch_dtype
from .hf import hf_construct, hf_finish
from .hf_convert import REFUSE, conversion_table
from .proof import SpanCheck
from .reading import read_at
from .shards import Shard, TensorEntry
from .timeline import import_torch

if TYPE_CHECKING:
    from .loading import Loader


class Stored(NamedTuple):
    """Where one stored tensor is: its shard and its entry; ``check`` verifies what is read of it."""

    shard: Shard
    entry: TensorEntry
    check: SpanCheck | None = None


def _span_check(loader: Loader, shards: list[Shard]) -> SpanCheck | None:
    """The check of this rank's reads, each header checked now; None without a chunk table,
    which verifies every file whole (the one way an older build can be proven)."""
    if loader.view.proves_reads:
        return None  # its sources prove each chunk as it arrives (a registry's: :class:`~.remote.RemoteFile`)
    check = loader.span_check(rank_name())
    whole = [s for s in shards if check is None or not check.covers(s.rel)]
    if whole:
        loader._verify_shards(whole)
    if check is None:
        return None
    for s in shards:  # the header this rank parsed, as it was read
        check.check(s.rel, s.fd, s.base, 0, s.head, s.label)
    return check


def tp_from_pretrained(loader: Loader, model_class: Any, *, device: str, dtype: Any, verify: bool,
                       tp_plan: Any) -> Any:
    """:func:`from_pretrained` under tensor parallelism; see the module docstring.

    Args:
        loader: the :class:`Loader` of the build.
        model_class: a transformers model class or ``AutoModel*`` with a tensor-parallel plan.
        device: this rank's device (``"cpu"``, ``"cuda:N"``).
        dtype: parameter dtype (None: the config's, else the weights').
        verify: also check what this rank reads against the chunk table (every file whole
            without one).
        tp_plan: ``"auto"`` (the model's plan) or a dict overriding rules, as transformers takes it.

    Returns:
        the model in ``eval()`` mode, its parameters DTensors holding this rank's slices.

    Raises:
        RuntimeError: no process group, or parameters the weights do not fill.
    """
    torch = import_torch(loader.timeline)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("from_pretrained(tp_plan=...): torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group (gloo on CPU, nccl on GPU) in every rank "
                           "first, e.g. under torchrun")
    from transformers import PreTrainedModel
    from transformers.distributed import DistributedConfig

    config, _, mesh = PreTrainedModel.prepare_distribute_model(
        DistributedConfig(tp_plan=tp_plan, tp_size=dist.get_world_size()))
    from transformers import initialization

    with initialization.no_tie_weights():  # as transformers builds it: the plan names both ends of a tie
        model, bundle = hf_construct(loader, model_class, dtype)
    w = loader.manifest["weights"]
    if conversion_table(model, [*w["tensors"], *w.get("aliases", {})]) is not None:  # each rank reads its slices
        raise RuntimeError(REFUSE.format(name=type(model).__name__, why="under tp_plan, a checkpoint whose names "
                                         "transformers converts on load (legacy names, per-expert MoE weights)"))
    model = type(model).maybe_distribute_model(model, config, mesh)
    with torch.no_grad():
        load_tp(loader, model, torch.device(device), verify)
    if loader.auto_flush:
        loader.timeline.flush()
    model.tie_weights()  # the ties the load left to the model (both ends are in the plan)
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise RuntimeError(f"from_pretrained(tp_plan=...): {len(left)} parameter(s) not in the weights: {left[:8]}")
    return hf_finish(model, bundle)


def load_tp(loader: Loader, model: Any, dev: Any, verify: bool) -> None:
    """Fill ``model``'s meta parameters (DTensors or plain) with this rank's slices.

    Every rank walks the parameters in the same order: the exchanges are collectives.
    """
    torch = import_torch(loader.timeline)
    w = loader.manifest["weights"]
    aliases = w.get("aliases", {})
    before, started = loader.view.fetched(), time.perf_counter()
    shards = loader.open_shards(verify=verify, random_access=True)
    try:
        check = _span_check(loader, shards) if verify else None
        where = {e.name: Stored(s, e, check) for s in shards for e in s.tensors}
        done: set[str] = set()
        stats = {"read": 0, "sent": 0}
        with loader.timeline.stage("tensor parallel read") as box:
            for slot in module_slots(model):
                if slot.kind == "transient" or slot.tensor.device.type != "meta":
                    if slot.tensor.device.type not in ("meta", dev.type):
                        _put(torch, slot, slot.tensor.to(dev))
                    continue
                hit = next((n for n in slot.names if n in where or n in aliases), None)
                key = aliases.get(hit, hit) if hit else None
                if key is None or (key in done and hit in aliases):
                    continue  # a tie the model restores in tie_weights(); else hf_finish names it
                _put(torch, slot, local_part(torch, where[key], slot.tensor, dev, stats))
                done.add(key)
            box["bytes"] = stats["read"]
        now = time.perf_counter()  # counts, not spans: they ran inside the read
        if stats["sent"]:
            loader.timeline.add("tensor parallel exchange (sent)", now, now, stats["sent"])
        if check is not None:
            loader.timeline.add("verify chunks", now, now, check.hashed, chunks=check.chunks)
    finally:
        for s in shards:
            s.close()
    loader.view.fetch_line(loader.timeline, before, started)


def _put(torch: Any, slot: Any, value: Any) -> None:
    """Make every owner of ``slot`` hold ``value``, a Parameter where the slot is one."""
    if slot.kind == "param":
        value = torch.nn.Parameter(value, requires_grad=slot.tensor.requires_grad and value.is_floating_point())
        value._is_hf_initialized = True  # transformers' mark: not to be re-initialised
    for mod, name in slot.owners:
        (mod._parameters if slot.kind == "param" else mod._buffers)[name] = value
    slot.tensor = value


def local_part(torch: Any, stored: Stored, ref: Any, dev: Any, stats: dict[str, int]) -> Any:
    """This rank's part of ``stored`` shaped as the meta parameter ``ref`` wants it."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard as Rows

    e = stored.entry
    placements: tuple[Any, ...] = tuple(ref.placements) if isinstance(ref, DTensor) else ()
    dims = [p.dim % len(e.shape) for p in placements if p.is_shard()] if e.shape else []
    # exactly Shard (not a strided or packed subclass) or Replicate, on a one-dimensional mesh
    plain = all(type(p) is Rows or p.is_replicate() for p in placements) and len(placements) <= 1
    if not dims or not plain:
        local = read_rows(torch, stored, 0, e.shape[0] if e.shape else 0, stats)
        if dims or not plain:  # anything else: transformers' own slicing of the whole tensor
            from transformers.distributed.sharding_utils import DtensorShardOperation

            local = DtensorShardOperation(ref).shard_tensor(local)
    else:
        mesh = ref.device_mesh
        group, rank, world = mesh.get_group(), mesh.get_local_rank(), mesh.size()
        if dims[0] == 0:
            n, at = split(e.shape[0], world, rank)
            local = read_rows(torch, stored, at, at + n, stats)
        elif len(e.shape) == 2:
            local = exchange_columns(torch, stored, group, rank, world, dev, stats)
        else:
            raise RuntimeError(f"tensor parallel: {e.name}: sharding dim {dims[0]} of a "
                               f"{len(e.shape)}-d tensor is not supported")
    local = local.to(device=dev, dtype=ref.dtype)
    if isinstance(ref, DTensor):
        return DTensor.from_local(local.contiguous(), ref.device_mesh, ref.placements, run_check=False,
                                  shape=ref.shape, stride=tuple(ref.stride()))
    return local


def read_rows(torch: Any, stored: Stored, first: int, last: int, stats: dict[str, int]) -> Any:
    """Rows ``first:last`` of a stored tensor, read with ``preadv`` into a private CPU tensor."""
    s, e, check = stored
    dt = torch_dtype(e.code, e.name)[0]
    if not e.shape:
        first, last, rows, row = 0, 1, 1, e.end - e.begin
    else:
        rows = e.shape[0]
        row = (e.end - e.begin) // rows if rows else 0
    buf = torch.empty((last - first) * row, dtype=torch.uint8)
    at, view = s.data_start + e.begin + first * row, memoryview(buf.numpy())
    read_at(s.fd, view, at, s.label)
    stats["read"] += len(view)
    if check is not None and check.covers(s.rel):
        check.check(s.rel, s.fd, s.base, at - s.base, view, s.label)
    return buf.view(dt).view((last - first, *e.shape[1:]) if e.shape else ())


def exchange_columns(torch: Any, stored: Stored, group: Any, rank: int, world: int, dev: Any,
                     stats: dict[str, int]) -> Any:
    """This rank's columns of a stored matrix: each rank reads 1/N of the rows, then ``all_to_all``."""
    import torch.distributed as dist

    rows, cols = stored.entry.shape
    n, at = split(rows, world, rank)
    mine = read_rows(torch, stored, at, at + n, stats)
    col = [split(cols, world, j) for j in range(world)]
    send = torch.cat([mine[:, o: o + k].contiguous().view(-1).view(torch.uint8) for k, o in col])
    size = mine.element_size()
    recv = torch.empty(rows * col[rank][0] * size, dtype=torch.uint8)
    if dev.type != "cpu":  # NCCL moves device tensors
        send, recv = send.to(dev), recv.to(dev)
    dist.all_to_all_single(recv, send, [split(rows, world, i)[0] * col[rank][0] * size for i in range(world)],
                           [n * k * size for k, _ in col], group=group)
    stats["sent"] += send.numel() - n * col[rank][0] * size
    return recv.view(mine.dtype).view(rows, col[rank][0])
