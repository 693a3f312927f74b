"""What an engine's warm state depends on, and the first part of it that differs.

A key is a JSON object recorded when the state is captured and computed again at every start
(by the engine's plugin, :mod:`packer.adapters.vllm_warm`):

=============== ===================================================================
``engine``      ``"vllm"``
``engine_version``, ``torch``, ``python``   versions (compiled artifacts hold pickled code objects)
``device``      ``{"kind": "cpu" | "cuda", "arch": ..., "name": ..., "isa" | "capability": ...}``
``model_path``  the model directory the engine is given (vLLM hashes it into its key)
``env``         ``{NAME: value}`` of the environment that enters the engine's compile hash
``state_env``   :data:`STATE_ENV`: what the engine's run was given, and a hit gives again
``roots``       ``{root: "library version"}`` of each cache root (:mod:`packer.warm.roots`);
                a hit compares only the roots the state holds (:func:`held`)
``engine_args`` ``{name: value}`` of the engine arguments that are not at their defaults
``config``      ``{section: hash}``: the engine's own hash of its configuration, per section
``requests``    the request mix of the warm run (:mod:`packer.warm.requests`): recorded, never
                compared (it decides what the state covers, not whether it is right)
=============== ===================================================================

:data:`BEFORE_CONFIG` can be compared before the engine builds its configuration (so a hit
can point the engine's cache at the state in time for the first thing it reads); ``config``
only after. ``engine_args`` explains a ``config`` difference: an argument outside the engine's
hash (``disable_log_stats``) is no reason to recompile, so arguments alone never decide.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from packer.errors import PackerError
from packer.reading import open_regular

BEFORE_CONFIG = ("engine", "engine_version", "torch", "python", "device", "model_path", "env", "state_env", "roots")
# Set for the engine's run and on every hit: Inductor's C++ cache otherwise preprocesses (and
# in a fresh container compiles, 149 MB and 5 CPU-s on vLLM 0.32's CPU build) a precompiled
# header before it looks for a kernel it already has; the header only speeds up compiles,
# which a hit does not do. The setting enters Inductor's part of vLLM's compile hash, so the
# run and the hit must agree.
# TRITON_CACHE_AUTOTUNING=1: Triton keeps its autotuning results in its cache (else every boot
# benchmarks every config again), so the run records them and a hit reads them.
STATE_ENV = {"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0", "TRITON_CACHE_AUTOTUNING": "1"}
ALL = (*BEFORE_CONFIG, "engine_args", "config")
_SAFE = re.compile(r"[A-Za-z0-9_.-]+")
CAPTURE = "PACKER_WARM_CAPTURE"  # packer warm's run: the file the key is written to
CAPTURE_NONCE = "PACKER_WARM_CAPTURE_NONCE"  # the secret that file holds (a variable alone proves nothing)
_MARK = b"packer warm capture "


def capture_mark(nonce: str) -> bytes:
    """What ``packer warm`` writes into the key's file before the engine's run: the run's
    secret, which the plugin finds there before it writes the key over it."""
    return _MARK + nonce.encode("ascii") + b"\n"


def proven_capture(path: str, nonce: str) -> Path | None:
    """``path`` when it is the key file ``packer warm`` made for this run: a regular file (not a
    link) of this user holding :func:`capture_mark` of ``nonce`` (32 hex digits); else None.

    A serving process that inherited ``PACKER_WARM_CAPTURE`` from someone else's environment
    writes nothing: no file but the one packer warm wrote the secret into matches.
    """
    if not (len(nonce) == 32 and all(c in "0123456789abcdef" for c in nonce)):
        return None
    want = capture_mark(nonce)
    try:
        st = os.lstat(path)  # never through a link
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size != len(want):
            return None
        with open_regular(path) as f:  # the file lstat saw: no other swapped in since
            seen = os.fstat(f.fileno())
            same = (seen.st_dev, seen.st_ino) == (st.st_dev, st.st_ino)
            return Path(path) if same and f.read(len(want) + 1) == want else None
    except (OSError, ValueError, PackerError):
        return None


def state_name(key: dict[str, Any]) -> str:
    """The state's directory name: ``<engine>-<device kind>-<arch>`` (``vllm-cpu-x86_64``, ``vllm-cuda-sm90``).

    Raises:
        ValueError: the key lacks the parts, or they are not plain names.
    """
    device = key.get("device") or {}
    if not isinstance(device, dict):
        raise ValueError(f"warm-state key: device {str(device)[:60]!r} is not a table of kind and arch")
    parts = [str(key.get("engine", "")), str(device.get("kind", "")), str(device.get("arch", ""))]
    name = "-".join(parts)
    if not all(parts) or not _SAFE.fullmatch(name):
        raise ValueError(f"warm-state key: engine/device {parts!r} do not make a plain directory name")
    return name


def held(key: dict[str, Any], roots: list[str]) -> dict[str, Any]:
    """``key`` with its ``roots`` part cut to the cache roots a state holds: a library whose cache
    the state does not ship (FlashInfer on a CPU state) may change without a miss."""
    libraries = key.get("roots")
    if not isinstance(libraries, dict):
        return key
    return {**key, "roots": {r: v for r, v in libraries.items() if r in roots}}


def plain(value: Any) -> Any:
    """``value`` as JSON that compares equal exactly when the values do (enums and objects as ``str``)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple | set | frozenset):
        items = [plain(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, set | frozenset) else items
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    return str(value)


def difference(warmed: dict[str, Any], now: dict[str, Any], parts: tuple[str, ...] = ALL) -> str | None:
    """The first of ``parts`` where ``now`` differs from ``warmed``, in words; None if none does.

    A mapping part names its first differing entry (``engine argument max_model_len: 128,
    warmed with 64``); the rest name the part and both values.
    """
    for part in parts:
        a, b = warmed.get(part), now.get(part)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            return _entry_difference(part, a, b)
        return f"{_LABELS.get(part, part)}: {_short(b)}, warmed with {_short(a)}"
    return None


def explain_config(warmed: dict[str, Any], now: dict[str, Any]) -> str | None:
    """Why the engine's configuration hash differs: the engine argument that changed, else the section."""
    if warmed.get("config") == now.get("config"):
        return None
    return difference(warmed, now, ("engine_args",)) or difference(warmed, now, ("config",))


_LABELS = {"engine_version": "engine version", "model_path": "model path", "env": "environment",
           "engine_args": "engine argument", "config": "engine configuration hash",
           "state_env": "environment packer sets", "roots": "cache root"}


def _entry_difference(part: str, a: dict[str, Any], b: dict[str, Any]) -> str:
    label = _LABELS.get(part, part)
    # an entry set on both sides first: the same flags given through another entry point
    # (vLLM's command line, LLM(...)) may leave different entries at their defaults
    for name in [*sorted(set(a) & set(b)), *sorted(set(a) ^ set(b))]:
        if a.get(name, _UNSET) != b.get(name, _UNSET):
            was = "not set" if name not in a else _short(a[name])
            is_ = "not set" if name not in b else _short(b[name])
            return f"{label} {name}: {is_}, warmed with {was}"
    return label  # pragma: no cover - unequal mappings differ in some entry


_UNSET = object()


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
