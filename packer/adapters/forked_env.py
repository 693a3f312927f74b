"""A child of vllm_start's fork server gets the environment a spawned child would have had.

A spawned child starts a fresh interpreter with its parent's environment at that moment; a child
forked from a server that imported everything earlier inherits the server's. :func:`carry` adds
the asking process's environment to the data multiprocessing sends every child it starts
(``spawn.get_preparation_data``), and the child adopts it (``spawn.prepare``) before its target
is unpickled or run. Libraries that read a variable only when they load keep the value of the
server's import; for those vLLM and packer change during a start the child applies the new value
itself, as a library loaded now would read it:

* ``OMP_NUM_THREADS``: ``torch.set_num_threads`` (OpenMP reads it once, when torch loads);
* the rank's CPU list (``OMP_PLACES``, ``GOMP_CPU_AFFINITY``, ``KMP_AFFINITY``'s proclist), which
  vLLM's CPU executor sets per worker: the process's CPU affinity, which the OpenMP threads started
  later inherit (each thread may run on any CPU of the list, where ``OMP_PROC_BIND`` would have
  pinned one thread to each);
* Inductor's ``compile_threads`` (``TORCHINDUCTOR_COMPILE_THREADS``, which vLLM's CPU platform sets
  to 1: its worker is daemonic and cannot start compile processes) and the options of
  :data:`packer.adapters.vllm_warm.INDUCTOR_ENV`, which enter vLLM's compile hash.

Any other such variable (``TORCHINDUCTOR_*``, ``OMP_*``, ``KMP_*``, ``GOMP_*``) that changed after
the server's imports is named on stderr in one line: the child runs with the value from before.
"""

from __future__ import annotations

import os
import re
import sys
from multiprocessing import spawn
from typing import Any

ENV_KEY = "packer_environ"
LOAD_TIME = ("TORCHINDUCTOR_", "OMP_", "KMP_", "GOMP_")  # read by a library when it loads
CPU_LISTS = ("OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
# the largest thread count and CPU number read from a variable: libgomp refuses a count past its
# integer type and Linux numbers CPUs below its NR_CPUS (8192 in distributions' kernels); a value
# beyond these is not applied (named on stderr), never made into a set of that size
MAX_THREADS = 4096
MAX_CPU = 8191
_IMPORTED: dict[str, str] = {}  # the environment when the server forked: what its libraries read
_ORIGINAL: dict[str, Any] = {}


def remember() -> None:
    """Record this process's environment as the one its imported libraries read (before the fork)."""
    _IMPORTED.clear()
    _IMPORTED.update(os.environ)


def carry() -> None:
    """Send the asking process's environment with every child multiprocessing starts; idempotent."""
    if _ORIGINAL:
        return
    _ORIGINAL.update(get=spawn.get_preparation_data, prepare=spawn.prepare)
    spawn.get_preparation_data = _preparation_data
    spawn.prepare = _prepare  # type: ignore[assignment]


def _preparation_data(name: str) -> dict[str, Any]:
    data: dict[str, Any] = _ORIGINAL["get"](name)
    data[ENV_KEY] = dict(os.environ)
    return data


def _prepare(data: dict[str, Any]) -> None:
    env = data.pop(ENV_KEY, None)
    if env is not None:
        adopt(env)
    _ORIGINAL["prepare"](data)


def adopt(env: dict[str, str]) -> list[str]:
    """Make ``env`` this process's environment and apply what libraries read only at load.

    Returns:
        The load-time variables that changed since the server's imports and were not applied
        (also named on stderr).
    """
    for name in set(os.environ) - set(env):
        del os.environ[name]
    os.environ.update(env)
    changed = {k for k in set(env) | set(_IMPORTED) if env.get(k) != _IMPORTED.get(k) and k.startswith(LOAD_TIME)}
    applied = _threads(env, changed) | _inductor(changed)
    left = sorted(changed - applied)
    if left:
        sys.stderr.write(f"packer vllm_start: {', '.join(left)} changed after the fork server's imports and "
                         "is read only when a library loads: this process keeps the value from before\n")
    return left


def _threads(env: dict[str, str], changed: set[str]) -> set[str]:
    applied = set()
    threads = count(env.get("OMP_NUM_THREADS", ""))
    if "OMP_NUM_THREADS" in changed and threads:
        import torch

        torch.set_num_threads(threads)
        applied.add("OMP_NUM_THREADS")
    for name in CPU_LISTS:
        if name in changed:
            cpus = cpu_list(name, env.get(name, ""))
            if not cpus:
                continue
            try:
                os.sched_setaffinity(0, cpus)
            except OSError:  # none of them online or allowed here: the CPU set from before
                continue
            applied.add(name)
    if "OMP_PROC_BIND" in changed and applied & set(CPU_LISTS):
        applied.add("OMP_PROC_BIND")  # bound to the list as a whole (see the module's docstring)
    return applied


def count(value: str) -> int:
    """A thread count written in ASCII digits, 1 to :data:`MAX_THREADS`; 0 for anything else."""
    if not re.fullmatch(r"[0-9]{1,9}", value.strip()):
        return 0
    n = int(value)
    return n if 0 < n <= MAX_THREADS else 0


def cpu_list(name: str, value: str) -> set[int]:
    """The CPUs a vLLM-written OpenMP variable names (``{0,1,2}``, ``0 1 2``, ``proclist=[0,1]``,
    ranges ``a-b``, ASCII digits); empty for a form this does not read (``OMP_PLACES=cores``,
    ``{0:4}``) and for a CPU number past :data:`MAX_CPU` or a range running backwards."""
    if name == "KMP_AFFINITY":
        m = re.search(r"proclist=\[([^\]]*)\]", value)
        value = m.group(1) if m else ""
    text = value.strip().strip("{}")
    if not text or not re.fullmatch(r"[0-9\s,{}-]+", text, re.ASCII):
        return set()
    cpus: set[int] = set()
    for a, b in re.findall(r"([0-9]+)(?:-([0-9]+))?", text):
        if max(len(a), len(b)) > 5:
            return set()
        first, last = int(a), int(b or a)
        if not first <= last <= MAX_CPU:
            return set()
        cpus.update(range(first, last + 1))
    return cpus


def _inductor(changed: set[str]) -> set[str]:
    config = sys.modules.get("torch._inductor.config")
    if config is None:
        return set()
    from packer.adapters.vllm_warm import INDUCTOR_ENV, inductor_config_from_env

    inductor_config_from_env()
    applied = changed & set(INDUCTOR_ENV)
    threads = count(os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", ""))
    if "TORCHINDUCTOR_COMPILE_THREADS" in changed and threads:
        config.compile_threads = threads  # type: ignore[attr-defined]
        applied.add("TORCHINDUCTOR_COMPILE_THREADS")
    return applied
