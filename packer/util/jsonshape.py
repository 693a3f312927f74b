"""JSON documents from inputs, parsed with bounds and checked against a declared shape.

A shape is data: :class:`Obj` (required and optional keys; other keys pass through, as the
OCI specs allow extensions), :class:`ListOf`, :class:`MapOf`, :class:`Nullable` and leaf
checks (:data:`STR`, :data:`SIZE`, :func:`leaf`). :func:`check_shape` walks a parsed
document once against it; the first fault becomes one line naming the file, the JSON path
(``manifests[0].digest``) and what was expected. Documents are parsed with their bounds by
:func:`packer.reading.parse_json`, which takes a shape too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from packer.util.idents import ErrorClass, shown


class Shape(Protocol):
    @property
    def expected(self) -> str:
        """What a well-formed value is, for a message ("an array of strings")."""

    def fault(self, value: Any, path: str) -> tuple[str, str, Any] | None:
        """``(path, expected, value)`` of the first fault in ``value``, or None."""


@dataclass(frozen=True)
class Leaf:
    """A scalar check: ``test(value)`` true means well-formed."""

    expected: str
    test: Callable[[Any], bool]

    def fault(self, value: Any, path: str) -> tuple[str, str, Any] | None:
        return None if self.test(value) else (path, self.expected, value)


def leaf(expected: str, test: Callable[[Any], bool]) -> Leaf:
    """A scalar shape described by ``expected`` ("a digest like sha256:<64 hex>")."""
    return Leaf(expected, test)


STR = leaf("a string", lambda v: isinstance(v, str))
BOOL = leaf("true or false", lambda v: isinstance(v, bool))
INT = leaf("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool))
SIZE = leaf("a size in bytes (an integer from 0 to 2**53)",
            lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 2**53)
ANY = leaf("any value", lambda v: True)


@dataclass(frozen=True)
class Nullable:
    """``shape`` or JSON ``null`` (Docker writes ``"Cmd": null``)."""

    shape: Shape

    @property
    def expected(self) -> str:
        return f"{self.shape.expected} or null"

    def fault(self, value: Any, path: str) -> tuple[str, str, Any] | None:
        found = None if value is None else self.shape.fault(value, path)
        return (path, self.expected, value) if found and found[0] == path else found


@dataclass(frozen=True)
class ListOf:
    """A JSON array whose every item has shape ``item``."""

    item: Shape
    expected: str = "an array"

    def fault(self, value: Any, path: str) -> tuple[str, str, Any] | None:
        if not isinstance(value, list):
            return path, self.expected, value
        return next((f for i, v in enumerate(value) if (f := self.item.fault(v, f"{path}[{i}]"))), None)


@dataclass(frozen=True)
class MapOf:
    """A JSON object whose every value has shape ``value`` (annotations, labels)."""

    value: Shape
    expected: str = "an object"

    def fault(self, value: Any, path: str) -> tuple[str, str, Any] | None:
        if not isinstance(value, dict):
            return path, self.expected, value
        return next((f for k, v in value.items() if (f := self.value.fault(v, _key(path, k)))), None)


@dataclass(frozen=True)
class Obj:
    """A JSON object with ``required`` and ``optional`` keys; other keys are not checked."""

    required: Mapping[str, Shape] = field(default_factory=dict)
    optional: Mapping[str, Shape] = field(default_factory=dict)
    expected: str = "an object"

    def fault(self, value: Any, path: str) -> tuple[str, str, Any] | None:
        if not isinstance(value, dict):
            return path, self.expected, value
        for key, shape in self.required.items():
            if key not in value:
                return _key(path, key), f"{shape.expected} (required)", _MISSING
            if f := shape.fault(value[key], _key(path, key)):
                return f
        return next((f for key, shape in self.optional.items()
                     if key in value and (f := shape.fault(value[key], _key(path, key)))), None)


class _Missing:
    pass


_MISSING = _Missing()


def _key(path: str, key: str) -> str:
    part = f".{key}" if re.fullmatch(r"[A-Za-z_]\w*", key) else f"[{json.dumps(key)}]"
    return (path + part).lstrip(".") if path else part.lstrip(".")


def described(value: Any) -> str:
    """What a JSON value is, for a message: ``a list``, ``the number 12``, ``'x'``."""
    if value is _MISSING:
        return "nothing"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return f"the number {shown(value, 40)}"
    if isinstance(value, str):
        return f"the string {shown(value, 60)}"
    return "an array" if isinstance(value, list) else "an object"


def check_shape(doc: Any, shape: Shape, *, where: str, error: ErrorClass) -> None:
    """Raise ``error`` naming ``where``, the JSON path and what was expected at the first fault."""
    if f := shape.fault(doc, ""):
        path, expected, value = f
        raise error(f"{where}: {path or 'top level'}: expected {expected}, got {described(value)}")
