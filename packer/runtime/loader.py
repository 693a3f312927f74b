"""packer's runtime loader: gets a build's weights onto the device at the speed of the hardware.

This file is emitted into every build as ``packer_loader.py`` with the build's manifest
embedded (``packer.stub`` joins the ``packer.runtime`` modules into that one file); inside
the package it is importable as ``packer.runtime.loader`` and driven through :class:`Loader`
with an explicit manifest. It needs the standard library and torch (imported lazily), plus
zstandard for the bundle. In the package, ``loader.py`` is this entry (the public functions,
``__all__`` and the command line); the :class:`Loader` class they drive is ``loading.py``.

* CPU: tensors are views of a private copy-on-write mapping of each shard (no read at load).
* CUDA: headers by ``pread``; one device buffer per shard (or the module's own parameters);
  a bounded ring of pinned staging slots filled by reader threads (``os.preadv`` releases the
  GIL) while one CUDA stream copies the previous slot; one event per slot, a slot is refilled
  only after its copy completed. The copy engine is pluggable: tests run the very same
  scheduling against a CPU engine (a copy thread in place of the stream).

* Models: :func:`init_empty` builds a module with parameters on ``meta`` and real buffers;
  :func:`load_into` then assigns the loaded tensors to them (no second allocation, no copy).
  :func:`from_pretrained` does both for Hugging Face models, :func:`model_dir` lays out a plain
  model directory (links) for serving engines, :func:`warm_context` forks workers from a
  prepared fork server.

Run ``python packer_loader.py --selftest [--device cpu|cuda] [--verify]`` to check a build.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import threading
from pathlib import Path
from typing import Any

from packer.runtime.assign import LoadResult
from packer.runtime.components import all_loaders, component_loader
from packer.runtime.empty import init_empty
from packer.runtime.engines import CopyEngine, CpuEngine, CudaEngine
from packer.runtime.env import MAX_HEADER, MAX_RING_BYTES, ArtifactMismatchError, _dtype, bundle_reader, manifest
from packer.runtime.graphs import Captured, GraphPool, cuda_capture, warmup
from packer.runtime.hf import hf_from_pretrained, hf_model_dir
from packer.runtime.loading import Loader
from packer.runtime.ring import Chunk, Latch, Readers, RingStats, Slot, plan_chunks, release_ring, run_pipeline
from packer.runtime.settings import DEFAULT_CHUNK, DEFAULT_SLOTS, MIB, RuntimeSettings
from packer.runtime.shards import Shard, _pread_exact, open_shard, sha256_fd, tensor_view
from packer.runtime.signature import require_signature
from packer.runtime.timeline import TIMELINE, Timeline, _torch
from packer.runtime.tp import tp_from_pretrained
from packer.runtime.warm import prepare_loader, serve_warm, start_warm

# the public names, as they were when all of this was one module
__all__ = [
    "DEFAULT_CHUNK", "DEFAULT_SLOTS", "MAX_HEADER", "MAX_RING_BYTES", "MIB", "TIMELINE",
    "ArtifactMismatchError", "Captured", "Chunk", "CopyEngine", "CpuEngine", "CudaEngine", "GraphPool", "Latch",
    "LoadResult", "Loader", "Readers", "RingStats", "RuntimeSettings", "Shard", "Slot", "Timeline", "bundle_dir",
    "bundle_reader", "check_loaded", "cuda_capture", "default_loader", "from_pretrained", "init_empty",
    "load_into", "load_weights", "main", "manifest", "model_dir", "open_shard", "plan_chunks",
    "prefetch", "prepare", "release_ring", "report", "run_pipeline", "selftest", "sha256_fd", "tensor_view",
    "warm_context", "warmup", "warmup_inputs",
]

_LOADERS: dict[tuple[str, str], Loader] = {}


def default_loader(root: str | Path | None = None) -> Loader:
    """The loader for ``root`` (else ``$PACKER_ARTIFACTS``, else this file's directory)."""
    settings = _settings()
    base = root or settings.artifacts or Path(__file__).resolve().parent
    key = (str(base), settings.weights_dir)
    if key not in _LOADERS:
        if settings.require_signature:  # PACKER_REQUIRE_SIGNATURE: refuse before anything is loaded
            require_signature(manifest(), Path(base), settings.require_signature)
        _LOADERS[key] = Loader(manifest(), base, weights_dir=settings.weights_dir or None, settings=settings)
    return _LOADERS[key]


def _settings() -> RuntimeSettings:
    """This build's settings: the environment over the embedded recipe's ``[runtime]``."""
    return RuntimeSettings.from_sources(os.environ, _embedded_runtime())


@functools.lru_cache(maxsize=1)
def _embedded_runtime() -> dict[str, Any]:
    """The embedded ``runtime`` section, parsed once (the whole manifest may be large)."""
    return dict(manifest().get("runtime") or {})


def warmup_inputs(device: str = "cuda") -> list[dict[str, Any]]:
    """Zero-filled example inputs from the recipe's ``[runtime] warmup`` shapes, one per entry."""
    torch = _torch()
    return [{w["name"]: torch.zeros(tuple(w["shape"]), dtype=getattr(torch, w.get("dtype", "int64")),
                                    device=device)}
            for w in _settings().warmup]


def load_weights(device: str = "cuda", *, dtype: Any = None, verify: bool = False,
                 root: str | Path | None = None, pipeline: bool | None = None,
                 copy: bool = False, component: str | None = None) -> dict[str, Any]:
    """Load this build's weights (of ``component``, e.g. ``"unet"``); see :meth:`Loader.load_weights`."""
    return component_loader(default_loader(root), component).load_weights(device, dtype=dtype, verify=verify,
                                                                          pipeline=pipeline, copy=copy)


def load_into(module: Any, *, device: str | None = None, strict: bool = True,
              verify: bool = False, root: str | Path | None = None, component: str | None = None) -> LoadResult:
    """Load this build's weights (of ``component``) into ``module`` (built under :func:`init_empty`: by assignment).

    See :meth:`Loader.load_into`; returns ``(missing, unexpected)`` with ``.notes``. A
    multi-component build (a diffusers pipeline, a sentence-transformers stack, an adapter)
    names the part with ``component`` (``"unet"``, ``"2_Dense"``); None is the root model.
    """
    return component_loader(default_loader(root), component).load_into(module, device=device, strict=strict,
                                                                       verify=verify)


def from_pretrained(model_class: Any, *, device: str = "cuda", dtype: Any = None, verify: bool = False,
                    strict: bool = False, output_loading_info: bool = False,
                    root: str | Path | None = None, component: str | None = None, tp_plan: Any = None) -> Any:
    """A Hugging Face model of this build, ready: config from the bundle, weights assigned.

    transformers' loading rules: the base-model prefix added or stripped, unexpected keys
    logged (raised with ``strict=True``; returned with ``output_loading_info=True`` as
    ``(model, info)``), missing parameters raised. The tokenizer stays
    ``AutoTokenizer.from_pretrained(bundle_dir())``. See
    ``packer.runtime.hf.hf_from_pretrained`` for the arguments and errors. ``component``
    names a part of a multi-component build (``"text_encoder"``, ``"unet"`` with a diffusers
    model class); its config is the bundle's ``<component>/config.json``. With ``tp_plan``
    (``"auto"`` or a dict of rules, as transformers takes it) in a ``torch.distributed``
    process group, the model is sharded by that plan and each rank reads its slices only
    (``packer.runtime.tp``); ``device`` is then this rank's device.
    """
    loader = component_loader(default_loader(root), component)
    if tp_plan is not None:
        return tp_from_pretrained(loader, model_class, device=device, dtype=dtype, verify=verify, tp_plan=tp_plan)
    return hf_from_pretrained(loader, model_class, device=device, dtype=dtype, verify=verify, strict=strict,
                              output_loading_info=output_loading_info)


def model_dir(*, root: str | Path | None = None, out: str | Path | None = None) -> Path:
    """A Hugging Face model directory of this build (links, no copies) for serving engines.

    ``transformers``, ``vllm serve``, TGI's ``--model-id`` and SGLang's ``--model-path`` read
    it as is. ``out``: where to make it (default beside the extracted bundle).
    """
    return hf_model_dir(default_loader(root), root=out)


def prepare(*, prefetch: bool = False, root: str | Path | None = None) -> dict[str, Any]:
    """Everything before CUDA (headers, bundle, config; optionally the page cache), done once."""
    return prepare_loader(default_loader(root), prefetch=prefetch)


def warm_context(preload: list[str] | tuple[str, ...] = (), *, prefetch: bool = False,
                 root: str | Path | None = None) -> Any:
    """A ``multiprocessing`` forkserver context whose server has imported and prepared everything.

    The server imports ``preload`` (e.g. ``["transformers", "myapp.model"]``), then this
    loader, which runs :func:`prepare` there. Start workers with the context's ``Process`` or
    ``Pool``; each initialises CUDA itself and loads (``from_pretrained``/``load_into``).
    Call it under ``if __name__ == "__main__":``.

    Raises:
        RuntimeError: CUDA was initialised in the server (a forked child could not use it),
            ``prepare()`` failed there, or a fork server was already running without it.
    """
    return start_warm(__name__, list(preload), root=root, prefetch=prefetch)


def bundle_dir(*, root: str | Path | None = None) -> Path:
    """The extracted bundle directory; see :meth:`Loader.bundle_dir`."""
    return default_loader(root).bundle_dir()


def prefetch(*, background: bool = True, root: str | Path | None = None) -> threading.Thread | None:
    """Warm the page cache with this build's weights; see :meth:`Loader.prefetch`."""
    return default_loader(root).prefetch(background=background)


def report(trace: str | Path | None = None) -> list[dict[str, Any]]:
    """Stage timings of this process so far; ``trace`` also writes a Chrome trace file."""
    if trace is not None:
        TIMELINE.chrome_trace(trace)
    return [dict(s) for s in TIMELINE.stages]


def _why(e: Exception) -> str:
    """One line for a failure; a missing package is named as itself, never as an artifact fault."""
    if isinstance(e, ImportError):
        top = (e.name or "a package").split(".")[0]
        return f"packer_loader needs {top}: {e} (pip install {top})"
    return str(e).removeprefix("packer_loader: ")


def check_loaded(loader: Loader, tensors: dict[str, Any]) -> list[str]:
    """Compare every loaded tensor's bytes with the file; return the problems found."""
    torch = sys.modules["torch"]
    problems = []
    w = loader.manifest["weights"]
    for alias, kept in w.get("aliases", {}).items():
        if tensors.get(alias) is not tensors.get(kept):
            problems.append(f"alias {alias!r} is not the same tensor as {kept!r}")
    quiet = Loader(loader.manifest, loader.root, weights_dir=loader.weights_dir, timeline=Timeline())
    shards = quiet.open_shards()
    try:
        for s in shards:
            for name, code, shape, begin, end in s.tensors:
                t = tensors[name]
                if t.dtype != _dtype(code, name)[0] or list(t.shape) != shape:
                    problems.append(f"{s.rel}: tensor {name!r} has {t.dtype} {list(t.shape)}")
                    continue
                raw = bytearray(_pread_exact(s.fd, end - begin, s.data_start + begin, s.rel))
                got = t.detach().reshape(-1).view(torch.uint8).cpu()
                if end > begin and not torch.equal(got, torch.frombuffer(raw, dtype=torch.uint8)):
                    problems.append(f"{s.rel}: tensor {name!r} bytes differ from the file")
    finally:
        for s in shards:
            s.close()
    return problems


def selftest(loader: Loader, device: str, verify: bool) -> list[str]:
    """Load everything (every component), compare it with the files (and the bundle); return the problems."""
    loaded = [(label, part, part.load_weights(device, verify=verify)) for label, part in all_loaders(loader)]
    with loader.timeline.stage("check", sum(s["size"] for s in loader.manifest["files"].values())):
        problems = [label + p for label, part, tensors in loaded for p in check_loaded(part, tensors)]
        if loader.manifest.get("bundle"):
            root = loader.bundle_dir()
            for m in loader.manifest["bundle"].get("members", []):
                p = root / m["name"]
                if not p.is_file() or p.stat().st_size != m["size"]:
                    problems.append(f"bundle member {m['name']!r} missing or of another size")
                elif verify and hashlib.sha256(p.read_bytes()).hexdigest() != m["sha256"]:
                    problems.append(f"bundle member {m['name']!r}: sha256 differs")
    return problems


def main(argv: list[str] | None = None) -> int:
    """``--selftest [--device cpu|cuda] [--verify] [--root DIR] [--trace FILE]`` or ``--model-dir``."""
    import argparse

    ap = argparse.ArgumentParser(prog="packer_loader.py", description=__doc__.splitlines()[0])
    ap.add_argument("--selftest", action="store_true", help="load and check every artifact")
    ap.add_argument("--model-dir", action="store_true",
                    help="print a Hugging Face model directory of this build (links, no copies)")
    ap.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: the recipe's)")
    ap.add_argument("--verify", action="store_true", help="also check sha256 of every file")
    ap.add_argument("--root", default=None, help="artifact directory (default: beside this file)")
    ap.add_argument("--trace", default=None, help="write a Chrome trace-event file")
    args = ap.parse_args(argv)
    if args.model_dir:
        try:
            print(model_dir(root=args.root))
        except Exception as e:  # one line, exit 1, as the self-test
            sys.stderr.write(f"packer_loader: model dir failed: {_why(e)}\n")
            return 1
        return 0
    if not args.selftest:
        ap.print_help(sys.stderr)
        return 2
    try:
        loader = default_loader(args.root)
        loader.auto_flush = False
        torch = _torch(loader.timeline)
        device = args.device or loader.settings.device
        if device == "cuda" and args.device is None and not torch.cuda.is_available():
            device = "cpu"  # a CPU node can still check its artifacts; a GPU node passes --device cuda
            sys.stderr.write("packer_loader: the build's device is cuda but CUDA is not available here; "
                             "checking on cpu (--device cuda makes CUDA required)\n")
        problems = selftest(loader, device, args.verify)
    except Exception as e:  # any failure is a failed self-test, reported in one line
        TIMELINE.flush()
        sys.stderr.write(f"packer_loader: self-test failed: {_why(e)}\n")
        return 1
    TIMELINE.flush()
    if args.trace:
        TIMELINE.chrome_trace(args.trace)
    for p in problems:
        sys.stderr.write(f"packer_loader: {p}\n")
    if problems:
        sys.stderr.write(f"packer_loader: self-test failed: {len(problems)} problem(s)\n")
        return 1
    parts = all_loaders(loader)
    count = sum(len(p.manifest["weights"]["tensors"]) for _, p in parts)
    where = f" in {len(parts)} components" if len(parts) > 1 else ""
    sys.stderr.write(f"packer_loader: self-test passed ({count} tensors{where} on {device})\n")
    return 0


serve_warm(prepare)  # a no-op unless this process is the fork server warm_context starts

if __name__ == "__main__":
    sys.exit(main())
