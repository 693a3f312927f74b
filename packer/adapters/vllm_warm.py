"""packer's warm state inside vLLM: hit or miss predicted in one line, the state used on a hit.

:func:`install` runs from the plugin's ``register()`` in every process vLLM starts. It wraps
``EngineArgs.create_engine_config``, the one place every entry point (``LLM``, the OpenAI
server, ``vllm serve``) turns engine arguments into a configuration, before any model is
inspected or compiled:

1. before the configuration is built, and only where the operator serves a packer build as one
   (``--load-format packer``, or ``PACKER_WARM=DIR`` naming a state), the key parts that need no
   configuration (versions, device, model path, the environment vLLM hashes) are compared with
   the state's recorded key (:mod:`packer.warm.key`); if they match, the state passes the trust
   gate (:mod:`packer.adapters.gate`: a build whose stub its ``manifest.json`` pins, the state's
   signature where one is required, each file copied against its pin into a private directory),
   and only then do ``VLLM_CACHE_ROOT`` (and every other cache root the state has: Inductor's,
   Triton's, the GPU kernel libraries', :data:`packer.adapters.gate.CACHE_ENV`) point there: vLLM's
   ``modelinfos`` and compile cache are read from checked bytes. The key's first part includes
   the library and version of each root the state holds (:mod:`packer.warm.roots`);
2. after it, vLLM's own hash of the configuration is compared, and one line goes to stderr:
   ``packer: warm state: hit (...)`` or ``packer: warm state: miss (<the part that differs>)``.
   On a miss every variable step 1 changed is put back (and the copy removed) before the engine
   looks for its cache. On a hit, an Inductor this process imported already gets the options
   those variables set (:func:`inductor_config_from_env`), for an engine core in this process.

A plain ``vllm serve DIR`` (another load format, no ``PACKER_WARM``) reads ``DIR`` as data: its
``warm/`` is never looked at, whatever files lie beside it, and no line is printed.

A miss or a refused file is never fatal: vLLM compiles as usual. The decision is made once,
in the process that builds the configuration first; the processes it starts inherit the
environment (and ``PACKER_WARM_STATE``, which tells them not to decide again).
``PACKER_WARM=off`` turns the lookup off; ``PACKER_WARM=DIR`` names a state directory. Under
``PACKER_REQUIRE_SIGNATURE`` a state is used only when its own ``state.sig`` verifies with that
key and signs the manifest read, for the build served (:mod:`packer.warm.trust`).

vLLM 0.32 on CPU cannot load its own AOT compile cache: the loader calls ``finalize_loading``
on the loaded artifact, which on CPU is torch's ``BundledAOTAutogradSerializableCallable``
(Inductor's function, loaded ready to call), not vLLM's serializable type; its attribute
lookups fall through to that function, so every warm start logs ``'function' object has no attribute
'finalize_loading'`` and recompiles. :func:`install` gives exactly that artifact type a no-op
``finalize_loading`` (nothing is left to finalize), on vLLM
0.32.x on CPU only.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from packer.adapters.gate import LOAD_FORMAT, CacheRedirect, anchored_build, open_state
from packer.adapters.import_hook import when_imported
from packer.errors import EngineAdapterError, WarmStateError
from packer.reading import Kind, read_bytes
from packer.runtime.env import ArtifactMismatchError
from packer.util.fsutil import atomic_write_bytes, canonical_json
from packer.util.show import show
from packer.warm.key import (
    BEFORE_CONFIG,
    CAPTURE,
    CAPTURE_NONCE,
    STATE_ENV,
    difference,
    explain_config,
    held,
    plain,
    proven_capture,
    state_name,
)
from packer.warm.pins import WARM_DIR
from packer.warm.roots import root_libraries

LINE = "packer: warm state: "
DECIDED = "PACKER_WARM_STATE"  # set by the deciding process; inherited by the engine's processes
SWITCH = "PACKER_WARM"  # "off", or a state directory
_CPUINFO = Kind("CPU description", 16 << 20, 0)
_IGNORED_ARGS = {"model"}  # recorded as model_path


def install(find_loader: Callable[..., Path]) -> None:
    """Hook the warm-state decision into vLLM (and fix 0.32's CPU AOT loading); idempotent.

    ``find_loader(model_dir, artifacts)`` is the load format's own search for a build's
    ``packer_loader.py`` (the warm state lives in ``warm/`` beside it). The decision hooks the
    configuration's creation where vLLM imports its engine arguments anyway (the process that
    builds the configuration). A failure here is logged and leaves vLLM as it was: the warm
    state is never a reason not to start.
    """
    try:
        _fix_cpu_aot_loading()
        when_imported("vllm.engine.arg_utils", functools.partial(_hook_decision, find_loader))
    except Exception as e:  # noqa: BLE001 - never fatal for the engine
        _not_hooked(e)


def _hook_decision(find_loader: Callable[..., Path]) -> None:
    try:
        _install_decision(find_loader)
    except Exception as e:  # noqa: BLE001 - never fatal for the engine
        _not_hooked(e)


def _not_hooked(e: Exception) -> None:
    print(show(f"{LINE}miss (packer could not hook into this vLLM: {type(e).__name__}: {e})"),
          file=sys.stderr, flush=True)


def _install_decision(find_loader: Callable[..., Path]) -> None:
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs.create_engine_config
    if getattr(orig, "_packer_warm", False):
        return

    @functools.wraps(orig)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        plan = _never_fatal(before_config, self, find_loader)
        try:
            config = orig(self, *args, **kwargs)
            _never_fatal(after_config, self, config, plan)
        finally:
            if plan is not None and plan.redirect is not None and os.environ.get(DECIDED) != "hit":
                plan.redirect.restore()  # a miss: the engine finds its own caches, as without packer
        return config

    create_engine_config._packer_warm = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config


def _never_fatal(step: Callable[..., Any], *args: Any) -> Any:
    try:
        return step(*args)
    except Exception as e:  # noqa: BLE001 - the engine starts as it would without packer
        if os.environ.get(CAPTURE) and proven_capture(os.environ[CAPTURE], os.environ.get(CAPTURE_NONCE, "")):
            raise  # packer warm's own run must not record a state it could not key
        _decide(f"miss (packer's check failed: {type(e).__name__}: {e})")
        return None


def _fix_cpu_aot_loading() -> None:
    import vllm
    from vllm.platforms import current_platform

    if not vllm.__version__.startswith("0.32.") or not current_platform.is_cpu():
        return
    import torch.compiler
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled

    orig = torch.compiler.load_compiled_function
    if getattr(orig, "_packer_cpu_fix", False):
        return

    @functools.wraps(orig)
    def load_compiled_function(*args: Any, **kwargs: Any) -> Any:
        fn = orig(*args, **kwargs)
        inner = getattr(getattr(fn, "_artifacts", None), "compiled_fn", None)
        # the wrapper forwards unknown attributes to Inductor's function, hence vLLM's
        # "'function' object has no attribute 'finalize_loading'"
        if isinstance(inner, Bundled) and "finalize_loading" not in vars(inner):
            inner.finalize_loading = _already_loaded  # type: ignore[attr-defined]
        return fn

    load_compiled_function._packer_cpu_fix = True  # type: ignore[attr-defined]
    torch.compiler.load_compiled_function = load_compiled_function


def _already_loaded(vllm_config: Any) -> None:
    """``finalize_loading`` of Inductor's CPU artifact: it deserialized ready to call."""


@dataclasses.dataclass
class Plan:
    """What :func:`before_config` decided, for :func:`after_config`."""

    before: dict[str, Any]
    capture: Path | None = None
    state: Path | None = None
    recorded: dict[str, Any] | None = None
    redirect: CacheRedirect | None = None
    seconds: float = 0.0


def before_config(engine_args: Any, find_loader: Callable[..., Path]) -> Plan | None:
    """The first half of the decision (see the module docstring); None when nothing is left to do."""
    if os.environ.get(DECIDED):
        return None
    if os.environ.get(CAPTURE):
        capture = proven_capture(os.environ[CAPTURE], os.environ.get(CAPTURE_NONCE, ""))
        if capture is not None:  # packer warm's own run: the key is recorded, no state looked up
            return Plan(capture=capture, before=current_key(engine_args))
        sys.stderr.write(f"{LINE}{CAPTURE} is set but names no key file packer warm made for this run "
                         "(its secret is not there): ignored, nothing written\n")
    switch = os.environ.get(SWITCH, "")
    if switch == "off" or not (switch or str(getattr(engine_args, "load_format", "")) == LOAD_FORMAT):
        return None  # not served as a packer build: the model directory is data, its warm/ is not looked at
    now = current_key(engine_args)
    start = time.perf_counter()
    try:
        found = _find_state(engine_args, state_name(now), switch, find_loader)
        if found is None:
            return None
        state, build = found
        recorded = open_state(state, build)
        why = difference(held(recorded["key"], recorded["roots"]), held(now, recorded["roots"]), BEFORE_CONFIG)
        if why:
            _decide(f"miss ({why})")
            return None
        redirect = CacheRedirect(state, recorded)
    except (WarmStateError, EngineAdapterError, ArtifactMismatchError) as e:
        _decide(f"miss (refused: {e})")
        return None
    redirect.point()
    os.environ[DECIDED] = "pending"
    return Plan(before=now, state=state, recorded=redirect.doc["key"], redirect=redirect,
                seconds=time.perf_counter() - start)


def _find_state(engine_args: Any, name: str, switch: str,
                find_loader: Callable[..., Path]) -> tuple[Path, Path] | None:
    """``(state directory, build directory)`` to decide on; None (and the line, if it is ours) if none.

    Raises:
        EngineAdapterError: the build's stub is not the one its ``manifest.json`` pins.
    """
    try:
        extra = dict(getattr(engine_args, "model_loader_extra_config", None) or {})
        stub = find_loader(engine_args.model, extra.get("artifacts"))
    except (EngineAdapterError, ArtifactMismatchError, OSError, TypeError, ValueError):
        if not switch:
            return None  # the load format itself says why there is no build, in its own words
        return Path(switch), Path(switch).parent.parent
    if switch:
        return Path(switch), stub.parent
    build = anchored_build(stub)
    state = build / WARM_DIR / name
    if (build / WARM_DIR).is_symlink():  # what lies elsewhere is not the build's, whatever its name
        _decide(f"miss ({build / WARM_DIR} is a link, not the build's own folder; refused)")
        return None
    if not state.is_dir() or state.is_symlink():
        _decide(f"miss (no warm state {name} in {build / WARM_DIR}; `packer warm` makes one)")
        return None
    return state, build


def after_config(engine_args: Any, config: Any, plan: Plan | None) -> None:
    """The second half: vLLM's own configuration hash, then the one line (or the captured key)."""
    if plan is None:
        return
    # the environment as it was before: building the configuration sets some of vLLM's variables
    now = {**plan.before, **config_key(engine_args, config)}
    if plan.capture is not None:
        atomic_write_bytes(plan.capture, canonical_json(now))
        return
    assert plan.recorded is not None and plan.state is not None and plan.redirect is not None
    why = explain_config(plan.recorded, now)
    if why:
        _decide(f"miss ({why})")  # the caller puts the engine's variables back
        return
    inductor_config_from_env()
    _decide(f"hit ({now['engine']} {now['engine_version']}, {state_name(now)}, {plan.redirect.nbytes / 1e6:.1f} MB "
            f"checked against the pins of {plan.state} in {plan.seconds:.2f} s)")


# Inductor reads these once, when ``torch._inductor.config`` is first imported; the state's
# variables (STATE_ENV) and vLLM's CPU platform (``check_and_update_config``) set them later.
# A process that imported Inductor first and then runs the model itself (the engine core in the
# caller's process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) would compile with the values of its
# import, which enter vLLM's AOT cache key (``get_inductor_factors``): its hash would not be
# the state's and the "hit" would compile everything again. Processes started later read them.
INDUCTOR_ENV = {"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": ("cpp_cache_precompile_headers",),
                "TORCHINDUCTOR_CPP_DYNAMIC_THREADS": ("cpp", "dynamic_threads")}


def inductor_config_from_env() -> None:
    """Set Inductor's options of :data:`INDUCTOR_ENV` from the environment, as a process that
    imports Inductor now would read them (``"1"`` is true); nothing where Inductor is not imported."""
    config = sys.modules.get("torch._inductor.config")
    if config is None:
        return
    for name, path in INDUCTOR_ENV.items():
        if name in os.environ:
            owner: Any = config
            for part in path[:-1]:
                owner = getattr(owner, part)
            setattr(owner, path[-1], os.environ[name] == "1")


def _decide(text: str) -> None:
    os.environ[DECIDED] = text.split(" ", 1)[0]
    print(show(LINE + text), file=sys.stderr, flush=True)


def current_key(engine_args: Any) -> dict[str, Any]:
    """The key parts of this process known before vLLM builds its configuration (:data:`BEFORE_CONFIG`)."""
    import torch
    import vllm
    from vllm import envs

    return {"engine": "vllm", "engine_version": vllm.__version__, "torch": torch.__version__,
            "python": platform.python_version(), "device": device(), "model_path": str(engine_args.model),
            "env": plain(envs.compile_factors()), "state_env": dict(STATE_ENV), "roots": root_libraries()}


def config_key(engine_args: Any, config: Any) -> dict[str, Any]:
    """The key parts known once vLLM built its configuration: ``engine_args`` and ``config``."""
    return {"engine_args": engine_arguments(engine_args), "config": config_hashes(config)}


def engine_arguments(engine_args: Any) -> dict[str, Any]:
    """``{name: value}`` of the engine arguments that differ from their defaults (``model`` aside)."""
    found = {}
    for f in dataclasses.fields(engine_args):
        if f.name in _IGNORED_ARGS:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        value = getattr(engine_args, f.name)
        try:
            same = bool(value == default)
        except Exception:  # noqa: BLE001 - an odd __eq__: record the value
            same = False
        if not same and value is not None:  # None: not given (the command line's default for some flags)
            found[f.name] = plain(value)
    return found


def config_hashes(config: Any) -> dict[str, str]:
    """vLLM's ``compute_hash()`` of its whole configuration (``all``) and of each section that has one."""
    out = {"all": str(config.compute_hash())}
    for f in dataclasses.fields(config):
        section = getattr(config, f.name, None)
        hasher = getattr(section, "compute_hash", None)
        if callable(hasher):
            try:
                out[f.name] = str(hasher())
            except Exception:  # noqa: BLE001 - a section that cannot hash itself is left to "all"
                continue
    return out


def device() -> dict[str, Any]:
    """The device kind vLLM runs on: CPU architecture and vector ISA, or the GPU's capability."""
    from vllm.platforms import current_platform

    kind = str(current_platform.device_type)
    if kind == "cpu":
        return {"kind": "cpu", "arch": platform.machine(), "isa": cpu_isa()}
    cap = current_platform.get_device_capability()
    arch = f"sm{cap.major}{cap.minor}" if cap is not None else "unknown"
    return {"kind": kind, "arch": arch, "name": str(current_platform.get_device_name())}


def cpu_isa() -> str:
    """The vector extensions Inductor's C++ code is built for, from ``/proc/cpuinfo``'s flags."""
    try:  # /proc files report size 0: read up to the cap
        text = read_bytes("/proc/cpuinfo", _CPUINFO, error=WarmStateError).decode("ascii", "replace")
    except WarmStateError:
        return "unknown"
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            break
    isa = [name for name, need in (("avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
                                   ("avx2", {"avx2", "fma"}), ("amx", {"amx_tile"}), ("sve", {"sve"}),
                                   ("neon", {"asimd"})) if need <= flags]
    return "+".join(isa) or "none"
