"""transformers' loading rules, applied to a build's weights by ``from_pretrained``.

* **The base-model prefix.** A checkpoint saved from a task model (``BertForMaskedLM``: names
  start with ``bert.``) loads into its base model (``BertModel``) with the prefix stripped, and
  a base checkpoint loads into a task model with the prefix added, as transformers'
  ``from_pretrained`` does. The head's keys that have no place are unexpected; a head the
  checkpoint lacks is missing.
* **What is reported.** Unexpected keys (an extra head, a pooler the model does not build,
  old ``attn.masked_bias`` buffers) are returned and logged, not raised, unless ``strict``.
  Missing parameters raise: they would stay on ``meta``, and a model that cannot run is no
  model. Missing buffers keep the value their constructor gave them and are logged.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .assign import LoadResult

LOG = logging.getLogger("packer_loader")


class PrefixMap:
    """Module names -> stored names under transformers' base-model-prefix rule.

    ``add``: the stored names carry ``prefix.`` that the module's do not (a task checkpoint
    into the base model); otherwise the module's names carry it and the stored ones do not.
    """

    def __init__(self, prefix: str, add: bool) -> None:
        self.prefix, self.add = prefix + ".", add

    def __call__(self, name: str) -> str:
        if self.add:
            return self.prefix + name
        return name[len(self.prefix):] if name.startswith(self.prefix) else name

    def describe(self) -> str:
        """A note for the load result."""
        where = "added to the module's names" if self.add else "stripped from the module's names"
        return f"base-model prefix {self.prefix[:-1]!r} {where} to match the stored keys (as transformers does)"


def prefix_map(module: torch.nn.Module, module_names: Collection[str], stored: Collection[str]) -> PrefixMap | None:
    """The prefix rule of ``module`` for these stored names, or None when names already agree.

    Args:
        module: a transformers ``PreTrainedModel`` (its ``base_model_prefix``, e.g. ``"bert"``).
        module_names: every parameter and buffer name of the module.
        stored: the build's tensor names (aliases included).

    Returns:
        a :class:`PrefixMap`, or None (no prefix, or both sides agree about it).
    """
    prefix = getattr(module, "base_model_prefix", "") or ""
    if not prefix:
        return None
    dot = prefix + "."
    stored_has = any(n.startswith(dot) for n in stored)
    module_has = any(n.startswith(dot) for n in module_names)
    if stored_has and not module_has:
        return PrefixMap(prefix, add=True)
    if module_has and not stored_has:
        return PrefixMap(prefix, add=False)
    return None


def loading_info(result: LoadResult) -> dict[str, list[str]]:
    """transformers' ``output_loading_info`` dictionary for a :class:`LoadResult`."""
    return {"missing_keys": list(result.missing), "unexpected_keys": list(result.unexpected),
            "mismatched_keys": [], "error_msgs": []}


def check_result(model: torch.nn.Module, result: LoadResult, *, strict: bool) -> None:
    """Log what transformers would warn about; raise where the model cannot run.

    Raises:
        RuntimeError: parameters left on ``meta`` (missing from the weights), or, with
            ``strict``, any unexpected key.
    """
    name = type(model).__name__
    if result.unexpected:
        if strict:
            raise RuntimeError(f"from_pretrained: {len(result.unexpected)} unexpected key(s) in the weights for "
                               f"{name}: {result.unexpected[:8]} (strict=False reports them instead)")
        LOG.warning("packer_loader: some weights were not used when initialising %s: %s", name,
                    result.unexpected)
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise RuntimeError(f"from_pretrained: {len(left)} parameter(s) of {name} not in the weights: {left[:8]}; "
                           "build the weights from a checkpoint that holds them, or load the head yourself "
                           "with load_into(strict=False)")
    params = {n for n, _ in model.named_parameters()}
    buffers = [k for k in result.missing if k not in params]
    if buffers:
        LOG.info("packer_loader: buffers of %s not in the weights keep their constructed values: %s",
                 name, buffers)
