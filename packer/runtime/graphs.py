"""Warm-up with real input shapes and the CUDA graph pool (correctness before speed).

:func:`warmup` runs each example a few times (cuDNN autotune) and, on request, captures one
CUDA graph per input shape; the returned :class:`GraphPool` replays a graph when the shapes
match a captured one and runs the model eagerly for any other.

Capture is careful: a model that synchronises with the host (``.item()``, data-dependent
shapes) is found first by one run in CUDA's sync-debug "error" mode and stays eager; capture
runs on the inputs' device with the thread-local error mode (a load on another thread cannot
invalidate it); a capture that fails anyway restores the caller's stream and the allocator,
and no further shape is captured. Replayed outputs are cloned with their structure intact
(``ModelOutput``, named tuples, non-tensor leaves).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .timeline import TIMELINE, Timeline, import_torch

if TYPE_CHECKING:
    from types import ModuleType

    import torch
    from torch import Tensor

Signature = tuple[tuple[Any, ...], ...]  # a call's shapes, dtypes, devices and constants


class Captured:
    """One captured shape: static inputs to fill, ``replay`` to run, static outputs to read."""

    def __init__(self, replay: Callable[[], None], inputs: list[torch.Tensor], output: object) -> None:
        self.replay, self.inputs, self.output = replay, inputs, output


def _split(args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[list[torch.Tensor], Signature]:
    """Tensors in call order and a hashable signature (shapes, dtypes, devices, constants)."""
    torch = import_torch()
    tensors: list[Tensor] = []
    sig: list[tuple[Any, ...]] = []
    for key, v in [*enumerate(args), *sorted(kwargs.items())]:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            sig.append((key, "T", tuple(v.shape), str(v.dtype), str(v.device)))
        else:
            sig.append((key, "V", type(v).__name__, v if v.__hash__ is not None else id(v)))
    return tensors, tuple(sig)


def _rebuild(args: tuple[object, ...], kwargs: dict[str, object],
             tensors: list[torch.Tensor]) -> tuple[tuple[object, ...], dict[str, object]]:
    torch = import_torch()
    it = iter(tensors)
    new_args = tuple(next(it) if isinstance(v, torch.Tensor) else v for v in args)
    new_kwargs = {k: next(it) if isinstance(v, torch.Tensor) else v
                  for k, v in sorted(kwargs.items())}
    return new_args, new_kwargs


def _clone_out(out: Any) -> Any:
    """A copy of ``out`` with every tensor cloned and every container's type kept."""
    torch = import_torch()
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # a named tuple
        return type(out)(*(_clone_out(o) for o in out))
    if isinstance(out, (tuple, list)):
        items = [_clone_out(o) for o in out]
        return type(out)(items) if type(out) in (tuple, list) else _same_type(out, items)
    if isinstance(out, dict):
        new = _shallow(out)
        for k, v in out.items():
            new[k] = _clone_out(v)  # ModelOutput.__setitem__ keeps attribute and key in step
        return new
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return dataclasses.replace(out, **{f.name: _clone_out(getattr(out, f.name))
                                           for f in dataclasses.fields(out) if f.init})
    return out


def _shallow(out: dict[Any, Any]) -> dict[Any, Any]:
    try:
        new = copy.copy(out)  # keeps the type and its attributes (ModelOutput is a dataclass)
    except Exception:  # a mapping type that cannot be copied: a plain dict still has the keys
        return {}
    return new if isinstance(new, dict) else {}


def _same_type(out: Any, items: list[Any]) -> Any:
    try:
        return type(out)(items)
    except Exception:  # a sequence type whose constructor takes something else
        return items if isinstance(out, list) else tuple(items)


def _syncs_with_host(model: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]) -> bool:
    """Whether one run of the model synchronises with the host (then it cannot be captured).

    The sync-debug mode is process-wide for that one run: the loader itself waits on events
    only, which the mode does not check, so a load on another thread is not disturbed.
    """
    torch = import_torch()
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(*args, **kwargs)
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        return True
    finally:
        torch.cuda.set_sync_debug_mode(before)
    return False


def _end_failed_capture(torch: ModuleType, dev: torch.device, stream: torch.cuda.Stream, graph: torch.cuda.CUDAGraph,
                        pool: object) -> None:
    """After a failed capture: the caller's stream back, the allocator out of capture mode."""
    torch.cuda.set_stream(stream)
    with contextlib.suppress(Exception):
        pool = graph.pool()  # the pool this capture allocated from (a private one when None)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None and pool is not None:
        with contextlib.suppress(Exception):  # already ended when capture_end got that far
            end(dev.index, pool)
    with contextlib.suppress(Exception):
        graph.reset()
    with contextlib.suppress(Exception):
        torch.cuda.synchronize(dev)


class UncapturableError(RuntimeError):
    """The model synchronises with the host during a run, so it cannot be captured."""


def cuda_capture(model: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object],
                 pool: Any) -> Captured:
    """Capture ``model(*args, **kwargs)`` into a CUDA graph sharing the memory ``pool``.

    Runs on the inputs' device; thread-local capture error mode.

    Raises:
        UncapturableError: the model synchronises with the host (found before capturing).
        RuntimeError: the capture failed; the caller's stream is current again.
    """
    torch = import_torch()
    tensors, _ = _split(args, kwargs)
    dev = tensors[0].device
    with torch.cuda.device(dev):
        static = [t.clone() for t in tensors]
        sargs, skw = _rebuild(args, kwargs, static)
        caller = torch.cuda.current_stream(dev)
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(caller)
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(3):  # capture needs the lazy initialisations done, off the main stream
                model(*sargs, **skw)
            if _syncs_with_host(model, sargs, skw):
                caller.wait_stream(side)
                raise UncapturableError("the model synchronises with the host (sync debug mode)")
        caller.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            out = _capture_on(torch, graph, side, pool, lambda: model(*sargs, **skw))
        except BaseException:
            _end_failed_capture(torch, dev, caller, graph, pool)
            raise
    return Captured(graph.replay, static, out)


def _capture_on(torch: ModuleType, graph: torch.cuda.CUDAGraph, side: torch.cuda.Stream, pool: Any,
                run: Callable[[], object]) -> object:
    """``run()`` captured into ``graph`` on ``side``; the stream context restores the caller's.

    Not ``torch.cuda.graph``: that context manager empties PyTorch's process-wide pinned
    cache on entry, and leaves the capture stream current when ending the capture fails.
    """
    done = torch.cuda.Event()  # an event, not side.synchronize(): see _syncs_with_host
    done.record(side)
    done.synchronize()  # nothing of the warm-up is still queued on the capture stream
    with torch.cuda.stream(side):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            with torch.inference_mode():
                out = run()
        except BaseException:
            with contextlib.suppress(Exception):
                graph.capture_end()  # ends the capture; the model's error is the one to report
            raise
        graph.capture_end()
    return out


class GraphPool:
    """Calls ``model``: replays a captured graph when the input shapes match one, else runs it.

    Outputs of a replay are cloned, so a later call never overwrites what a caller holds.
    """

    def __init__(self, model: Callable[..., Any], capture: Callable[..., Captured] | None = None) -> None:
        self.model = model
        self.capture_fn = capture or cuda_capture
        self.graphs: dict[Signature, Captured] = {}
        self.replays = 0
        self.fallbacks = 0
        self.mempool: Any = None
        self.capturing = True  # False after a failed capture or an uncapturable model
        self.eager_reason = ""

    def capture(self, args: tuple[object, ...], kwargs: dict[str, object]) -> bool:
        """Capture one shape; on failure run eagerly from then on (warn, no raise)."""
        if not self.capturing:
            return False
        _, sig = _split(args, kwargs)
        try:
            self.graphs[sig] = self.capture_fn(self.model, args, kwargs, self.mempool)
        except Exception as e:  # an op that cannot be captured: correctness first
            self.capturing, self.eager_reason = False, f"{type(e).__name__}: {e}"
            warnings.warn(f"packer_loader: CUDA graph capture failed for {sig} ({self.eager_reason}); "
                          "the model runs eagerly for every shape not captured so far",
                          RuntimeWarning, stacklevel=2)
            return False
        return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        torch = import_torch()
        tensors, sig = _split(args, kwargs)
        entry = self.graphs.get(sig)
        with torch.inference_mode():
            if entry is None:
                self.fallbacks += 1
                return self.model(*args, **kwargs)
            for dst, src in zip(entry.inputs, tensors, strict=True):
                dst.copy_(src)
            entry.replay()
            self.replays += 1
            return _clone_out(entry.output)


def _as_call(example: object) -> tuple[tuple[object, ...], dict[str, object]]:
    if isinstance(example, dict):
        return (), dict(example)
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    return (example,), {}


def warmup(model: Callable[..., Any], example_inputs: Any, *, cudnn_benchmark: bool = True,
           cuda_graphs: bool = False, iters: int = 3,
           timeline: Timeline | None = None) -> GraphPool:
    """Run each example a few times (cuDNN autotune); optionally capture one graph per shape.

    Args:
        model: the module (or any callable) to warm up.
        example_inputs: a list of examples, each a tensor, a tuple of positional args or a
            kwargs dict (``[{"input_ids": ids}]``); a single tensor or kwargs dict is one example.
        cudnn_benchmark: turn on ``torch.backends.cudnn.benchmark`` first.
        cuda_graphs: capture one CUDA graph per example shape (CUDA inputs only).
        iters: eager runs per example.

    Returns:
        a callable that replays a captured graph for a known shape and runs the model
        normally for any other (under ``torch.inference_mode``).
    """
    timeline = timeline or TIMELINE
    torch = import_torch(timeline)
    pool = GraphPool(model)
    if isinstance(example_inputs, dict) or hasattr(example_inputs, "shape"):
        example_inputs = [example_inputs]  # one example, not a sequence of them
    calls = [_as_call(x) for x in example_inputs]
    with timeline.stage("warm-up"):
        if cudnn_benchmark:
            torch.backends.cudnn.benchmark = True
        with torch.inference_mode():
            for args, kwargs in calls:
                for _ in range(iters):
                    model(*args, **kwargs)
        if cuda_graphs and torch.cuda.is_available():
            pool.mempool = torch.cuda.graph_pool_handle()
            for args, kwargs in calls:
                tensors, _ = _split(args, kwargs)
                if tensors and all(t.is_cuda for t in tensors):
                    pool.capture(args, kwargs)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    timeline.flush()
    return pool
