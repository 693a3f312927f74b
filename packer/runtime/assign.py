"""``load_into`` by assignment: parameters left on ``meta`` become the loaded tensors.

Every tensor slot of the module (parameters, persistent and non-persistent buffers) is
grouped by identity, so tied names are one slot and end up as one tensor. A slot whose
tensor is on ``meta`` is assigned the loaded tensor (CPU: a view of the private mapping;
CUDA: a view of the per-shard device allocation); a real one is filled by copy. Keys naming
a non-persistent buffer are loaded into it when shape and dtype match, else skipped, and
noted either way; ``_keys_to_ignore_on_load_missing`` / ``_unexpected`` patterns (the
transformers convention) are honoured.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .env import DTYPES
from .timeline import Timeline, import_torch

if TYPE_CHECKING:
    from types import ModuleType

    import torch


class LoadResult(tuple):  # noqa: SLOT001
    """``(missing, unexpected)`` as ``load_state_dict`` reports them, plus ``notes``."""

    missing: list[str]
    unexpected: list[str]
    notes: list[str]

    def __new__(cls, missing: list[str], unexpected: list[str], notes: list[str]) -> LoadResult:
        self = super().__new__(cls, (missing, unexpected))
        self.missing, self.unexpected, self.notes = missing, unexpected, notes
        return self

    def __getnewargs__(self) -> tuple[list[str], list[str], list[str]]:
        return self.missing, self.unexpected, self.notes


class TensorSlot:
    """One tensor of the module under all the names (and owners) that reach it."""

    def __init__(self, tensor: torch.Tensor, kind: str) -> None:
        self.tensor = tensor
        self.kind = kind  # "param" | "buffer" | "transient" (a non-persistent buffer)
        self.names: list[str] = []
        self.owners: list[tuple[torch.nn.Module, str]] = []  # (submodule, attribute)
        self.key = ""  # the stored tensor that fills it ("" when none)


def module_slots(module: torch.nn.Module) -> list[TensorSlot]:
    """The module's parameters and buffers, one :class:`TensorSlot` per distinct tensor."""
    slots: dict[int, TensorSlot] = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        transient: set[str] = getattr(mod, "_non_persistent_buffers_set", set())
        items = [(n, t, "param") for n, t in mod._parameters.items()]
        items += [(n, t, "transient" if n in transient else "buffer") for n, t in mod._buffers.items()]
        for name, t, kind in items:
            if t is None:
                continue
            slot = slots.setdefault(id(t), TensorSlot(t, kind))
            if f"{dot}{name}" not in slot.names:
                slot.names.append(f"{dot}{name}")
                slot.owners.append((mod, name))
    return list(slots.values())


def _patterns(module: torch.nn.Module, attr: str) -> re.Pattern[str] | None:
    pats = [p for p in (getattr(module, attr, None) or ()) if p]
    return re.compile("|".join(f"(?:{p})" for p in sorted(pats))) if pats else None


def match_slots(module: torch.nn.Module, slots: list[TensorSlot], table: dict[str, Any],
                aliases: dict[str, str], key: Callable[[str], str] | None = None,
                ) -> tuple[list[str], list[str], list[str]]:
    """Set each slot's ``key``; return ``(missing, unexpected, notes)``.

    ``key`` maps a module name to the stored name it loads from (transformers' base-model
    prefix, :mod:`packer.runtime.hf_keys`); by default the names are the same.

    Raises:
        RuntimeError: a parameter or persistent buffer has another shape than its weight.
    """
    stored = set(table) | set(aliases)
    covered: set[str] = set()
    missing, notes = [], []
    for slot in slots:
        hits = [n for n in map(key, slot.names) if n in stored] if key else [n for n in slot.names if n in stored]
        covered.update(hits)
        if not hits:
            if slot.kind != "transient":
                missing += slot.names
            continue
        want = table[aliases.get(hits[0], hits[0])]
        shape = list(want.get("torch_shape", want["shape"]))  # packed float4: the header counts values
        if slot.kind == "transient":
            same = list(slot.tensor.shape) == shape and _code(slot.tensor) == want["dtype"]
            slot.key = aliases.get(hits[0], hits[0]) if same else ""
            notes.append(f"{hits[0]}: a non-persistent buffer of the module; "
                         + ("loaded into it" if same else f"skipped ({want['dtype']} {shape} "
                            f"against {_code(slot.tensor)} {list(slot.tensor.shape)})"))
            continue
        if list(slot.tensor.shape) != shape:
            raise RuntimeError(f"load_into: size mismatch for {hits[0]}: the weights have shape "
                               f"{shape}, the module {list(slot.tensor.shape)}")
        slot.key = aliases.get(hits[0], hits[0])
        notes += [f"{n}: tied to {hits[0]} in the module; loaded once" for n in slot.names
                  if (key(n) if key else n) not in stored]
        notes += [f"{n}: also stored, but the module ties it to {hits[0]}; loaded from {hits[0]}"
                  for n in hits[1:] if aliases.get(n, n) != slot.key]
    unexpected = sorted(stored - covered)
    for attr, keys in (("_keys_to_ignore_on_load_missing", missing),
                       ("_keys_to_ignore_on_load_unexpected", unexpected)):
        pat = _patterns(module, attr)
        if pat is not None and any(pat.search(k) for k in keys):
            notes.append(f"{attr} ignores {sorted(k for k in keys if pat.search(k))[:8]}")
            keys[:] = [k for k in keys if not pat.search(k)]
    return sorted(missing), unexpected, notes


# torch dtype name -> safetensors code: the loader's own table, read backwards
_CODES = {name: code for code, (name, _) in DTYPES.items()}


def _code(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    return _CODES.get(name, name)


def _set(slot: TensorSlot, value: torch.Tensor) -> None:
    """Make every owner of ``slot`` hold ``value`` (a Parameter when the slot is one)."""
    torch = import_torch()
    if slot.kind == "param" and not isinstance(value, torch.nn.Parameter):
        value = torch.nn.Parameter(value, requires_grad=slot.tensor.requires_grad)
    for mod, name in slot.owners:
        if isinstance(value, torch.nn.Parameter):
            mod._parameters[name] = value
        else:
            mod._buffers[name] = value
    slot.tensor = value


def copy_targets(slots: list[TensorSlot]) -> dict[str, list[torch.Tensor]]:
    """The module's tensors to fill by copy, by the stored name that fills them."""
    targets: dict[str, list[torch.Tensor]] = {}
    for s in slots:
        if s.key:
            targets.setdefault(s.key, []).append(s.tensor)
    return targets


def assign_device(torch: ModuleType, slots: list[TensorSlot], device: str | None) -> torch.device:
    """Where the weights go for an assignment: ``device``, else where the real parameters are.

    Raises:
        RuntimeError: real parameters spread over devices, or on another one than ``device``.
    """
    real = sorted({str(s.tensor.device) for s in slots if s.kind == "param" and s.tensor.device.type != "meta"})
    dev = torch.device(device or (real[0] if real else "cpu"))
    if dev.type == "cuda" and dev.index is None and real and real[0].startswith("cuda"):
        dev = torch.device(real[0])
    if len(real) > 1 or (real and torch.device(real[0]) != dev):
        raise RuntimeError(f"load_into: some parameters are already on {real}, the weights go to "
                           f"{dev}; build the whole module under init_empty() or move it first")
    return dev


def assign_tensors(torch: ModuleType, slots: list[TensorSlot], tensors: dict[str, torch.Tensor],
                   dev: torch.device, timeline: Timeline, notes: list[str]) -> None:
    """Make the loaded ``tensors`` the module's meta tensors; copy into its real ones.

    Real buffers follow the weights to ``dev``; a dtype the module asks for other than the
    stored one costs a cast (a copy). What happened is appended to ``notes``.
    """
    with timeline.stage("assign") as box, torch.no_grad():
        for s in slots:  # real buffers follow the weights to the device
            if s.kind != "param" and s.tensor.device.type != "meta" and s.tensor.device != dev:
                _set(s, s.tensor.to(dev))
        for s in slots:
            if not s.key:
                if s.tensor.device.type == "meta":
                    notes.append(f"{s.names[0]}: nothing to load; left on meta")
                continue
            src = tensors[s.key]
            if s.tensor.device.type != "meta":
                s.tensor.copy_(src)
                continue
            if src.dtype != s.tensor.dtype:
                notes.append(f"{s.names[0]}: cast from {src.dtype} to {s.tensor.dtype} (a copy)")
                src = src.to(s.tensor.dtype)
            _set(s, src)
            box["bytes"] += src.numel() * src.element_size()
