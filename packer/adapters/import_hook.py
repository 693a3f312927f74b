"""Run a function once a module is imported, in the processes that import it, and only there.

vLLM loads its general plugins in every process it starts (the caller or API server, the
engine core, each worker), but each needs only part of packer's hooks: the model loader is
looked up in workers, the engine arguments are turned into a configuration in the front end.
Importing ``vllm.model_executor.model_loader`` or ``vllm.engine.arg_utils`` just to hook them
cost a process that never uses them up to 0.8 CPU-s of imports (measured on vLLM 0.32's CPU
build: benchmarks/RESULTS.md). :func:`when_imported` hooks a module where it is imported
anyway, right after its own code ran, and not at all where it is not.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_PENDING: dict[str, list[Callable[[], None]]] = {}


def when_imported(name: str, fn: Callable[[], None]) -> None:
    """Call ``fn()`` now if module ``name`` is imported, else right after its import completes.

    ``fn`` runs once per process, in the importing thread; an exception from it propagates
    to the import (callers that must never fail catch their own).
    """
    if name in sys.modules:
        fn()
        return
    _PENDING.setdefault(name, []).append(fn)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader the other finders give a pending module."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _PENDING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _After(spec.loader, fullname)
                return spec
        return None


class _After(importlib.abc.Loader):
    """The module's own loader, then the functions waiting for it."""

    def __init__(self, inner: Any, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._inner.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        for fn in _PENDING.pop(self._name, []):
            fn()

    def __getattr__(self, attr: str) -> Any:  # get_resource_reader, get_filename, is_package...
        return getattr(self._inner, attr)
