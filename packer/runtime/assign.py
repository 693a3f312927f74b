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
from typing import Any

from packer.runtime.env import _DTYPES
from packer.runtime.into import into_cpu, target_device
from packer.runtime.timeline import _torch


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

    def __init__(self, tensor: Any, kind: str) -> None:
        self.tensor = tensor
        self.kind = kind  # "param" | "buffer" | "transient" (a non-persistent buffer)
        self.names: list[str] = []
        self.owners: list[tuple[Any, str]] = []  # (submodule, attribute)
        self.key = ""  # the stored tensor that fills it ("" when none)


def module_slots(module: Any) -> list[TensorSlot]:
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


def _patterns(module: Any, attr: str) -> re.Pattern[str] | None:
    pats = [p for p in (getattr(module, attr, None) or ()) if p]
    return re.compile("|".join(f"(?:{p})" for p in sorted(pats))) if pats else None


def match_slots(module: Any, slots: list[TensorSlot], table: dict[str, Any],
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
_CODES = {name: code for code, (name, _) in _DTYPES.items()}


def _code(t: Any) -> str:
    name = str(t.dtype).removeprefix("torch.")
    return _CODES.get(name, name)


def _set(slot: TensorSlot, value: Any) -> None:
    """Make every owner of ``slot`` hold ``value`` (a Parameter when the slot is one)."""
    torch = _torch()
    if slot.kind == "param" and not isinstance(value, torch.nn.Parameter):
        value = torch.nn.Parameter(value, requires_grad=slot.tensor.requires_grad)
    for mod, name in slot.owners:
        (mod._parameters if slot.kind == "param" else mod._buffers)[name] = value
    slot.tensor = value


def load_module(loader: Any, module: Any, *, device: str | None = None, strict: bool = True,
                verify: bool = False, pipeline: bool | None = None,
                key: Callable[[str], str] | None = None) -> LoadResult:
    """The body of :meth:`Loader.load_into` (see there): assign to meta slots, copy into real ones.

    ``key``: module name -> stored name (see :func:`match_slots`).
    """
    torch = _torch(loader.timeline)
    w = loader.manifest["weights"]
    slots = module_slots(module)
    missing, unexpected, notes = match_slots(module, slots, w["tensors"], w.get("aliases", {}), key)
    if strict and (missing or unexpected):
        raise RuntimeError(f"load_into: missing keys {missing[:8]}, unexpected keys "
                           f"{unexpected[:8]} (pass strict=False to load the rest)")
    if not any(s.key and s.tensor.device.type == "meta" for s in slots):
        targets: dict[str, list[Any]] = {}
        for s in slots:
            if s.key:
                targets.setdefault(s.key, []).append(s.tensor)
        dev = target_device(torch, targets, device)
        shards = loader.open_shards(verify=verify)
        try:
            if verify:
                loader._verify_shards(shards)
            with torch.no_grad():
                if dev.type == "cpu" and not pipeline:
                    into_cpu(torch, shards, targets, loader.readers, loader.timeline)
                else:
                    loader._into_ring(torch, dev, shards, targets)
        finally:
            for s in shards:
                s.close()
        if loader.auto_flush:
            loader.timeline.flush()
        return LoadResult(missing, unexpected, notes)
    return _assign(loader, torch, slots, device, verify, pipeline, LoadResult(missing, unexpected, notes))


def _assign(loader: Any, torch: Any, slots: list[TensorSlot], device: str | None, verify: bool,
            pipeline: bool | None, result: LoadResult) -> LoadResult:
    real = sorted({str(s.tensor.device) for s in slots if s.kind == "param" and s.tensor.device.type != "meta"})
    dev = torch.device(device or (real[0] if real else "cpu"))
    if dev.type == "cuda" and dev.index is None and real and real[0].startswith("cuda"):
        dev = torch.device(real[0])
    if len(real) > 1 or (real and torch.device(real[0]) != dev):
        raise RuntimeError(f"load_into: some parameters are already on {real}, the weights go to "
                           f"{dev}; build the whole module under init_empty() or move it first")
    auto, loader.auto_flush = loader.auto_flush, False
    try:
        tensors = loader.load_weights(str(dev), verify=verify, pipeline=pipeline)
    finally:
        loader.auto_flush = auto
    with loader.timeline.stage("assign") as box, torch.no_grad():
        for s in slots:  # real buffers follow the weights to the device
            if s.kind != "param" and s.tensor.device.type != "meta" and s.tensor.device != dev:
                _set(s, s.tensor.to(dev))
        for s in slots:
            if not s.key:
                if s.tensor.device.type == "meta":
                    result.notes.append(f"{s.names[0]}: nothing to load; left on meta")
                continue
            src = tensors[s.key]
            if s.tensor.device.type != "meta":
                s.tensor.copy_(src)
                continue
            if src.dtype != s.tensor.dtype:
                result.notes.append(f"{s.names[0]}: cast from {src.dtype} to {s.tensor.dtype} (a copy)")
                src = src.to(s.tensor.dtype)
            _set(s, src)
            box["bytes"] += src.numel() * src.element_size()
    if loader.auto_flush:
        loader.timeline.flush()
    return result
