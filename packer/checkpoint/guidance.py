"""Guidance in one run: every disallowed global of a pickle named at once, with the flags to paste.

When the VM meets a global outside the policy it stops. Rather than let the user learn one
global per run, the same pickle is surveyed once more with every unknown global read as an
inert placeholder (never imported, never called: the same treatment ``--allow-global`` gives),
collecting each one the real policy refuses. The result is one message: the globals, sorted and
deduplicated, a ready-to-paste list of ``--allow-global`` flags, and what the payload is:

* the pickle's value *is* a ``torch.nn`` module (``torch.save(model)``): save the state dict;
* ``torch.nn`` objects sit beside a state dict (hyper-parameters holding activation
  classes): name the key (``--key state_dict``) and allow the globals as placeholders.

The survey runs under the same caps as the first run; if it fails on its own, the globals seen
until then are still named. Nothing it builds leaves this module.
"""

from __future__ import annotations

import shlex
from typing import Any

from packer.checkpoint.placeholders import PLACEHOLDER_TYPES, GlobalPolicy, PlaceholderDict
from packer.checkpoint.tree import Global, PickleDict
from packer.errors import CheckpointError, DisallowedGlobalError

MAX_NAMED = 40  # globals named in one message; the flags list is cut at the same place


def survey(vm_class: Any, data: bytes, *, where: str, start: int, persistent_load: Any, policy: GlobalPolicy,
           limits: Any) -> tuple[list[str], object]:
    """Run the pickle again with every global read as a placeholder; return ``(refused, value)``.

    ``refused``: ``module.name`` of each global ``policy`` refuses, sorted; ``value``: the
    pickle's value (None when the survey itself failed).
    """
    wide = GlobalPolicy(callables=policy.callables, values=policy.values,
                        placeholder_types=policy.placeholder_types or PLACEHOLDER_TYPES,
                        patterns=(*policy.patterns, "*"))
    refused: set[str] = set()

    class Survey(vm_class):
        def _global(self, module: str, name: str) -> Global:
            if not policy.allowed((module, name)):
                refused.add(f"{module}.{name}")
            return super()._global(module, name)

    vm = Survey(data, where=where, start=start, persistent_load=persistent_load, policy=wide, limits=limits)
    try:
        value, _ = vm.run()
    except (CheckpointError, RecursionError):
        value = None
    return sorted(refused), value


def _is_module(value: object) -> bool:
    """True when the pickle's value is itself a ``torch.nn`` object (``torch.save(model)``)."""
    kind = getattr(value, "type", None)
    name = kind.qualname if isinstance(kind, Global) else ""
    return name.startswith("torch.nn.") and not name.startswith("torch.nn.parameter.")


_KEYS = ("state_dict", "model_state_dict", "model", "ema", "module", "net", "weights", "params")


def _state_dict_key(value: object) -> str | None:
    """The top-level key holding a state dict beside other entries (the ``--key`` to suggest)."""
    if not isinstance(value, dict) or isinstance(value, PlaceholderDict):
        return None
    return next((k for k in _KEYS if isinstance(value.get(k), PickleDict | dict) and value.get(k)), None)


def one_message(first: DisallowedGlobalError, refused: list[str], value: object) -> DisallowedGlobalError:
    """The single error naming every refused global, the flags, and what the payload is.

    A global that is no Python name (``os x.system``) can name no class to allow: the first
    error stands as it is, with no flags.
    """
    if not refused or not all(part.isidentifier() for q in refused for part in q.split(".")):
        return first
    where, _, rest = str(first).partition(": global ")
    qual = rest.split(" ", 1)[0]  # the first global met: the headline, as a one-global message has it
    shown = refused[:MAX_NAMED]
    more = f", and {len(refused) - MAX_NAMED} more" if len(refused) > MAX_NAMED else ""
    flags = " ".join(f"--allow-global {shlex.quote(q)}" for q in shown)
    every = f" ({len(refused)} in this pickle: {', '.join(shown)}{more})" if len(refused) > 1 else ""
    head = f"{where}: global {qual} is not allowed{every}; packer never imports or calls anything"
    if _is_module(value):
        return DisallowedGlobalError(f"{head}; the whole pickle is a pickled torch.nn module, not a state dict: "
                                     "save model.state_dict() instead, or convert once in a trusted environment")
    found = _state_dict_key(value)
    key = f"--key {found} " if found and any(q.startswith("torch.nn.") for q in refused) else ""
    beside = "; torch.nn objects sit beside the state dict" if key else ""
    return DisallowedGlobalError(f"{head}{beside}; if these are plain data, read them as inert placeholders "
                                 f"with: {key}{flags} (recipe: weights.allow_globals)")
