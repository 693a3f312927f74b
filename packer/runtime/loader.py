"""packer's runtime loader: gets a build's weights onto the device at the speed of the hardware.

These modules ship into every build as the ``packer_runtime/`` package beside the emitted
``packer_loader.py``, byte for byte as they are here (names, docstrings, line numbers), so a
traceback in a serving container points at real files. The emitted file is a short stub: it
pins the build's manifest, checks these files against their sha256 and makes one
:class:`Build` of this module, whose methods are its public functions. Inside packer the same
package is ``packer.runtime``, driven through :class:`~packer.runtime.loading.Loader` with an
explicit manifest. It needs the standard library and torch (imported lazily), plus zstandard
for the bundle.

* CPU: tensors are views of a private copy-on-write mapping of each shard (no read at load).
* CUDA: headers by ``pread``; one device buffer per shard (or the module's own parameters);
  a bounded ring of pinned staging slots filled by reader threads (``os.preadv`` releases the
  GIL) while one CUDA stream copies the previous slot; one event per slot, a slot is refilled
  only after its copy completed. The copy engine is pluggable: tests run the very same
  scheduling against a CPU engine (a copy thread in place of the stream).

* Models: ``init_empty`` (``empty``) builds a module with parameters on ``meta`` and real
  buffers; :meth:`Build.load_into` then assigns the loaded tensors to them (no second
  allocation, no copy). :meth:`Build.from_pretrained` does both for Hugging Face models,
  :meth:`Build.model_dir` lays out a plain model directory (links) for serving engines,
  :meth:`Build.warm_context` forks workers from a prepared fork server.

Run ``python packer_loader.py --selftest [--device cpu|cuda] [--verify]`` to check a build.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .assign import LoadResult
from .components import all_loaders, component_loader
from .empty import init_empty
from .env import POOL_ENV, ArtifactMismatchError, printable, torch_dtype
from .loading import Loader
from .reading import entry_kind, inside, loads_json, sha256_regular
from .settings import RuntimeSettings, setting
from .shards import pread_exact
from .timeline import TIMELINE, Timeline, import_torch
from .view_open import Check, open_view, root_name

# The stub compiles each runtime module from its checked source at every start (no bytecode is
# trusted), so the modules of the other paths (graphs, the ring, the warm pool) are imported
# where they are used: a CPU load by mapping never compiles them.

if TYPE_CHECKING:
    import multiprocessing.context
    from collections.abc import Callable

    import torch

    from .graphs import GraphPool

# what the emitted stub takes from here: the Build whose methods are its functions, and the
# process-wide functions and types it shows beside them
__all__ = ["ArtifactMismatchError", "Build", "LoadResult", "init_empty", "release_ring", "report", "warmup"]


class Build:
    """One emitted build: the manifest its stub pins and the directory the stub lives in.

    The stub's public functions are this object's methods; each one works on a
    :class:`Loader` of this build's artifacts (``root``, else ``$PACKER_ARTIFACTS``, else
    ``home``), made once per root.

    Args:
        manifest_json: the embedded manifest, canonical JSON (files, weights, bundle, runtime).
        home: the directory of the emitted ``packer_loader.py``.
        module: the stub's module name (the warm pool's fork server imports it by that name).
    """

    def __init__(self, manifest_json: str, home: Path, module: str) -> None:
        self._json = manifest_json
        self.home = home
        self.module = module
        self._loaders: dict[tuple[str, str], Loader] = {}
        self._runtime: dict[str, Any] | None = None

    def manifest(self) -> dict[str, Any]:
        """The manifest this build's loader pins (a fresh copy at each call)."""
        data: dict[str, Any] = loads_json(self._json, f"{self.home / 'packer_loader.py'}: the embedded manifest")
        return data

    def settings(self) -> RuntimeSettings:
        """This build's settings: the environment over the embedded recipe's ``[runtime]``."""
        if self._runtime is None:  # parsed once: the whole manifest may be large
            self._runtime = dict(self.manifest().get("runtime") or {})
        return RuntimeSettings.from_sources(os.environ, self._runtime)

    def loader(self, root: str | Path | None = None) -> Loader:
        """The loader for ``root`` (else ``$PACKER_ARTIFACTS``, else the stub's directory)."""
        settings = self.settings()
        base = root or settings.artifacts or self.home
        key = (str(base), settings.weights_dir)
        if key not in self._loaders:
            view = open_view(self.manifest(), base, weights_dir=settings.weights_dir or None,
                             named="root=" if root else "PACKER_ARTIFACTS",
                             check=_signature_check(settings.require_signature))
            self._loaders[key] = Loader(self.manifest(), view.root, settings=settings, view=view)
        return self._loaders[key]

    def warmup_inputs(self, device: str = "cuda") -> list[dict[str, torch.Tensor]]:
        """Zero-filled example inputs from the recipe's ``[runtime] warmup`` shapes, one per entry."""
        torch = import_torch()
        return [{w["name"]: torch.zeros(tuple(w["shape"]), dtype=getattr(torch, w.get("dtype", "int64")),
                                        device=device)}
                for w in self.settings().warmup]

    def load_weights(self, device: str = "cuda", *, dtype: torch.dtype | None = None, verify: bool = False,
                     root: str | Path | None = None, pipeline: bool | None = None,
                     copy: bool = False, component: str | None = None, proven: bool = False) -> dict[str, torch.Tensor]:
        """Load this build's weights (of ``component``, e.g. ``"unet"``); see :meth:`Loader.load_weights`."""
        return component_loader(self.loader(root), component).load_weights(device, dtype=dtype, verify=verify,
                                                                           pipeline=pipeline, copy=copy, proven=proven)

    def proven_done(self, root: str | Path | None = None) -> int:
        """After a ``load_weights(proven=True)`` whose tensors were used: stop proving on use,
        record the ``verify chunks`` stage (bytes hashed, chunks) and return the bytes hashed."""
        from .proven import release

        hashed, chunks = release()
        if chunks:
            now = time.perf_counter()  # a count, not a span: the proofs ran inside the engine's copies
            self.loader(root).timeline.add("verify chunks", now, now, hashed, chunks=chunks)
        return hashed

    def load_into(self, module: torch.nn.Module, *, device: str | None = None, strict: bool = True,
                  verify: bool = False, root: str | Path | None = None, component: str | None = None) -> LoadResult:
        """Load this build's weights (of ``component``) into ``module`` (built under ``init_empty``: by assignment).

        See :meth:`Loader.load_into`; returns ``(missing, unexpected)`` with ``.notes``. A
        multi-component build (a diffusers pipeline, a sentence-transformers stack, an adapter)
        names the part with ``component`` (``"unet"``, ``"2_Dense"``); None is the root model.
        """
        return component_loader(self.loader(root), component).load_into(module, device=device, strict=strict,
                                                                        verify=verify)

    def from_pretrained(self, model_class: Any, *, device: str = "cuda", dtype: torch.dtype | None = None,
                        verify: bool = False, strict: bool = False, output_loading_info: bool = False,
                        root: str | Path | None = None, component: str | None = None, tp_plan: Any = None) -> Any:
        """A Hugging Face model of this build, ready: config from the bundle, weights assigned.

        transformers' loading rules: the base-model prefix added or stripped, unexpected keys
        logged (raised with ``strict=True``; returned with ``output_loading_info=True`` as
        ``(model, info)``), missing parameters raised. The tokenizer stays
        ``AutoTokenizer.from_pretrained(bundle_dir())``. See ``hf.hf_from_pretrained`` for the
        arguments and errors. ``component`` names a part of a multi-component build
        (``"text_encoder"``, ``"unet"`` with a diffusers model class); its config is the
        bundle's ``<component>/config.json``. With ``tp_plan`` (``"auto"`` or a dict of rules, as
        transformers takes it) in a ``torch.distributed`` process group, the model is sharded by
        that plan and each rank reads its slices only (``tp``); ``device`` is then this rank's.
        """
        from .hf import hf_from_pretrained

        loader = component_loader(self.loader(root), component)
        if tp_plan is not None:
            from .tp import tp_from_pretrained

            return tp_from_pretrained(loader, model_class, device=device, dtype=dtype, verify=verify, tp_plan=tp_plan)
        return hf_from_pretrained(loader, model_class, device=device, dtype=dtype, verify=verify, strict=strict,
                                  output_loading_info=output_loading_info)

    def model_dir(self, *, root: str | Path | None = None, out: str | Path | None = None) -> Path:
        """A Hugging Face model directory of this build (links, no copies) for serving engines.

        ``transformers``, ``vllm serve``, TGI's ``--model-id`` and SGLang's ``--model-path`` read
        it as is. ``out``: where to make it (default beside the extracted bundle). For a build
        streamed from a registry (``root="oci://..."``) it is the directory of its small files,
        with no weight byte, which ``vllm serve DIR --load-format packer`` streams from.
        """
        from .hf import hf_model_dir

        loader = self.loader(root)
        served = loader.view.served_dir()  # a streamed build's directory of small files is one already
        return served if served is not None else hf_model_dir(loader, root=out)

    def prepare(self, *, prefetch: bool = False, root: str | Path | None = None) -> dict[str, Any]:
        """Everything before CUDA (headers, bundle, config; optionally the page cache), done once."""
        from .pool import prepare_loader

        return prepare_loader(self.loader(root), prefetch=prefetch)

    def warm_context(self, preload: list[str] | tuple[str, ...] = (), *, prefetch: bool = False,
                     root: str | Path | None = None) -> multiprocessing.context.ForkServerContext:
        """A ``multiprocessing`` forkserver context whose server has imported and prepared everything.

        The server imports ``preload`` (e.g. ``["transformers", "myapp.model"]``), then this
        loader, which runs :meth:`prepare` there. Start workers with the context's ``Process`` or
        ``Pool``; each initialises CUDA itself and loads (``from_pretrained``/``load_into``).
        Call it under ``if __name__ == "__main__":``.

        Raises:
            RuntimeError: CUDA was initialised in the server (a forked child could not use it),
                ``prepare()`` failed there, or a fork server was already running without it.
        """
        from .pool import start_pool

        return start_pool(self.module, list(preload), root=root, prefetch=prefetch)

    def serve_pool(self) -> None:
        """At the stub's import: when this process is the warm pool's fork server, prepare and guard."""
        if POOL_ENV in os.environ:  # set by warm_context for its fork server only
            from .pool import serve_pool

            serve_pool(self.prepare)

    def bundle_dir(self, *, root: str | Path | None = None) -> Path:
        """The extracted bundle directory; see :meth:`Loader.bundle_dir`."""
        return self.loader(root).bundle_dir()

    def prefetch(self, *, background: bool = True, root: str | Path | None = None) -> threading.Thread | None:
        """Warm the page cache with this build's weights; see :meth:`Loader.prefetch`."""
        return self.loader(root).prefetch(background=background)

    def main(self, argv: list[str] | None = None) -> int:
        """``--selftest [--device cpu|cuda] [--verify] [--root DIR] [--trace FILE]`` or ``--model-dir``."""
        return main(self, argv)


def warmup(model: Callable[..., Any], example_inputs: Any, *, cudnn_benchmark: bool = True,
           cuda_graphs: bool = False, iters: int = 3, timeline: Timeline | None = None) -> GraphPool:
    """Run each example a few times (cuDNN autotune); optionally capture one graph per shape.

    See ``graphs.warmup`` for the arguments; returns its :class:`~graphs.GraphPool`.
    """
    from .graphs import warmup as run

    return run(model, example_inputs, cudnn_benchmark=cudnn_benchmark, cuda_graphs=cuda_graphs, iters=iters,
               timeline=timeline)


def stub_attribute(name: str) -> type:
    """The emitted stub's module ``__getattr__``: ``packer_loader.RegistryError`` (the
    ArtifactMismatchError of a streamed load the registry cannot serve), imported on first use.

    Raises:
        AttributeError: any other name.
    """
    if name != "RegistryError":
        raise AttributeError(f"module 'packer_loader' has no attribute {name!r}")
    from .transport import RegistryError

    return RegistryError


def release_ring() -> int:
    """Free the staging rings of this process (waits for a load in progress); the bytes freed."""
    from .ring import release_ring as free

    return free()


def report(trace: str | Path | None = None) -> list[dict[str, Any]]:
    """Stage timings of this process so far; ``trace`` also writes a Chrome trace file."""
    if trace is not None:
        TIMELINE.chrome_trace(trace)
    return [dict(s) for s in TIMELINE.stages]


def _why(e: Exception, root: Path | str | None = None) -> str:
    """One line for a failure: the message, then its exception type and the artifacts'
    absolute directory (unless the message names it already); a missing package is named as
    itself, never as an artifact fault. With ``PACKER_DEBUG=1`` the traceback goes first."""
    if _debug():
        import traceback

        traceback.print_exception(e, file=sys.stderr)
    if isinstance(e, ImportError):
        top = (e.name or "a package").split(".")[0]
        text = f"packer_loader needs {top}: {e} (pip install {top})"
    else:
        text = str(e).removeprefix("packer_loader: ")
    where = f", artifacts in {root}" if root is not None and str(root) not in text else ""
    hint = "" if _debug() else "; PACKER_DEBUG=1 prints the traceback"
    # escaped whatever raised it: a registry's reason phrase or a file's name may hold ESC or a newline
    return printable(f"{text} [{type(e).__name__}{where}{hint}]")


def _debug() -> bool:
    try:
        return bool(setting("debug"))
    except ValueError:  # a bad PACKER_DEBUG is the failure being reported: no traceback then
        return False


def _artifacts(build: Build, root: str | None) -> Path | str | None:
    """The absolute artifact directory a command works on, or the image reference it streams
    from (None when settings are unreadable)."""
    try:
        base = root or build.settings().artifacts or build.home
    except ValueError:
        return None
    return root_name(base)


def check_loaded(loader: Loader, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Compare every loaded tensor's bytes with the file; return the problems found."""
    torch = import_torch()
    problems = []
    w = loader.manifest["weights"]
    for alias, kept in w.get("aliases", {}).items():
        if tensors.get(alias) is not tensors.get(kept):
            problems.append(f"alias {alias!r} is not the same tensor as {kept!r}")
    quiet = Loader(loader.manifest, loader.root, timeline=Timeline(), settings=loader.settings, view=loader.view)
    shards = quiet.open_shards()
    try:
        for s in shards:
            for name, code, shape, begin, end in s.tensors:
                t = tensors[name]
                if t.dtype != torch_dtype(code, name)[0] or list(t.shape) != shape:
                    problems.append(f"{s.rel}: tensor {name!r} has {t.dtype} {list(t.shape)}")
                    continue
                raw = bytearray(pread_exact(s.fd, end - begin, s.data_start + begin, str(s.path)))
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
                p = inside(root, m["name"], "the manifest's bundle members")
                if entry_kind(p) != "file" or p.stat().st_size != m["size"]:
                    problems.append(f"bundle member {m['name']!r} missing or of another size")
                elif verify and sha256_regular(p)[1] != m["sha256"]:
                    problems.append(f"bundle member {m['name']!r}: sha256 differs")
    return problems


def main(build: Build, argv: list[str] | None = None) -> int:
    """The command line of ``build``'s stub; see :meth:`Build.main`."""
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
            print(build.model_dir(root=args.root))
        except Exception as e:  # one line, exit 1, as the self-test
            sys.stderr.write(f"packer_loader: model dir failed: {_why(e, _artifacts(build, args.root))}\n")
            return 1
        return 0
    if not args.selftest:
        ap.print_help(sys.stderr)
        return 2
    try:
        loader = build.loader(args.root)
        loader.auto_flush = False
        torch = import_torch(loader.timeline)
        device = args.device or loader.settings.device
        if device == "cuda" and args.device is None and not torch.cuda.is_available():
            device = "cpu"  # a CPU node can still check its artifacts; a GPU node passes --device cuda
            sys.stderr.write("packer_loader: the build's device is cuda but CUDA is not available here; "
                             "checking on cpu (--device cuda makes CUDA required)\n")
        if str(device).startswith("cuda") and not torch.cuda.is_available():  # said as a command line says it
            TIMELINE.flush()
            sys.stderr.write(f"packer_loader: self-test not run: --device {device} needs CUDA, and torch sees "
                             "no CUDA device here; run with --device cpu\n")
            return 1
        problems = selftest(loader, device, args.verify)
    except Exception as e:  # any failure is a failed self-test, reported in one line
        TIMELINE.flush()
        sys.stderr.write(f"packer_loader: self-test failed: {_why(e, _artifacts(build, args.root))}\n")
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


def _signature_check(public_key: str) -> Check | None:
    """``PACKER_REQUIRE_SIGNATURE``'s check of a view's root (``model.sig`` against the embedded
    manifest) before anything is loaded; None without one."""
    if not public_key:
        return None

    def check(root: Path, manifest: dict[str, Any]) -> None:
        from .signature import require_signature

        require_signature(root, public_key, manifest=manifest)

    return check
