"""``load_into``: the module's own parameters and buffers as the destinations of the load.

Stored tensors map to the module's tensors (tied aliases folded onto one stored name); bytes
go straight into a destination whose dtype and layout match, through a mapped view or a
staging tensor on the device where they do not. Nothing crosses to the host twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from .cpu import map_shards, read_into
from .engines import CopyEngine, host_view
from .env import torch_dtype
from .ring import Read, Segment
from .shards import Shard, shard_tensors, tensor_view
from .timeline import Timeline

if TYPE_CHECKING:
    from types import ModuleType

    import torch
    from torch import Tensor


class Later(NamedTuple):
    """A copy :func:`finish_into` makes once the ring is done: a tie, or a staged cast."""

    targets: list[torch.Tensor]  # the module's tensors to fill
    source: torch.Tensor  # the loaded tensor (a tie), or the raw staging bytes (a cast)
    code: str  # "" for a tie; else the stored dtype code of the staged bytes
    shape: list[int]  # the stored shape (casts only)
    name: str  # the stored tensor's name


def target_device(torch: ModuleType, targets: dict[str, list[torch.Tensor]], device: str | None) -> torch.device:
    """The one device the module's tensors live on (``device`` or cpu when it has none).

    Raises:
        RuntimeError: the module spans devices, lives on another kind, or not on ``device``.
    """
    devices = {t.device for ts in targets.values() for t in ts}
    if len(devices) > 1:
        raise RuntimeError(f"load_into: the module spans devices {sorted(map(str, devices))}")
    dev = devices.pop() if devices else torch.device(device or "cpu")
    if dev.type not in ("cpu", "cuda"):
        raise RuntimeError(f"load_into: the module's tensors are on {dev}; allocate them on "
                           "cpu or cuda, or build it under init_empty()")
    if device is not None and torch.device(device).type != dev.type:
        raise RuntimeError(f"load_into: the module lives on {dev}, not {device}; move it first")
    return dev


def into_cpu(torch: ModuleType, shards: list[Shard], targets: dict[str, list[torch.Tensor]], readers: int,
             timeline: Timeline) -> None:
    """preadv straight into the parameters; a mapped view only where dtypes differ."""
    reads: list[Read] = []
    rest: list[tuple[Tensor, Tensor | str]] = []
    with timeline.stage("read into module") as box:
        for s in shards:
            for name, code, _, begin, end in s.tensors:
                ts = targets.get(name, [])
                if ts and ts[0].dtype == torch_dtype(code, name)[0] and ts[0].is_contiguous():
                    reads.append(Read(s.fd, s.data_start + begin, host_view(ts[0].detach()), s.label))
                    box["bytes"] += end - begin
                    rest += [(t, ts[0]) for t in ts[1:] if t.data_ptr() != ts[0].data_ptr()]
                elif ts:
                    rest += [(t, name) for t in ts]
        read_into(reads, readers)
        views = shard_tensors(torch, shards, map_shards(torch, shards, timeline), None, {}) if rest else {}
        for t, src in rest:  # ties and dtype casts, from memory already read or mapped
            t.copy_(views[src] if isinstance(src, str) else src)


def plan_into(torch: ModuleType, engine: CopyEngine, shards: list[Shard],
              targets: dict[str, list[torch.Tensor]]) -> tuple[list[Segment], list[Later]]:
    """Ring segments straight into the parameters (a staging tensor where dtypes differ).

    Returns:
        ``(segments for plan_chunks, copies to make once the ring is done)``.
    """
    segs: list[Segment] = []
    later: list[Later] = []
    for i, s in enumerate(shards):
        for name, code, shape, begin, end in s.tensors:
            ts = targets.get(name)
            if not ts or end == begin:
                continue
            first = ts[0].detach()
            if first.dtype == torch_dtype(code, name)[0] and first.is_contiguous():
                segs.append(Segment(i, s.data_start + begin, end - begin, first.view(-1).view(torch.uint8)))
                rest = [t for t in ts[1:] if t.data_ptr() != first.data_ptr()]
                if rest:
                    later.append(Later(rest, first, "", [], name))
            else:
                tmp = engine.device_buffer(end - begin)
                segs.append(Segment(i, s.data_start + begin, end - begin, tmp))
                later.append(Later(ts, tmp, code, shape, name))
    return segs, later


def finish_into(torch: ModuleType, later: list[Later]) -> None:
    """The ties and dtype casts :func:`plan_into` left, copied on the device."""
    for ts, src, code, shape, name in later:
        if code:
            src = tensor_view(torch, src, 0, src.numel(), code, shape, name)
        for t in ts:
            t.copy_(src)  # device-side cast or tie: never through the host again
