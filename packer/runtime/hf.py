"""Hugging Face models from a build: ``from_pretrained`` and a plain ``model_dir``.

transformers is imported only inside these functions; the loader never depends on it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .components import component_dir
from .empty import init_empty
from .env import torch_dtype
from .hf_convert import conversion_table, load_converted
from .hf_keys import check_result, loading_info, prefix_map
from .timeline import import_torch

if TYPE_CHECKING:
    from types import ModuleType

    import torch

    from .loading import Loader

_CONFIGS: dict[str, Any] = {}  # bundle directory -> parsed config (prepare() fills it)


def hf_config(bundle: Path) -> Any:
    """The transformers config of the bundle in ``bundle``, parsed once per process."""
    key = str(bundle)
    if key not in _CONFIGS:
        from transformers import AutoConfig

        _CONFIGS[key] = AutoConfig.from_pretrained(key)
    return _CONFIGS[key]


def weights_dtype(torch: ModuleType, manifest: dict[str, Any], config: Any) -> torch.dtype | None:
    """The dtype transformers' ``dtype="auto"`` picks: the config's, else the weights' floats."""
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dt, str):
        dt = getattr(torch, dt, None)
    if dt is not None:
        return dt
    for name, rec in manifest["weights"]["tensors"].items():
        t = torch_dtype(rec["dtype"], name)[0]
        if t.is_floating_point:
            return t
    return None


def hf_from_pretrained(loader: Loader, model_class: Any, *, device: str = "cuda", dtype: torch.dtype | None = None,
                       verify: bool = False, strict: bool = False, output_loading_info: bool = False) -> Any:
    """Construct ``model_class`` under :func:`init_empty` and load the build into it.

    transformers' loading rules hold (:mod:`packer.runtime.hf_keys`): the base-model prefix
    is added or stripped (a task checkpoint loads into its base model and back), unexpected
    keys are reported, missing parameters raise. Where the model's own conversion table
    changes the checkpoint's names (legacy ``gamma``/``beta``, per-expert MoE weights),
    transformers' own conversion loads the tensors (:mod:`packer.runtime.hf_convert`).

    Args:
        loader: the :class:`Loader` of the build (its bundle holds ``config.json``).
        model_class: a transformers model class (``LlamaForCausalLM``) or an ``AutoModel*``.
        device: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``.
        dtype: torch dtype of the floating-point parameters; None: the config's, else the
            weights' (transformers' ``dtype="auto"``). Another dtype than the weights' costs
            a cast (a copy).
        verify: also check every file's sha256.
        strict: also raise on unexpected keys (default: logged on the ``packer_loader``
            logger and returned with ``output_loading_info``).
        output_loading_info: return ``(model, info)`` as transformers does, ``info`` holding
            ``missing_keys``, ``unexpected_keys``, ``mismatched_keys`` and ``error_msgs``.

    Returns:
        the model in ``eval()`` mode, ties applied, every parameter a loaded tensor (with
        ``output_loading_info``: ``(model, info)``).

    Raises:
        ArtifactMismatchError: no bundle, or artifacts that do not match the manifest.
        RuntimeError: parameters missing from the weights (after the model's ignore
            patterns), a shape mismatch, or with ``strict`` unexpected keys.
    """
    if hasattr(model_class, "load_config"):  # a diffusers model (ConfigMixin): its own config format
        return _diffusers_model(loader, model_class, loader.bundle_dir() / component_dir(loader.manifest["weights"]),
                                device=device, dtype=dtype, verify=verify,
                                strict=strict, output_loading_info=output_loading_info)
    model, bundle = hf_construct(loader, model_class, dtype)
    w = loader.manifest["weights"]
    stored = [*w["tensors"], *w.get("aliases", {})]
    if (table := conversion_table(model, stored)) is not None:  # transformers converts these names on load
        result = load_converted(loader, model, table, device=device, verify=verify, dtype=dtype)
    else:
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        names += [n for n, _ in model.named_buffers(remove_duplicate=False)]
        rule = prefix_map(model, names, stored)
        result = loader.load_into(model, device=device, strict=False, verify=verify, key=rule)
        if rule is not None:
            result.notes.append(rule.describe())
    model.tie_weights()
    if table is not None:  # a parameter tied to a loaded one is not missing (transformers does not say so)
        tied = {n for n, t in model.named_parameters(remove_duplicate=False) if t.device.type != "meta"}
        result.missing[:] = [k for k in result.missing if k not in tied]
    check_result(model, result, strict=strict)
    hf_finish(model, bundle)
    return (model, loading_info(result)) if output_loading_info else model


def hf_construct(loader: Loader, model_class: Any, dtype: torch.dtype | None) -> tuple[Any, Path]:
    """``model_class`` built under :func:`init_empty` from the bundle's config; and that bundle folder."""
    torch = import_torch(loader.timeline)
    bundle = loader.bundle_dir() / component_dir(loader.manifest["weights"])
    config = _config(loader, bundle, model_class)
    dtype = dtype or weights_dtype(torch, loader.manifest, config)
    with loader.timeline.stage("construct"), init_empty(dtype=dtype):
        if hasattr(model_class, "from_config"):  # the Auto classes
            model = model_class.from_config(config, dtype=dtype)
        else:
            model = model_class._from_config(config, dtype=dtype)
    return model, bundle


def hf_finish(model: Any, bundle: Path) -> Any:
    """The generation config from ``bundle`` (where the model generates), then ``eval()``."""
    if model.can_generate() and (bundle / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(bundle))
    return model.eval()


def _diffusers_model(loader: Loader, model_class: Any, folder: Path, *, device: str, dtype: torch.dtype | None,
                     verify: bool,
                     strict: bool, output_loading_info: bool) -> Any:
    """A diffusers model (``UNet2DConditionModel``...) of a component: its config, then the weights."""
    torch = import_torch(loader.timeline)
    with loader.timeline.stage("config"):
        config = model_class.load_config(str(folder))
    dtype = dtype or weights_dtype(torch, loader.manifest, None)
    with loader.timeline.stage("construct"), init_empty(dtype=dtype):
        model = model_class.from_config(config)
    result = loader.load_into(model, device=device, strict=False, verify=verify)
    check_result(model, result, strict=strict)
    model.eval()
    return (model, loading_info(result)) if output_loading_info else model


def _config(loader: Loader, bundle: Path, model_class: Any) -> Any:
    """A private copy of the bundle's parsed config (construction may change it)."""
    if str(bundle) in _CONFIGS:  # parsed by prepare(), e.g. in the warm pool's fork server
        return copy.deepcopy(_CONFIGS[str(bundle)])
    with loader.timeline.stage("config"):
        return copy.deepcopy(hf_config(bundle))


def hf_model_dir(loader: Loader, *, root: str | Path | None = None) -> Path:
    """A Hugging Face model directory for this build: bundle files and weights, linked.

    Laid out as transformers, vLLM, TGI and SGLang expect (``config.json``, tokenizer
    files, ``generation_config.json``, ``model*.safetensors`` and the index when sharded);
    a multi-component build as its libraries expect (:mod:`packer.runtime.dirtree`).
    Every entry is a symbolic link: to the extracted bundle, and to the weight files where
    they are (``PACKER_WEIGHTS_DIR`` honoured); nothing is copied. Made once per node
    beside the bundle cache (atomically: built under a temporary name, then renamed).

    Args:
        loader: the :class:`Loader` of the build.
        root: where to make it (default: beside the extracted bundle).

    Raises:
        ArtifactMismatchError: no bundle, or a weight file missing or of another size.
    """
    from .dirtree import lay_out  # with the signature module: compiled only when a directory is laid out

    return lay_out(loader, root=root)
