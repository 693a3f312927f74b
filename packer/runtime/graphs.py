"""Warm-up with real input shapes and the CUDA graph pool (correctness before speed).

:func:`warmup` runs each example a few times (cuDNN autotune) and, on request, captures one
CUDA graph per input shape; the returned :class:`GraphPool` replays a graph when the shapes
match a captured one and runs the model eagerly for any other.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

from packer.runtime.timeline import TIMELINE, Timeline, _torch


class Captured:
    """One captured shape: static inputs to fill, ``replay`` to run, static outputs to read."""

    def __init__(self, replay: Callable[[], Any], inputs: list[Any], output: Any) -> None:
        self.replay, self.inputs, self.output = replay, inputs, output


def _split(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], tuple[Any, ...]]:
    """Tensors in call order and a hashable signature (shapes, dtypes, devices, constants)."""
    torch = sys.modules["torch"]
    tensors: list[Any] = []
    sig: list[tuple[Any, ...]] = []
    for key, v in [*enumerate(args), *sorted(kwargs.items())]:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            sig.append((key, "T", tuple(v.shape), str(v.dtype), str(v.device)))
        else:
            sig.append((key, "V", type(v).__name__, v if v.__hash__ is not None else id(v)))
    return tensors, tuple(sig)


def _rebuild(args: tuple[Any, ...], kwargs: dict[str, Any],
             tensors: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:  # fmt: skip
    torch = sys.modules["torch"]
    it = iter(tensors)
    new_args = tuple(next(it) if isinstance(v, torch.Tensor) else v for v in args)
    new_kwargs = {k: next(it) if isinstance(v, torch.Tensor) else v
                  for k, v in sorted(kwargs.items())}  # fmt: skip
    return new_args, new_kwargs


def _clone_out(out: Any) -> Any:
    torch = sys.modules["torch"]
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_clone_out(o) for o in out)
    if isinstance(out, dict):
        return {k: _clone_out(v) for k, v in out.items()}
    return out


def cuda_capture(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 pool: Any) -> Captured:  # fmt: skip
    """Capture ``model(*args, **kwargs)`` into a CUDA graph sharing the memory ``pool``."""
    torch = sys.modules["torch"]
    tensors, _ = _split(args, kwargs)
    static = [t.clone() for t in tensors]
    sargs, skw = _rebuild(args, kwargs, static)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(3):  # capture needs the lazy initialisations done, off the main stream
            model(*sargs, **skw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
        out = model(*sargs, **skw)
    return Captured(graph.replay, static, out)


class GraphPool:
    """Calls ``model``: replays a captured graph when the input shapes match one, else runs it.

    Outputs of a replay are cloned, so a later call never overwrites what a caller holds.
    """

    def __init__(self, model: Any, capture: Callable[..., Captured] | None = None) -> None:
        self.model = model
        self.capture_fn = capture or cuda_capture
        self.graphs: dict[tuple[Any, ...], Captured] = {}
        self.replays = 0
        self.fallbacks = 0
        self.mempool: Any = None

    def capture(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Capture one shape; on failure keep running that shape eagerly (warn, no raise)."""
        _, sig = _split(args, kwargs)
        try:
            self.graphs[sig] = self.capture_fn(self.model, args, kwargs, self.mempool)
        except Exception as e:  # an op that cannot be captured: correctness first
            warnings.warn(f"packer_loader: CUDA graph capture failed for {sig}: {e}",
                          RuntimeWarning, stacklevel=2)  # fmt: skip
            return False
        return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        torch = sys.modules["torch"]
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


def _as_call(example: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example, dict):
        return (), dict(example)
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    return (example,), {}


def warmup(model: Any, example_inputs: list[Any], *, cudnn_benchmark: bool = True,
           cuda_graphs: bool = False, iters: int = 3,
           timeline: Timeline | None = None) -> GraphPool:  # fmt: skip
    """Run each example a few times (cuDNN autotune); optionally capture one graph per shape.

    Args:
        model: the module (or any callable) to warm up.
        example_inputs: examples; each a tensor, a tuple of positional args or a kwargs dict.
        cudnn_benchmark: turn on ``torch.backends.cudnn.benchmark`` first.
        cuda_graphs: capture one CUDA graph per example shape (CUDA inputs only).
        iters: eager runs per example.

    Returns:
        a callable that replays a captured graph for a known shape and runs the model
        normally for any other (under ``torch.inference_mode``).
    """
    timeline = timeline or TIMELINE
    torch = _torch(timeline)
    pool = GraphPool(model)
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
