"""vLLM started from one parent that imported torch and vLLM once: ``python -m packer.adapters.vllm_start``.

``python -m packer.adapters.vllm_start -m vllm.entrypoints.openai.api_server --model /models ...``
(or ``... vllm_start SCRIPT ARGS``) imports torch, vLLM, its engine core and executor, and
packer's plugin, once, checks that CUDA was not initialised, and forks a fork server from itself;
then it runs the entry in its own process, where vLLM's caller (the API server, or the script's
``LLM``) runs as usual. vLLM's default process layout stays (the
caller, the engine core, its workers), but every process vLLM starts is forked from that server
(the standard library's ``forkserver`` loop, with its protocol) instead of a fresh interpreter that
imports torch and vLLM again: ``import torch`` runs once per start. The server first imports
the platform's worker and what the engine core and the worker import when they start
(:data:`SERVER_PRELOAD`), on the other core while the caller imports its entry and builds its
configuration; a request for a process waits until it is done.

Why vLLM does not fork on CPU, and what is done about it here: its CPU platform forces ``spawn``
because the engine core sets each worker's OpenMP variables (``OMP_NUM_THREADS``, the places or
``GOMP_CPU_AFFINITY``/``KMP_AFFINITY``) just before starting it, and an OpenMP runtime that was
loaded already never reads them again. A child of the server gets the environment of the process
that asked for it (as a spawned one would), then (:mod:`packer.adapters.forked_env`) its thread
count and CPU set from those variables, and the Inductor options that Inductor reads only at its
import, as a fresh process would read them; any other such variable that changed is named on
stderr.

A child forked after CUDA initialisation cannot use CUDA, so CUDA initialised before the server
forks stops the start with one line (exit 1), and the server's guard
(:func:`packer.runtime.pool.guard_forks`) refuses, in one line, any child forked after CUDA was
initialised there.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import runpy
import socket
import sys
from multiprocessing import connection, forkserver
from typing import Any

from packer.adapters import forked_env
from packer.runtime.pool import cuda_initialised, guard_forks

USAGE = "usage: python -m packer.adapters.vllm_start (-m MODULE | SCRIPT) [ARGS...]"
PRELOAD = ("torch", "vllm", "vllm.v1.engine.core", "vllm.v1.executor.multiproc_executor",
           "packer.adapters.vllm_format")
WORKERS = {"cpu": ("vllm.v1.worker.cpu_worker",), "cuda": ("vllm.v1.worker.gpu_worker",)}
# What the engine core and the worker import after they start (seen on vLLM 0.32's CPU build, a
# compile-mode start from a warm state), imported by the server while the caller builds its
# configuration: on another core, before it forks them. Names a version lacks are skipped.
SERVER_PRELOAD = {"cpu": ("vllm.v1.core.sched.scheduler", "vllm.v1.attention.backends.cpu_attn",
                          "vllm.compilation.backends", "vllm.compilation.caching", "vllm.v1.pool.flash_maxsim",
                          "vllm.distributed.elastic_ep", "vllm.model_executor.layers.quantization.online.fp8",
                          "compressed_tensors", "torch._dynamo.backends.inductor", "torch.fx.experimental.validator",
                          "torch.export._trace", "sympy.combinatorics", "torch._inductor.codegen.wrapper_fxir",
                          "torch._inductor.codegen.cpp_wrapper_cpu_array_ref",
                          "torch._inductor.codegen.cpp_wrapper_gpu",
                          "torch._inductor.codegen.cuda_combined_scheduling", "torch._inductor.codegen.halide",
                          "torch._inductor.codegen.pallas", "torch._inductor.codegen.mps",
                          "torch._inductor.codegen.xpu.xpu_combined_scheduling", "torch._inductor.hooks",
                          "torch.distributed.tensor.experimental", "sympy.tensor.tensor",
                          "torch._dynamo.backends.registry", "vllm.model_executor.layers.quantization.online.int8",
                          "vllm.model_executor.layers.quantization.online.mxfp4",
                          "vllm.model_executor.layers.quantization.online.mxfp8",
                          "vllm.model_executor.layers.quantization.online.nvfp4", "vllm.triton_utils.dispatcher",
                          "setproctitle", "multiprocessing.popen_forkserver")}
SERVER_NAME = "vllm_start"
_STATE: dict[str, Any] = {}  # the server's pid, inherited by every process of the start


class StartRefused(RuntimeError):
    """The start cannot fork its processes safely (CUDA initialised, usage)."""


def preload() -> list[str]:
    """Import what every process of a vLLM start imports (the worker's own modules are the server's:
    :func:`_server_preload`); returns the module names imported."""
    names = list(PRELOAD)
    for name in PRELOAD:
        importlib.import_module(name)
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    _STATE["device"] = str(current_platform.device_type)
    load_general_plugins()  # once here: the children inherit vLLM's "plugins loaded"
    return names


def start_server() -> int:
    """Fork the fork server from this process and point this process's multiprocessing at it.

    Returns:
        The server's pid.

    Raises:
        StartRefused: CUDA was initialised in this process.
    """
    if cuda_initialised():
        raise StartRefused("CUDA was initialised before the fork server started; a child forked after "
                           "that cannot use CUDA. Keep torch.cuda out of what runs before vllm_start forks")
    listener = socket.socket(socket.AF_UNIX)
    stdlib: Any = connection  # arbitrary_address and the server's fields are the standard library's own
    address = stdlib.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    server: Any = forkserver._forkserver
    # before the fork: the server and every process it forks have them too
    server.ensure_running = _server_running
    forked_env.remember()
    forked_env.carry()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    _STATE["server"] = pid or os.getpid()
    if pid == 0:  # the server: the standard library's loop, in this already-imported process
        os.close(alive_w)
        code = 0
        try:
            guard_forks(SERVER_NAME)
            _server_preload()
            forkserver.main(listener.fileno(), alive_r, [])
        except SystemExit as e:  # every client gone: alive_r at EOF
            code = e.code if isinstance(e.code, int) else 0
        except BaseException as e:  # the caller then finds the server gone, and says so
            sys.stderr.write(f"packer {SERVER_NAME}: the fork server failed: {type(e).__name__}: {e}\n")
            code = 1
        finally:
            os._exit(code)
    listener.close()
    os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    return pid


def _server_preload() -> None:
    """In the server, before its loop: the platform's worker and :data:`SERVER_PRELOAD` for this device,
    while the caller imports its own entry and builds its configuration (a request waits)."""
    device = _STATE.get("device", "")
    for name in (*WORKERS.get(device, ()), *SERVER_PRELOAD.get(device, ())):
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        except Exception as e:  # the children import it themselves, as they would without the server
            sys.stderr.write(f"packer {SERVER_NAME}: the fork server skipped importing {name}: "
                             f"{type(e).__name__}: {e}\n")


def _server_running() -> None:
    """``ForkServer.ensure_running`` in every process of the start: the one server, never a new one."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    try:
        os.kill(_STATE["server"], 0)
    except ProcessLookupError:
        raise RuntimeError(f"packer {SERVER_NAME}: the fork server (pid {_STATE['server']}) is gone") from None


def _context() -> multiprocessing.context.BaseContext:
    """vLLM's ``get_mp_context`` under vllm_start: the server's ``forkserver`` context."""
    from vllm.utils import system_utils

    sync = getattr(system_utils, "_sync_visible_devices_env_vars", None)
    if sync is not None:
        sync()
    return multiprocessing.get_context("forkserver")


def route_vllm() -> None:
    """Every module that bound vLLM's ``get_mp_context`` gets :func:`_context` (CPU forces spawn there)."""
    from vllm.utils import system_utils

    original = system_utils.get_mp_context
    for module in list(sys.modules.values()):  # __dict__: a lazy module's getattr would import
        if getattr(module, "__dict__", {}).get("get_mp_context") is original:
            module.__dict__["get_mp_context"] = _context


def run_entry(argv: list[str]) -> None:
    """Run ``-m MODULE ARGS`` or ``SCRIPT ARGS`` as ``python`` would, as ``__main__``.

    Raises:
        StartRefused: no entry given.
    """
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if argv[:1] == ["-m"] and len(argv) > 1:
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv and not argv[0].startswith("-"):
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
    else:
        raise StartRefused(USAGE)


def main(argv: list[str] | None = None) -> int:
    """Preload, fork the server, run the entry; one line and exit 1 where the start is refused."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        preload()
        route_vllm()
        start_server()
    except StartRefused as e:
        print(f"packer {SERVER_NAME}: {e}", file=sys.stderr)
        return 1
    except ImportError as e:  # run it with the python of vLLM's environment
        print(f"packer {SERVER_NAME}: cannot import {e.name or 'vLLM'} in {sys.executable}: {e}", file=sys.stderr)
        return 1
    try:
        run_entry(argv)
    except StartRefused as e:
        print(f"packer {SERVER_NAME}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
