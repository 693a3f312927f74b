"""Plain-data objects beside the weights, kept as inert placeholders.

Training checkpoints keep hyper-parameters and metrics next to the state dict: a Lightning
``AttributeDict``, a numpy float64, a numpy array, an ``argparse.Namespace``, a ``datetime``.
The reader never imports or calls anything, so such an object can travel through it as a
:class:`Placeholder`: the global that named its type, the arguments and state the pickle gave
it, nothing more. A placeholder is never called, never used as a callable and never looked
inside for tensors to convert; it is reported (``packer inspect``, conversion notes) and left
out of the output.

There are two allowlists. :data:`PLACEHOLDER_TYPES` (here) plus the user's
``--allow-global`` patterns name types that become placeholders; the tensor machinery in
:mod:`packer.checkpoint.allowlist` names the few torch globals whose ``REDUCE`` builds a value
by a rule of :mod:`packer.checkpoint.tree`.
Any other global is refused.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field

from packer.checkpoint.tree import Global, PickleDict, named_walk

_NUMPY = ("numpy.core.multiarray", "numpy._core.multiarray")
_LIGHTNING = (
    "lightning.fabric.utilities.data", "lightning_fabric.utilities.data",
    "pytorch_lightning.utilities.parsing", "lightning.pytorch.utilities.parsing",
)
_PATHS = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")

# Types whose pickled form is a dict (SETITEMS on the new object): placeholders that are dicts.
DICT_TYPES: frozenset[tuple[str, str]] = frozenset(
    {("collections", "defaultdict"), ("collections", "Counter")} | {(m, "AttributeDict") for m in _LIGHTNING}
)
# Types whose pickled form is a list (APPENDS on the new object).
LIST_TYPES: frozenset[tuple[str, str]] = frozenset({("collections", "deque")})
PLACEHOLDER_TYPES: frozenset[tuple[str, str]] = frozenset(
    DICT_TYPES | LIST_TYPES
    | {(m, n) for m in _NUMPY for n in ("scalar", "_reconstruct")}
    | {(m, "_frombuffer") for m in ("numpy.core.numeric", "numpy._core.numeric")}  # protocol 5 arrays
    | {("numpy", "ndarray"), ("numpy", "dtype"), ("argparse", "Namespace"), ("collections", "ChainMap")}
    | {("datetime", n) for n in ("date", "time", "datetime", "timedelta", "timezone")}
    | {(m, n) for m in ("pathlib", "pathlib._local") for n in _PATHS}
    | {(b, n) for b in ("builtins", "__builtin__") for n in ("complex", "slice")}
    # admitted by torch's own weights-only loader by default: a device names where, holds nothing
    | {("torch", "device")}
)
# Plain types that appear only as arguments (a defaultdict's factory, copyreg's base class);
# they are never reduced, and so never called even in spirit.
INERT_VALUES: frozenset[tuple[str, str]] = frozenset(
    (b, n) for b in ("builtins", "__builtin__")
    for n in ("object", "int", "float", "str", "bytes", "bool", "list", "dict", "tuple")
)


@dataclass(eq=False)
class Placeholder:
    """An object of an allowed plain-data type, never built: its type, arguments and state.

    ``items`` and ``dict_items`` hold what APPENDS / SETITEMS added to it (a user type that
    subclasses list or dict); nothing in them is looked at.
    """

    type: Global
    args: tuple[object, ...] = ()
    state: object = None
    items: list[object] = field(default_factory=list)
    dict_items: dict[object, object] = field(default_factory=dict)

    def __repr__(self) -> str:  # bounded: the arguments may be a hostile graph
        return f"<{self.type.qualname} placeholder>"


class PlaceholderDict(PickleDict):
    """A dict-like placeholder (AttributeDict, defaultdict, Counter): a container of its items."""

    def __init__(self, type_: Global, args: tuple[object, ...] = ()) -> None:
        super().__init__()
        self.type = type_
        self.args = args


class PlaceholderList(list[object]):
    """A list-like placeholder (deque): a container of its items."""

    state: object = None

    def __init__(self, type_: Global, args: tuple[object, ...] = ()) -> None:
        super().__init__()
        self.type = type_
        self.args = args


AnyPlaceholder = Placeholder | PlaceholderDict | PlaceholderList


class GlobalPolicy:
    """Which globals a pickle may name, and which of them become placeholders.

    Args:
        callables: globals whose REDUCE builds a value by rule (the tensor machinery).
        values: globals accepted only as inert values (dtypes, storage types).
        placeholder_types: exact (module, name) pairs that become placeholders.
        patterns: the user's ``--allow-global`` patterns (fnmatch on ``module.name``).
    """

    def __init__(self, *, callables: frozenset[tuple[str, str]], values: frozenset[tuple[str, str]],
                 placeholder_types: frozenset[tuple[str, str]] = PLACEHOLDER_TYPES,
                 patterns: Sequence[str] = ()) -> None:
        self.callables = callables
        self.values = values | (INERT_VALUES if placeholder_types else frozenset())
        self.placeholder_types = placeholder_types
        self.patterns = tuple(patterns)
        self._user: dict[tuple[str, str], bool] = {}

    def allowed(self, key: tuple[str, str]) -> bool:
        return key in self.callables or key in self.values or self.is_placeholder(key)

    def is_placeholder(self, key: tuple[str, str]) -> bool:
        """True for a placeholder type: built-in allowlist or a user pattern (not tensor machinery)."""
        if key in self.placeholder_types:
            return True
        if not self.patterns or key in self.callables or key in self.values:
            return False
        hit = self._user.get(key)
        if hit is None:
            qual = f"{key[0]}.{key[1]}"
            hit = self._user[key] = any(fnmatch.fnmatchcase(qual, p) for p in self.patterns)
        return hit


def make_placeholder(cls: Global, args: tuple[object, ...]) -> AnyPlaceholder:
    """The inert stand-in for ``cls(*args)`` or ``cls.__new__(cls, *args)``; nothing is called.

    O(1): the arguments are kept by reference, never copied (a memoised list reduced a million
    times must not cost a million copies). Items added by SETITEMS / APPENDS land in the
    placeholder itself.
    """
    if cls.key in DICT_TYPES:
        return PlaceholderDict(cls, args)
    if cls.key in LIST_TYPES:
        return PlaceholderList(cls, args)
    return Placeholder(cls, args)


def type_name(value: object) -> str | None:
    """``module.name`` of a placeholder's type; None for anything else."""
    if isinstance(value, Placeholder | PlaceholderDict | PlaceholderList):
        module = "builtins" if value.type.module == "__builtin__" else value.type.module  # protocol-2 spelling
        return f"{module}.{value.type.name}"
    return None


MAX_LISTED = 1000


def find_placeholders(root: object, *, where: object, limit: int = MAX_LISTED) -> list[tuple[str, str]]:
    """(dotted path, type) of the placeholders under ``root`` (and inside dict- or list-like
    ones), the first ``limit`` in walk order.

    Each container is visited once (iteratively), so shared or cyclic graphs cost their size.

    Raises:
        CheckpointError: over the caps of :func:`packer.checkpoint.tree.named_walk` (``where``
            names the file).
    """
    found: list[tuple[str, str]] = []
    for name, node, _ in named_walk(root, lambda _: True, where=where):
        kind = type_name(node)
        if kind is not None:
            found.append((name, kind))
            if len(found) >= limit:
                break
    return found
