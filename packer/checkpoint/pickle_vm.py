"""A restricted pickle VM: reads the opcodes torch writes, imports nothing, calls nothing.

Globals become inert :class:`Global` markers, and only those on an exact allowlist are
accepted; ``REDUCE`` on an allowed marker builds a plain value (dict, bytes, a tensor
description) by rules written in :mod:`packer.checkpoint.tree`, never by calling the named
object. A second allowlist (:mod:`packer.checkpoint.placeholders`, plus the user's
``--allow-global`` patterns) names plain-data types: ``REDUCE`` or ``NEWOBJ`` on one of them
yields an inert :class:`Placeholder` that records its arguments and is never called.

Every length the input declares is checked against the bytes that remain before anything is
allocated, and memo size, stack size, MARK depth, the number of opcodes and the work REDUCE
rules do on their arguments are capped.
"""

from __future__ import annotations

import encodings.raw_unicode_escape  # noqa: F401 - loaded now so reading imports nothing
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from packer.checkpoint.allowlist import CALLABLES, UNCONVERTED, VALUE_GLOBALS
from packer.checkpoint.placeholders import (
    GlobalPolicy,
    Placeholder,
    PlaceholderList,
    make_placeholder,
)
from packer.checkpoint.tree import (
    Global,
    PickleDict,
    PickleSet,
    reduce_call,
)
from packer.errors import CheckpointError, DisallowedGlobalError, PayloadError, TruncatedPickle, UnsafeInputError
from packer.util.show import shell_word

PersistentLoad = Callable[[object], object]
_PYTHON_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
_NO_ENCODING = "utf-8"


@dataclass(frozen=True)
class Limits:
    """Caps that keep a hostile pickle from using more than bounded time and memory."""

    max_ops: int = 10_000_000
    max_memo: int = 2_000_000
    max_stack: int = 2_000_000
    max_mark_depth: int = 1_000
    max_line: int = 4_096
    max_long_bytes: int = 256


DEFAULT_LIMITS = Limits()
DEFAULT_POLICY = GlobalPolicy(callables=CALLABLES, values=VALUE_GLOBALS)
NO_GLOBALS = GlobalPolicy(callables=frozenset(), values=frozenset(), placeholder_types=frozenset())


def policy_for(allow_globals: Sequence[str] = ()) -> GlobalPolicy:
    """The default policy plus the user's ``--allow-global`` patterns (``module.Name``, fnmatch)."""
    if not allow_globals:
        return DEFAULT_POLICY
    return GlobalPolicy(callables=CALLABLES, values=VALUE_GLOBALS, patterns=allow_globals)


# copyreg._reconstructor(cls, base, state): how protocols 0 and 1 pickle a plain object.
_RECONSTRUCTORS = frozenset({("copyreg", "_reconstructor"), ("copy_reg", "_reconstructor")})

# Opcodes that build arbitrary objects or reach outside the pickle: refused outright.
_REFUSED = {
    0x6F: "OBJ",
    0x82: "EXT1",
    0x83: "EXT2",
    0x84: "EXT4",
    0x97: "NEXT_BUFFER",
    0x98: "READONLY_BUFFER",
    0x50: "PERSID",
    0x53: "STRING",
}


class PickleVM:
    """One run over one pickle in ``data`` starting at ``start``."""

    def __init__(
        self,
        data: bytes,
        *,
        where: str,
        start: int = 0,
        persistent_load: PersistentLoad | None = None,
        policy: GlobalPolicy = DEFAULT_POLICY,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self.data = data
        self.where = where
        self.pos = start
        self.op_pos = start
        self.frame_end: int | None = None
        self.persistent_load = persistent_load
        self.policy = policy
        self.limits = limits
        self.stack: list[object] = []
        self.metastack: list[list[object]] = []
        self.memo: dict[int, object] = {}
        self.handlers: dict[int, Callable[[], None]] = _handler_table(self)
        self.done = False
        self.work = 0  # argument elements walked by REDUCE rules, capped like opcodes

    # -- errors and input -------------------------------------------------------------
    def fail(self, reason: str) -> CheckpointError:
        return CheckpointError(f"{self.where} at byte {self.op_pos}: {reason}")

    def unsafe(self, reason: str) -> UnsafeInputError:
        return UnsafeInputError(f"{self.where} at byte {self.op_pos}: {reason}")

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            left = len(self.data) - self.pos
            raise TruncatedPickle(
                f"{self.where} at byte {self.op_pos}: declares {n} bytes but only {left} remain (truncated pickle)"
            )
        if self.frame_end is not None and self.pos < self.frame_end < end:
            raise self.fail("a read crosses the end of its FRAME (frame length disagrees)")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def take1(self) -> int:
        # The hot path: one byte cannot straddle a frame end, so only the bounds matter.
        pos = self.pos
        if pos >= len(self.data):
            return self.take(1)[0]  # raises TruncatedPickle
        self.pos = pos + 1
        return self.data[pos]

    def readline(self) -> bytes:
        stop = min(len(self.data), self.pos + self.limits.max_line)
        nl = self.data.find(b"\n", self.pos, stop)
        if nl < 0 and stop == len(self.data):
            self.take(len(self.data) + 1 - self.pos)  # raises TruncatedPickle
        if nl < 0:
            raise self.fail("text argument without newline (or longer than the line cap)")
        return self.take(nl + 1 - self.pos)[:-1]

    def pop(self) -> object:
        if not self.stack:
            raise self.fail("stack underflow")
        return self.stack.pop()

    def pop_mark(self) -> list[object]:
        if not self.metastack:
            raise self.fail("no MARK to pop to")
        items = self.stack
        self.stack = self.metastack.pop()
        return items

    def push(self, value: object) -> None:
        self.stack.append(value)

    # -- run --------------------------------------------------------------------------
    def run(self) -> tuple[object, int]:
        """Execute until STOP; return the value and the offset just after STOP."""
        ops, max_ops, max_stack, handlers = 0, self.limits.max_ops, self.limits.max_stack, self.handlers
        while not self.done:
            ops += 1
            if ops > max_ops:
                raise self.fail(f"more than {max_ops} opcodes (cap)")
            if self.frame_end is not None and self.pos == self.frame_end:
                self.frame_end = None
            self.op_pos = self.pos
            code = self.take1()
            handler = handlers.get(code)
            if handler is None:
                if code in _REFUSED:
                    raise self.unsafe(f"opcode {_REFUSED[code]} is not allowed")
                raise self.fail(f"unknown opcode 0x{code:02x}")
            handler()
            if len(self.stack) > max_stack:
                raise self.fail(f"stack deeper than {max_stack} (cap)")
        if self.frame_end is not None and self.pos != self.frame_end:
            raise self.fail("STOP before the end of its FRAME (frame length disagrees)")
        if self.metastack or len(self.stack) != 1:
            raise self.fail("STOP with an unbalanced stack")
        return self.pop(), self.pos

    # -- handlers ---------------------------------------------------------------------
    def op_proto(self) -> None:
        if self.take(1)[0] > 5:
            raise self.fail("pickle protocol above 5")

    def op_frame(self) -> None:
        if self.frame_end is not None:
            raise self.fail("FRAME before the end of the previous frame")
        (n,) = struct.unpack("<Q", self.take(8))
        if n > len(self.data) - self.pos:
            left = len(self.data) - self.pos
            raise TruncatedPickle(
                f"{self.where} at byte {self.op_pos}: FRAME declares {n} bytes but only {left} remain"
            )
        self.frame_end = self.pos + n if n else None

    def op_stop(self) -> None:
        self.done = True

    def op_mark(self) -> None:
        if len(self.metastack) >= self.limits.max_mark_depth:
            raise self.fail(f"MARK nested deeper than {self.limits.max_mark_depth} (cap)")
        self.metastack.append(self.stack)
        self.stack = []

    def op_pop(self) -> None:
        if self.stack:
            self.stack.pop()
        else:
            self.pop_mark()

    def op_pop_mark(self) -> None:
        self.pop_mark()

    def op_dup(self) -> None:
        if not self.stack:
            raise self.fail("stack underflow")
        self.push(self.stack[-1])

    def op_int(self) -> None:
        line = self.readline()
        if line in (b"00", b"01"):
            self.push(line == b"01")
        else:
            self.push(self._parse_int(line.rstrip(b"L")))

    def op_long(self) -> None:
        self.push(self._parse_int(self.readline().rstrip(b"L")))

    def _parse_int(self, text: bytes) -> int:
        if len(text) > 2 * self.limits.max_long_bytes:
            raise self.fail("integer literal longer than the cap")
        try:
            return int(text)
        except ValueError:
            raise self.fail(f"bad integer literal {text[:40]!r}") from None

    def op_float(self) -> None:
        try:
            self.push(float(self.readline()))
        except ValueError:
            raise self.fail("bad float literal") from None

    def op_long_n(self, width: int) -> None:
        (n,) = struct.unpack("<B" if width == 1 else "<i", self.take(width))
        if n < 0 or n > self.limits.max_long_bytes:
            raise self.fail(f"LONG of {n} bytes (cap {self.limits.max_long_bytes})")
        self.push(int.from_bytes(self.take(n), "little", signed=True))

    def op_text(self, fmt: str, kind: str) -> None:
        size = struct.calcsize(fmt)
        (n,) = struct.unpack(fmt, self.take(size))
        raw = self.take(n)
        if kind == "bytes":
            self.push(raw)
            return
        try:
            self.push(raw.decode(_NO_ENCODING, "surrogatepass"))
        except UnicodeDecodeError:
            raise self.fail("string is not valid UTF-8") from None

    def op_unicode(self) -> None:
        try:
            self.push(self.readline().decode("raw-unicode-escape"))
        except UnicodeDecodeError:
            raise self.fail("bad UNICODE literal") from None

    def op_tuple_n(self, n: int) -> None:
        if len(self.stack) < n:
            raise self.fail("stack underflow")
        items = [self.pop() for _ in range(n)][::-1]
        self.push(tuple(items))

    def op_tuple(self) -> None:
        self.push(tuple(self.pop_mark()))

    def op_list(self) -> None:
        self.push(list(self.pop_mark()))

    def op_dict(self) -> None:
        d: dict[object, object] = {}
        self._set_items(d, self.pop_mark())
        self.push(d)

    def op_frozenset(self) -> None:
        self.push(PickleSet(self.pop_mark(), frozen=True))

    def op_append(self) -> None:
        value = self.pop()
        self._list_target("APPEND").append(value)

    def op_appends(self) -> None:
        items = self.pop_mark()
        self._list_target("APPENDS").extend(items)

    def op_newobj(self, ex: bool) -> None:
        kwargs = self.pop() if ex else {}
        args, cls = self.pop(), self.pop()
        op = "NEWOBJ_EX" if ex else "NEWOBJ"
        if not isinstance(cls, Global) or not self.policy.is_placeholder(cls.key):
            shown = cls.qualname if isinstance(cls, Global) else type(cls).__name__
            raise self.unsafe(f"opcode {op} is not allowed on {shown} (only plain-data placeholder types)")
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise self.fail(f"{op} arguments for {cls.qualname} are not a tuple and a dict")
        self.push(make_placeholder(cls, args))

    def op_setitem(self) -> None:
        value, key = self.pop(), self.pop()
        self._set_items(self._dict_target("SETITEM"), [key, value])

    def op_setitems(self) -> None:
        items = self.pop_mark()
        self._set_items(self._dict_target("SETITEMS"), items)

    def _list_target(self, op: str) -> list[object]:
        target = self.stack[-1] if self.stack else None
        if isinstance(target, Placeholder):  # a list subclass allowed by the user: kept aside
            return target.items
        if not isinstance(target, list):
            raise self.unsafe(f"{op} on {type(target).__name__} (only lists allowed)")
        return target

    def _dict_target(self, op: str) -> dict[object, object]:
        target = self.stack[-1] if self.stack else None
        if isinstance(target, Placeholder):  # a dict subclass allowed by the user: kept aside
            return target.dict_items
        if not isinstance(target, dict):
            raise self.unsafe(f"{op} on {type(target).__name__} (only dicts allowed)")
        return target

    def _set_items(self, d: dict[object, object], items: list[object]) -> None:
        if len(items) % 2:
            raise self.fail("odd number of items for a dict")
        for i in range(0, len(items), 2):
            key = items[i]
            if not _plain_key(key):
                raise self.fail(f"dict key of type {type(key).__name__} is not supported")
            d[key] = items[i + 1]

    def op_additems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1] if self.stack else None
        if not isinstance(target, PickleSet) or target.frozen:
            raise self.unsafe(f"ADDITEMS on {type(target).__name__} (only sets allowed)")
        target.items.extend(items)

    def op_get(self, fmt: str | None) -> None:
        idx = self._memo_index(fmt)
        if idx not in self.memo:
            raise self.fail(f"memo key {idx} not defined")
        self.push(self.memo[idx])

    def op_put(self, fmt: str | None) -> None:
        self._memo_store(self._memo_index(fmt))

    def op_binput(self) -> None:
        self._memo_store(self.take1())

    def op_binget(self) -> None:
        idx = self.take1()
        try:
            self.stack.append(self.memo[idx])
        except KeyError:
            raise self.fail(f"memo key {idx} not defined") from None

    def op_memoize(self) -> None:
        self._memo_store(len(self.memo))

    def _memo_index(self, fmt: str | None) -> int:
        if fmt is None:
            return self._parse_int(self.readline())
        if fmt == "<B":
            return self.take1()
        return int(struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0])

    def _memo_store(self, idx: int) -> None:
        if not self.stack:
            raise self.fail("memo store with an empty stack")
        if idx not in self.memo and len(self.memo) >= self.limits.max_memo:
            raise self.fail(f"more than {self.limits.max_memo} memo entries (cap)")
        self.memo[idx] = self.stack[-1]

    def op_global(self) -> None:
        module = self._ascii(self.readline())
        name = self._ascii(self.readline())
        self.push(self._global(module, name))

    def op_inst(self) -> None:
        module = self._ascii(self.readline())
        name = self._ascii(self.readline())
        raise self.unsafe(f"global {module}.{name} is not allowed (opcode INST builds objects)")

    def op_stack_global(self) -> None:
        name, module = self.pop(), self.pop()
        if not isinstance(module, str) or not isinstance(name, str):
            raise self.fail("STACK_GLOBAL needs two strings")
        self.push(self._global(module, name))

    def _ascii(self, raw: bytes) -> str:
        try:
            return raw.decode("ascii")
        except UnicodeDecodeError:
            raise self.fail("global name is not ASCII") from None

    def _global(self, module: str, name: str) -> Global:
        key = (module, name)
        if not self.policy.allowed(key) and not (key in _RECONSTRUCTORS and self.policy.placeholder_types):
            qual = f"{module}.{name}"
            if key in UNCONVERTED:
                raise self.fail(f"{qual}: the checkpoint holds {UNCONVERTED[key]}")
            from packer.checkpoint.guidance import dangerous, dangerous_hint  # a refusal only: off the hot path

            kind = DisallowedGlobalError
            if not _PYTHON_NAME.match(qual):
                hint = "it is not a Python name, so no class can be allowed: this is not a checkpoint's pickle"
            elif dangerous(qual):
                kind = PayloadError
                hint = dangerous_hint([qual])
            elif module == "torch.nn" or module.startswith("torch.nn."):  # a whole pickled module
                hint = ("it is a pickled torch.nn module, not a state dict: save model.state_dict() "
                        "instead, or convert once in a trusted environment")
            elif self.policy.placeholder_types:
                hint = (f"if {qual} is plain data, allow it as an inert placeholder with "
                        f"--allow-global {shell_word(qual)} (recipe: weights.allow_globals)")
            else:
                hint = "this pickle may hold plain values only"
            raise kind(
                f"{self.where} at byte {self.op_pos}: global {qual} is not allowed; packer never imports or calls "
                f"anything and reads tensors, plain containers and known plain-data types; {hint}"
            )
        return Global(module, name)

    def op_reduce(self) -> None:
        args, func = self.pop(), self.pop()
        if isinstance(func, Global):
            key, policy = func.key, self.policy
            rule = key in policy.callables  # the hot path: tensor rebuilds
            if rule or key in _RECONSTRUCTORS or policy.is_placeholder(key):
                if not isinstance(args, tuple):
                    raise self.fail(f"REDUCE arguments for {func.qualname} are not a tuple")
                if rule:
                    self._charge(args)
                    try:
                        self.push(reduce_call(func, args))
                    except ValueError as e:
                        raise self.fail(f"{func.qualname}: {e}") from None
                elif key in _RECONSTRUCTORS:
                    self.push(self._reconstruct(args))
                else:  # a placeholder type: recorded with its arguments, never called
                    self.push(make_placeholder(func, args))
                return
        shown = func.qualname if isinstance(func, Global) else type(func).__name__
        raise self.unsafe(f"REDUCE on {shown} is not allowed")

    def _charge(self, args: tuple[object, ...]) -> None:
        # A rule may walk or copy its arguments (set(list), OrderedDict(pairs), encode(str)):
        # that work counts against the opcode cap, so a memoised argument reduced again and
        # again cannot cost quadratic time.
        work = 0
        for a in args:
            if isinstance(a, list | tuple | dict):
                work += len(a)
            elif isinstance(a, str | bytes):
                work += len(a) >> 10
        self.work += work
        if self.work > self.limits.max_ops:
            raise self.fail(f"more than {self.limits.max_ops} opcodes (cap), counting the work of REDUCE")

    def _reconstruct(self, args: tuple[object, ...]) -> object:
        cls = args[0] if len(args) == 3 else None
        if not isinstance(cls, Global) or not self.policy.is_placeholder(cls.key):
            shown = cls.qualname if isinstance(cls, Global) else type(cls).__name__
            raise self.unsafe(f"copyreg._reconstructor of {shown} is not allowed (only plain-data placeholder types)")
        return make_placeholder(cls, ())

    def op_build(self) -> None:
        state = self.pop()
        target = self.stack[-1] if self.stack else None
        # OrderedDict state (e.g. a state_dict's _metadata) is an attribute: kept aside, as is
        # a placeholder's; nothing is ever set on a real object.
        if not isinstance(target, PickleDict | Placeholder | PlaceholderList):
            raise self.unsafe(f"BUILD on {type(target).__name__} would set object state")
        target.state = state

    def op_binpersid(self) -> None:
        pid = self.pop()
        if self.persistent_load is None:
            raise self.unsafe("persistent id not allowed in this pickle")
        self.push(self.persistent_load(pid))


def _plain_key(key: object) -> bool:
    # Restricting keys keeps hashing cheap and shallow (a deep tuple key could exhaust the C stack).
    if isinstance(key, str | int | float | bytes) or key is None:
        return True
    if isinstance(key, tuple) and len(key) <= 16:
        return all(isinstance(k, str | int | float | bytes) or k is None for k in key)
    return isinstance(key, Global | Placeholder)


def _handler_table(vm: PickleVM) -> dict[int, Callable[[], None]]:
    t: dict[int, Callable[[], None]] = {
        0x80: vm.op_proto, 0x95: vm.op_frame, 0x2E: vm.op_stop, 0x28: vm.op_mark,
        0x30: vm.op_pop, 0x31: vm.op_pop_mark, 0x32: vm.op_dup,
        0x4E: lambda: vm.push(None), 0x88: lambda: vm.push(True), 0x89: lambda: vm.push(False),
        0x49: vm.op_int, 0x4C: vm.op_long, 0x46: vm.op_float,
        0x4A: lambda: vm.push(struct.unpack("<i", vm.take(4))[0]),
        0x4B: lambda: vm.stack.append(vm.take1()),
        0x4D: lambda: vm.push(struct.unpack("<H", vm.take(2))[0]),
        0x8A: lambda: vm.op_long_n(1), 0x8B: lambda: vm.op_long_n(4),
        0x47: lambda: vm.push(struct.unpack(">d", vm.take(8))[0]),
        0x58: lambda: vm.op_text("<I", "str"), 0x8C: lambda: vm.op_text("<B", "str"),
        0x8D: lambda: vm.op_text("<Q", "str"), 0x56: vm.op_unicode,
        0x54: lambda: vm.op_text("<I", "str"), 0x55: lambda: vm.op_text("<B", "str"),
        0x42: lambda: vm.op_text("<I", "bytes"), 0x43: lambda: vm.op_text("<B", "bytes"),
        0x8E: lambda: vm.op_text("<Q", "bytes"), 0x96: lambda: vm.op_text("<Q", "bytes"),
        0x29: lambda: vm.push(()), 0x74: vm.op_tuple, 0x85: lambda: vm.op_tuple_n(1),
        0x86: lambda: vm.op_tuple_n(2), 0x87: lambda: vm.op_tuple_n(3),
        0x5D: lambda: vm.push([]), 0x6C: vm.op_list, 0x61: vm.op_append, 0x65: vm.op_appends,
        0x7D: lambda: vm.push({}), 0x64: vm.op_dict, 0x73: vm.op_setitem, 0x75: vm.op_setitems,
        0x8F: lambda: vm.push(PickleSet([], frozen=False)), 0x90: vm.op_additems,
        0x91: vm.op_frozenset,
        0x67: lambda: vm.op_get(None), 0x68: vm.op_binget,
        0x6A: lambda: vm.op_get("<I"), 0x70: lambda: vm.op_put(None),
        0x71: vm.op_binput, 0x72: lambda: vm.op_put("<I"), 0x94: vm.op_memoize,
        0x63: vm.op_global, 0x93: vm.op_stack_global, 0x69: vm.op_inst,
        0x52: vm.op_reduce, 0x62: vm.op_build, 0x51: vm.op_binpersid,
        0x81: lambda: vm.op_newobj(False), 0x92: lambda: vm.op_newobj(True),
    }
    return t


def run_pickle(
    data: bytes,
    *,
    where: str,
    start: int = 0,
    persistent_load: PersistentLoad | None = None,
    policy: GlobalPolicy = DEFAULT_POLICY,
    limits: Limits = DEFAULT_LIMITS,
    to_end: bool = True,
) -> tuple[object, int]:
    """Run one pickle from ``data[start:]`` without importing or calling anything.

    Args:
        data: the bytes holding the pickle.
        where: ``"<file>: <member>"`` used as the start of every error message.
        start: offset of the pickle's first opcode.
        persistent_load: maps a persistent id to a value; None refuses persistent ids.
        policy: the globals accepted: tensor machinery, inert values and placeholder types.
        limits: caps on opcodes, memo, stack and MARK depth.
        to_end: require STOP to be the last byte of ``data`` (junk after STOP is an error).

    Returns:
        The unpickled value (plain containers and markers) and the offset after STOP.

    Raises:
        UnsafeInputError: a global, opcode or operation outside the allowlist.
        CheckpointError: malformed, truncated or over-cap input.
    """
    vm = PickleVM(
        data, where=where, start=start, persistent_load=persistent_load,
        policy=policy, limits=limits,
    )
    try:
        value, end = vm.run()
    except RecursionError:  # never expected: the VM is iterative; kept as a last guard
        raise vm.fail("structure nested too deeply") from None
    except DisallowedGlobalError as e:
        if not policy.placeholder_types:  # a pickle that may hold no objects at all: nothing to allow
            raise
        from packer.checkpoint.guidance import one_message, survey

        refused, whole = survey(PickleVM, data, where=where, start=start, persistent_load=persistent_load,
                                policy=policy, limits=limits)
        raise one_message(e, refused, whole) from None
    if to_end and end != len(data):
        raise CheckpointError(f"{where} at byte {end}: {len(data) - end} bytes of junk after STOP")
    return value, end
