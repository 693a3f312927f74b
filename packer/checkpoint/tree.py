"""The inert values a restricted pickle produces, and the few rules that build them.

A torch checkpoint's pickle names a handful of torch functions and classes; here each is
only a :class:`Global` marker, and ``REDUCE`` on one of them builds a plain description
(:class:`TensorRef`, a dict, bytes) by rules written in this module. Nothing is imported.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from packer.checkpoint.allowlist import TENSOR_TYPES, TORCH_DTYPES, TORCH_UTILS
from packer.checkpoint.records import StorageRange
from packer.errors import CheckpointError


class _Short(reprlib.Repr):
    """reprlib by kind, not by exact type: a dict or list subclass is cut like a dict or list."""

    def repr1(self, x: object, level: int) -> str:
        if isinstance(x, dict) and type(x) is not dict:
            return self.repr_dict(x, level)
        if isinstance(x, list) and type(x) is not list:
            return self.repr_list(x, level)
        if isinstance(x, PickleSet):
            return "set(" + self.repr_list(x.items, level) + ")"
        return super().repr1(x, level)


_SHORT = _Short()  # Python 3.11's Repr takes no arguments: the limits are set one by one
_SHORT.maxlevel, _SHORT.maxtuple, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxset = 3, 4, 4, 4, 4
_SHORT.maxstring = _SHORT.maxother = 60


def short(value: object, limit: int = 80) -> str:
    """A bounded text of any unpickled value, for messages and names.

    ``str()`` of a hostile graph (lists sharing lists, 2**64 paths) would never finish;
    this looks at most a few levels and items deep.
    """
    return _SHORT.repr(value)[:limit]


_REBUILDS = frozenset({"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
                       "_rebuild_parameter_with_state"})


@dataclass(frozen=True)
class Global:
    """An inert reference to ``module.name``; never imported."""

    module: str
    name: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.module, self.name)

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(eq=False)
class PickleSet:
    """A set or frozenset from the pickle, kept as a list so nothing is hashed."""

    items: list[object]
    frozen: bool


class PickleDict(dict[object, object]):
    """An OrderedDict from the pickle; BUILD state (e.g. ``_metadata``) is kept aside."""

    state: object = None


@dataclass(eq=False)
class StorageRef:
    """A storage the pickle refers to by persistent id, located in the file by the caller."""

    key: str
    dtype: str  # torch dtype name of the storage's elements
    numel: int  # in elements of ``dtype``
    range: StorageRange


@dataclass(eq=False)
class TensorRef:
    """A tensor as the pickle describes it: a view of a storage, not yet checked."""

    storage: StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str  # torch dtype name
    extra: dict[str, object] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()  # Python attribute names the tensor carried, not converted


def _ints(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list):
        raise ValueError(f"{what} is not a tuple of integers")
    if len(value) > 64:
        raise ValueError(f"{what} has {len(value)} dimensions (at most 64)")
    for v in value:
        if type(v) is not int:
            raise ValueError(f"{what} is not a tuple of integers")
    return tuple(value)


def _tensor(args: tuple[object, ...], dtype: object = None) -> TensorRef:
    storage, offset, size, stride = args[:4]
    if not isinstance(storage, StorageRef):
        raise ValueError("first argument is not a storage")
    if type(offset) is not int:
        raise ValueError("storage offset is not an integer")
    name = storage.dtype
    if dtype is not None:
        if not isinstance(dtype, Global) or dtype.module != "torch" or dtype.name not in TORCH_DTYPES:
            raise ValueError("dtype argument is not a torch dtype")
        name = dtype.name
    return TensorRef(storage, offset, _ints(size, "size"), _ints(stride, "stride"), name)


def _build_set(args: tuple[object, ...], frozen: bool) -> PickleSet:
    if not args:
        return PickleSet([], frozen)
    if len(args) != 1 or not isinstance(args[0], list | tuple):
        raise ValueError("expects one list")
    return PickleSet(list(args[0]), frozen)


def _bytearray(args: tuple[object, ...]) -> bytes:
    if not args:
        return b""
    (value,) = args
    if isinstance(value, bytes):
        return value
    if isinstance(value, list) and all(type(v) is int and 0 <= v < 256 for v in value):
        return bytes(value)
    raise ValueError("expects bytes or a list of byte values")


def _ordered_dict(args: tuple[object, ...]) -> PickleDict:
    d = PickleDict()
    if not args:
        return d
    if len(args) != 1 or not isinstance(args[0], list):
        raise ValueError("expects no arguments or a list of pairs")
    for pair in args[0]:
        if not isinstance(pair, tuple | list) or len(pair) != 2 or not _plain(pair[0]):
            raise ValueError("expects (str, value) pairs")
        d[pair[0]] = pair[1]
    return d


def _plain(key: object) -> bool:
    return isinstance(key, str | int | float | bytes) or key is None


def _attribute_names(state: object) -> list[str]:
    # torch's _set_obj_state takes a dict or a (dict, slots) pair
    parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
    names: list[str] = []
    for part in parts:
        if isinstance(part, dict):
            names.extend(k if isinstance(k, str) else short(k) for k in part)
        elif part is not None:
            raise ValueError("state is not a dict or a (dict, slots) pair")
    return names


def _from_type(args: tuple[object, ...]) -> TensorRef:
    # torch pickles a tensor with Python attributes as _rebuild_from_type_v2(func, type, args,
    # state): the tensor is func(*args); the attributes are dropped and named in ``extra``.
    func, new_type, inner, state = args
    if not isinstance(func, Global) or func.module != TORCH_UTILS or func.name not in _REBUILDS:
        raise ValueError("first argument is not a torch tensor rebuild function")
    if not isinstance(new_type, Global) or new_type.key not in TENSOR_TYPES:
        raise ValueError("type argument is not torch.Tensor or torch.nn.Parameter")
    if not isinstance(inner, tuple):
        raise ValueError("rebuild arguments are not a tuple")
    ref = reduce_call(func, inner)
    if not isinstance(ref, TensorRef):
        raise ValueError("rebuild function did not describe a tensor")
    dropped = _attribute_names(state)
    if dropped:
        ref.dropped = tuple(dropped)
    return ref


def reduce_call(func: Global, args: tuple[object, ...]) -> object:
    """The value ``func(*args)`` stands for, built by rule; ValueError on bad arguments."""
    module, name = func.key
    n = len(args)
    if name == "OrderedDict":
        return _ordered_dict(args)
    if name == "_rebuild_tensor_v2" and n in (6, 7):
        return _tensor(args)
    if name == "_rebuild_tensor_v3" and n in (7, 8):
        return _tensor(args, dtype=args[6])
    if name == "_rebuild_tensor" and n == 4:
        return _tensor(args)
    if name in ("_rebuild_parameter", "_rebuild_parameter_with_state") and n in (3, 4):
        if not isinstance(args[0], TensorRef):
            raise ValueError("parameter data is not a tensor")
        if n == 4 and name == "_rebuild_parameter_with_state" and (dropped := _attribute_names(args[3])):
            args[0].dropped = tuple(dropped)
        return args[0]  # nn.Parameter unwraps to its tensor
    if name == "_rebuild_from_type_v2" and n == 4:
        return _from_type(args)
    if name == "Size" and n == 1:
        return _ints(args[0], "size")
    if name == "encode" and n == 2:
        text, encoding = args
        if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
            raise ValueError("expects (str, 'latin1')")
        try:
            return text.encode("latin-1")
        except UnicodeEncodeError:
            raise ValueError("text is not latin-1") from None
    if name in ("set", "frozenset") and n <= 1:
        return _build_set(args, frozen=name == "frozenset")
    if name == "bytearray" and n <= 1:
        return _bytearray(args)
    raise ValueError(f"unexpected {n} arguments")


def children(node: object) -> list[tuple[str, object]] | None:
    """Named children of a dict, list or tuple; None for anything else."""
    if isinstance(node, dict):
        return [(k if isinstance(k, str) else short(k), v) for k, v in node.items()]
    if isinstance(node, list | tuple):
        return [(str(i), v) for i, v in enumerate(node)]
    return None


_COUNT_CAP = 10**12


def tensor_counts(root: object) -> dict[int, int]:
    """Tensors under each container of ``root``, by ``id``, in one iterative pass.

    Shared containers are counted once per path (capped) and cycles are cut, so hostile
    graphs cost time linear in their size.
    """
    counts: dict[int, int] = {}
    open_: set[int] = set()
    todo: list[tuple[object, bool]] = [(root, False)]
    while todo:
        node, finished = todo.pop()
        kids = children(node)
        if kids is None:
            continue
        if finished:
            total = sum(1 if isinstance(v, TensorRef) else counts.get(id(v), 0) for _, v in kids)
            counts[id(node)] = min(total, _COUNT_CAP)
            open_.discard(id(node))
            continue
        if id(node) in counts or id(node) in open_:
            continue
        open_.add(id(node))
        todo.append((node, True))
        todo.extend((v, False) for _, v in kids if isinstance(v, dict | list | tuple))
    return counts


# The VM caps MARK nesting at 1000; nesting built without MARK (EMPTY_LIST ... APPEND) is
# capped here, at the same depth, by every walk that names entries.
MAX_DEPTH = 1_000
# Characters of dotted names one walk may build: far above any real checkpoint (a million
# 60-character names), far below what a hostile chain of long keys would make.
MAX_NAME_CHARS = 64 * 2**20


def named_walk(root: object, expand: Callable[[object], bool], *,
               where: object) -> Iterator[tuple[str, object, bool]]:
    """Walk ``root`` depth first in document order, naming every node by its dotted path.

    Yields ``(name, node, first)`` for ``root`` (name ``""``) and for the children of each
    container that ``expand`` accepts; every container is expanded once, and ``first`` is
    False when a container is reached again (shared, or a cycle). Each name is built once,
    from its parent's, so the walk costs time and memory linear in the tree and the names.

    Raises:
        CheckpointError: nesting deeper than :data:`MAX_DEPTH`, or names longer than
            :data:`MAX_NAME_CHARS` in all (``where`` names the file).
    """
    seen: set[int] = set()
    budget = MAX_NAME_CHARS
    todo: list[tuple[str, str, object, int]] = [("", "", root, 0)]
    while todo:
        prefix, key, node, depth = todo.pop()
        name = f"{prefix}.{key}" if prefix else key
        budget -= len(name)
        if budget < 0:
            raise CheckpointError(f"{where}: the entries' dotted names exceed {MAX_NAME_CHARS} characters "
                                  "(cap); this is not the tree of a model checkpoint")
        kids = children(node)
        first = kids is None or id(node) not in seen
        yield name, node, first
        if kids is None or not first:
            continue
        seen.add(id(node))
        if not expand(node):
            continue
        if kids and depth >= MAX_DEPTH:
            shown = name if len(name) <= 60 else f"{name[:60]}…"
            raise CheckpointError(f"{where}: entry {shown}: nested deeper than {MAX_DEPTH} levels (cap); "
                                  "a checkpoint's tensors sit a few levels deep: re-save it without this entry")
        todo.extend((name, k, v, depth + 1) for k, v in reversed(kids))
