"""transformers' own load-time conversion of checkpoint names and tensors, applied by transformers.

transformers 5 loads a checkpoint through its conversion table (``conversion_mapping``): legacy
names are renamed (``LayerNorm.gamma`` -> ``LayerNorm.weight``), per-expert MoE weights are stacked
into fused ``experts.gate_up_proj`` / ``experts.down_proj``, ``block_sparse_moe`` becomes ``mlp``.
Where that table changes any of the build's names (beyond the base-model prefix, which
:mod:`.hf_keys` handles without copies), the loaded tensors are handed to transformers' own
``convert_and_load_state_dict_in_model`` with the model's own table: no rule of it is copied here,
so the model is what transformers' ``from_pretrained`` makes of the same bytes. Where the
installed transformers has no such table, the plain path stays; where it has one but the result
could differ (a quantized model, an API this module does not know, a conversion error), loading
is refused in one line that points to ``model_dir()`` and transformers' own ``from_pretrained``.

transformers is imported only here, inside functions, and only when the caller already loads a
transformers model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .assign import LoadResult

if TYPE_CHECKING:
    import torch

    from .loading import Loader

REFUSE = ("from_pretrained: {name}: {why}; load it with transformers' own loader from the model directory "
          "instead: AutoModel.from_pretrained(packer_loader.model_dir()) (the same files, laid out as published)")


def conversion_table(model: Any, names: list[str]) -> list[Any] | None:
    """The model's own conversion table when it changes any of the checkpoint ``names`` beyond the
    base-model prefix, else None (also where the installed transformers has no such table)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # transformers 4: no load-time conversion, the plain path is its own
        return None
    table = get_model_conversion_mapping(model)
    if not table:
        return None
    renamings = [t for t in table if isinstance(t, WeightRenaming)]
    converters = [t for t in table if isinstance(t, WeightConverter)]
    meta = model.state_dict()
    prefix = model.base_model_prefix
    for name in names:
        converted, pattern = rename_source_key(name, renamings, converters, prefix, meta)
        plain, _ = rename_source_key(name, [], [], prefix, meta)
        if pattern is not None or (converted != plain and converted in meta):
            return table
    return None


def load_converted(loader: Loader, model: Any, table: list[Any], *, device: str, verify: bool,
                   dtype: torch.dtype | None) -> LoadResult:
    """Load the build's tensors into ``model`` through transformers' own conversion with ``table``.

    Raises:
        RuntimeError: where transformers' own loader could make another model of the same bytes
            (one line naming ``model_dir()`` and ``AutoModel.from_pretrained``).
    """
    name = type(model).__name__
    if getattr(model.config, "quantization_config", None) is not None:
        raise RuntimeError(REFUSE.format(name=name, why="a quantized model whose checkpoint transformers "
                                                        "converts on load (its quantizer takes part)"))
    try:
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig
    except ImportError as e:
        raise RuntimeError(REFUSE.format(name=name, why=f"this transformers converts the checkpoint on load "
                                                        f"through an API packer does not know ({e})")) from None
    state = loader.load_weights(device, verify=verify)
    config = LoadStateDictConfig(device_map={"": device}, dtype=dtype, weight_mapping=table)
    info, _ = convert_and_load_state_dict_in_model(model, state, config)
    if info.conversion_errors or info.mismatched_keys or info.error_msgs:
        what = info.conversion_errors or info.mismatched_keys or info.error_msgs
        raise RuntimeError(REFUSE.format(name=name, why=f"transformers' conversion of its checkpoint failed here "
                                                        f"({str(what)[:200]})"))
    done = sorted({type(t).__name__ for t in table if t.was_used()})
    note = f"converted on load by transformers' own table for {name} ({', '.join(done)})"
    return LoadResult(sorted(info.missing_keys), sorted(info.unexpected_keys), [note])
