"""Guidance in one run: every disallowed global of a pickle named at once, with the flags to paste.

When the VM meets a global outside the policy it stops. Rather than let the user learn one
global per run, the same pickle is surveyed once more with every unknown global read as an
inert placeholder (never imported, never called: the same treatment ``--allow-global`` gives),
collecting each one the real policy refuses. The result is one message: the globals, sorted and
deduplicated, a ready-to-paste list of ``--allow-global`` flags, and what the payload is:

* the pickle's value *is* a model object (``torch.save(model)``: a ``torch.nn`` class, or any
  class whose state holds ``_modules``), or holds one under a top-level key beside training
  state (ultralytics' ``{"model": <module>, "epoch": ...}``): save the state dict in the
  model's own code. No ``--allow-global`` flags: placeholders would keep the weights out;
* a tensor subclass (torchao's, through ``_rebuild_wrapper_subclass``): name it and the ways
  out (its library's safetensors form, or plain tensors), no flags either;
* ``torch.nn`` objects sit beside a state dict (hyper-parameters holding activation
  classes): name the key (``--key state_dict``) and allow the globals as placeholders.

The survey runs under the same caps as the first run; if it fails on its own, the globals seen
until then are still named. Nothing it builds leaves this module.
"""

from __future__ import annotations

from typing import Any

from packer.checkpoint.placeholders import PLACEHOLDER_TYPES, GlobalPolicy, Placeholder, PlaceholderDict, type_name
from packer.checkpoint.tree import Global, PickleDict, TensorRef
from packer.errors import CheckpointError, DisallowedGlobalError, PayloadError
from packer.util.show import shell_word

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


MODULE_ADVICE = ("a pickled model object, not a state dict: in the model's own code, "
                 "`torch.save(model.state_dict())`, and build that file")


def _module_class(value: object) -> str | None:
    """The class of ``value`` when it is a pickled module object: a ``torch.nn`` class, or
    any placeholder whose pickled state holds ``_modules`` (``nn.Module.__dict__``)."""
    kind = getattr(value, "type", None)
    if not isinstance(kind, Global):
        return None
    name = kind.qualname
    if name.startswith("torch.nn.") and not name.startswith("torch.nn.parameter."):
        return name
    state = getattr(value, "state", None)
    return name if isinstance(state, dict) and "_modules" in state else None


def pickled_module(value: object) -> tuple[str, str | None] | None:
    """``(class, key)`` of a model object the pickle holds at its top (key None) or under one
    top-level key (ultralytics' ``{"model": <module>, ...}``), else None."""
    found = _module_class(value)
    if found is not None:
        return found, None
    if isinstance(value, dict) and not isinstance(value, PlaceholderDict):
        for key, item in list(value.items())[:256]:
            found = _module_class(item)
            if found is not None and isinstance(key, str):
                return found, key
    return None


def module_message(where: str, found: tuple[str, str | None]) -> str:
    """The one-line refusal of a pickled model object found by :func:`pickled_module`."""
    cls, key = found
    at = f" (a {cls} under key {key!r})" if key is not None else f" (a {cls})"
    return f"{where}: {MODULE_ADVICE}{at}; packer never imports or runs a model's code"


_WRAPPER_REBUILD = "torch._utils._rebuild_wrapper_subclass"


def _subclass_message(where: str, refused: list[str]) -> str | None:
    """A tensor subclass pickled through a wrapper rebuild: its classes and the ways out."""
    if _WRAPPER_REBUILD not in refused:
        return None
    classes = [q for q in refused if not q.startswith("torch.")] or ["a tensor subclass"]
    return (f"{where}: tensor subclass {', '.join(classes[:5])} (pickled through "
            "torch._utils._rebuild_wrapper_subclass), which packer does not convert: safetensors holds plain "
            "tensors only; save the model in its library's safetensors form (torchao through transformers: "
            "save_pretrained(); or torchao's flatten_tensor_state_dict() with safetensors' save_file()), "
            "or save plain tensors (tensor.dequantize())")


_KEYS = ("state_dict", "model_state_dict", "model", "ema", "module", "net", "weights", "params")


def _state_dict_key(value: object) -> str | None:
    """The top-level key holding a state dict beside other entries (the ``--key`` to suggest)."""
    if not isinstance(value, dict) or isinstance(value, PlaceholderDict):
        return None
    return next((k for k in _KEYS if isinstance(value.get(k), PickleDict | dict) and value.get(k)), None)


def module_refusal(where: str, value: object) -> str | None:
    """The refusal of a pickled model object (:func:`pickled_module`), unless the weights sit
    beside it at the top: a state dict under a key (then the key is the way out, as
    :func:`one_message` says), or tensors of the top-level dict itself (the module is then
    an entry beside them, as hyper-parameters are)."""
    module = pickled_module(value)
    if module is None:
        return None
    if module[1] is not None and isinstance(value, dict) and (
            _state_dict_key(value) or any(isinstance(v, TensorRef) for v in value.values())):
        return None
    return module_message(where, module)


TROUBLESHOOTING = "docs/troubleshooting.md#checkpoints"

# Modules whose callables act on the system, the interpreter or other code when a pickle calls
# them (the payloads of malicious pickles: os.system, subprocess.Popen, builtins.eval, runpy...):
# no placeholder flag is offered for a pickle naming one, whatever else it holds.
_DANGEROUS_MODULES = frozenset((
    "os", "posix", "nt", "subprocess", "sys", "importlib", "runpy", "shutil", "socket", "ctypes", "pickle", "_pickle",
    "marshal", "code", "codeop", "pty", "webbrowser", "types", "operator", "_operator", "functools", "multiprocessing",
    "asyncio", "signal", "pathlib", "io", "_io", "urllib", "http", "ftplib", "smtplib", "platform", "commands",
    "pdb", "bdb", "timeit", "trace", "profile", "cProfile", "threading", "_thread", "zipimport", "pkgutil",
    "inspect", "gc", "dill", "cloudpickle", "posixpath", "ntpath", "tempfile", "glob", "requests", "yaml",
))
_DANGEROUS_BUILTINS = frozenset((
    "eval", "exec", "compile", "__import__", "getattr", "setattr", "delattr", "open", "globals", "locals", "vars",
    "input", "breakpoint", "exit", "quit", "help", "memoryview", "__build_class__", "__loader__",
))


def dangerous(qualname: str) -> bool:
    """Whether the global ``module.name`` runs commands, code or I/O when called (never plain data)."""
    module, _, name = qualname.rpartition(".")
    top = module.split(".", 1)[0]
    if top in ("builtins", "__builtin__"):
        return name in _DANGEROUS_BUILTINS
    return top in _DANGEROUS_MODULES


def dangerous_hint(bad: list[str]) -> str:
    """What a pickle naming the dangerous globals ``bad`` is, with no flag to paste."""
    names = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    return (f"{names} runs commands or code when called: a pickle naming it is made to act when it is loaded, "
            "not to hold weights; packer read nothing from it and no flag reads it; never open it with torch.load "
            f"or pickle, and get the weights from a source you trust (see {TROUBLESHOOTING})")


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
    flags = " ".join(f"--allow-global {shell_word(q)}" for q in shown)
    every = f" ({len(refused)} in this pickle: {', '.join(shown)}{more})" if len(refused) > 1 else ""
    head = f"{where}: global {qual} is not allowed{every}; packer never imports or calls anything"
    if bad := [q for q in refused if dangerous(q)]:  # a payload: said so, and no flag offered for anything
        return PayloadError(f"{head}; {dangerous_hint(bad)}")
    subclass = _subclass_message(where, refused)
    if subclass is not None:
        return DisallowedGlobalError(subclass)
    module = module_refusal(where, value)
    if module is not None:
        return DisallowedGlobalError(module)
    if isinstance(value, Placeholder) and (kind := type_name(value)):  # one object: say which, before any flag
        head = (f"{where}: holds one {kind} object, not a dict of tensors: no model weights at its top "
                f"(global {qual} is not allowed{every})")
    found = _state_dict_key(value)

    key = f"--key {shell_word(found)} " if found and any(q.startswith("torch.nn.") for q in refused) else ""
    beside = "; torch.nn objects sit beside the state dict" if key else ""
    return DisallowedGlobalError(f"{head}{beside}; if these are plain data, read them as inert placeholders "
                                 f"with: {key}{flags} (recipe: weights.allow_globals; see {TROUBLESHOOTING})")
