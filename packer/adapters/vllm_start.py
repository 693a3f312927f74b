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

The command line is checked before the imports, as ``python`` checks it: a script that is not a
file (exit 2) or a module that cannot be found (exit 1) is one line in well under a second, not
after 20 s of imports. SIGTERM to the launcher, where the entry installs no handler of its own,
ends it as Ctrl-C does (exit 143): vLLM shuts its engine down, the server exits once its last
child has, and the server's socket is removed. The process titles vLLM sets
(``VLLM::EngineCore``, ``VLLM::Worker``) show as they do without the server.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing
import os
import runpy
import signal
import socket
import sys
from multiprocessing import connection, forkserver
from typing import Any

from packer.adapters import forked_env
from packer.runtime.pool import cuda_initialised, guard_forks
from packer.runtime.reading import read_kernel_text
from packer.util.show import show

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
    """The start cannot fork its processes safely (CUDA initialised) or has no entry to run; ``code``
    is the exit status (2 for usage and a script that is not a file, as ``python`` gives)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


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
    if not server_alive(_STATE["server"]):
        raise RuntimeError(f"packer {SERVER_NAME}: the fork server (pid {_STATE['server']}) is gone")


def server_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: not gone and not a zombie (a dead server stays its launcher's
    zombie, which ``kill(pid, 0)`` still finds, until the launcher exits)."""
    stat = read_kernel_text(f"/proc/{pid}/stat", 4096)
    if stat is not None:  # "pid (comm) STATE ...": comm may hold spaces and parentheses
        state = stat.rpartition(")")[2].split()[:1]
        return state not in (["Z"], ["X"])
    try:  # no /proc
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    return True


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


def entry(argv: list[str]) -> tuple[bool, str, list[str]]:
    """The command line's entry, checked before any import: ``(is_module, module or script, its
    arguments)``; a module's top-level package must be found (nothing is imported to find it).

    Raises:
        StartRefused: no entry (usage, exit 2); a script that is not a file or a folder with
            ``__main__.py`` (exit 2); a module whose top-level package is not found (exit 1).
    """
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if argv[:1] == ["-m"] and len(argv) > 1:
        top = argv[1].partition(".")[0]
        if _spec(top) is None:
            raise StartRefused(f"cannot import {show(top)} in {sys.executable}: no module named '{show(top)}'")
        return True, argv[1], argv[2:]
    if argv and not argv[0].startswith("-"):
        script = argv[0]
        if not (os.path.isfile(script) or os.path.isfile(os.path.join(script, "__main__.py"))):
            raise StartRefused(f"can't open file {show(script)}: not a file, nor a folder with a __main__.py",
                               code=2)
        return False, script, argv[1:]
    raise StartRefused(USAGE, code=2)


def _spec(name: str) -> Any:
    """``importlib.util.find_spec(name)``, None where not found (a dotted name imports its parents)."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent not found, an empty or relative name
        return None


def run_entry(is_module: bool, target: str, args: list[str]) -> None:
    """Run ``-m MODULE ARGS`` or ``SCRIPT ARGS`` as ``python`` would, as ``__main__``.

    Raises:
        StartRefused: the module is not found (a package: its ``__main__`` submodule).
    """
    if is_module:
        spec = _spec(target)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = _spec(f"{target}.__main__")
        if spec is None:
            raise StartRefused(f"no module named {show(target)} (or its __main__) in {sys.executable}")
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")


def _keep_titles() -> None:
    """Set this process's title to itself once, before anything changes the environment: a forked
    child whose environment was replaced (:func:`forked_env.adopt`) can then still set its own
    title (``setproctitle`` finds no room for one once ``environ`` has moved from after ``argv``)."""
    try:
        import setproctitle  # vLLM's; without it, vLLM sets no titles either
    except ImportError:
        return
    setproctitle.setproctitle(setproctitle.getproctitle())


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Preload, fork the server, run the entry; one line and exit 1 where the start is refused."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        is_module, target, args = entry(argv)
        _keep_titles()
        preload()
        route_vllm()
        start_server()
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # the server keeps the default
            signal.signal(signal.SIGTERM, _terminated)
        run_entry(is_module, target, args)
    except StartRefused as e:
        print(f"packer {SERVER_NAME}: {e}", file=sys.stderr)
        return e.code
    except ImportError as e:
        if "server" in _STATE:  # the entry's own import: its traceback, as python prints it
            raise
        print(f"packer {SERVER_NAME}: cannot import {e.name or 'vLLM'} in {sys.executable}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
