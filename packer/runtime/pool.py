"""The warm pool: pre-imported worker processes forked from a server that did everything above the CUDA line, once.

:func:`warm_context` returns the standard library's ``forkserver`` context with this module
and the caller's modules preloaded. The server is a fresh interpreter (not a fork of the
caller); importing the loader there runs :func:`prepare_loader` (environment set, headers
checked, bundle extracted, config parsed, page cache optionally warmed) and records, just
before every fork, whether CUDA was initialised in the server. A child forked after CUDA
initialisation cannot use CUDA, so such a server is refused: :func:`warm_context` raises,
and any worker it would still fork fails before running its target.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .env import POOL_ENV
from .reading import loads_json
from .timeline import import_torch

if TYPE_CHECKING:
    import multiprocessing.connection
    import multiprocessing.context

    from .loading import Loader

_SERVER: dict[str, Any] = {}  # the server's state, inherited by every worker it forks


def prepare_loader(loader: Loader, *, prefetch: bool = False) -> dict[str, Any]:
    """The start-up work that must happen before CUDA starts, done once.

    Imports torch, checks every weight file's size and header, extracts the bundle and parses
    its ``config.json`` with transformers when transformers is already imported; with
    ``prefetch``, reads the weights into the page cache. The loader's environment variables
    (``CUDA_MODULE_LOADING``, ``PYTORCH_CUDA_ALLOC_CONF``) were set when it was imported.

    Returns:
        ``{"shards": n, "bundle": path or None, "config": bool, "prefetch": bool}``.

    Raises:
        ArtifactMismatchError: artifacts that do not match the manifest.
    """
    import_torch(loader.timeline)
    for s in loader.open_shards():
        s.close()
    bundle = loader.bundle_dir() if loader.manifest.get("bundle") else None
    config = bundle is not None and "transformers" in sys.modules and (bundle / "config.json").is_file()
    if bundle is not None and config:
        from .hf import hf_config  # transformers is imported already: config is True

        with loader.timeline.stage("config"):
            hf_config(bundle)
    if prefetch:
        loader.prefetch(background=False)
    return {"shards": len(loader.manifest["weights"]["files"]), "bundle": str(bundle) if bundle else None,
            "config": config, "prefetch": prefetch}


def cuda_initialised() -> bool:
    """Whether CUDA was initialised in this process (False where torch is not imported)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _before_fork() -> None:
    """Runs in the server just before each fork: was CUDA initialised here?"""
    _SERVER["cuda"] = cuda_initialised()


class _Guard:
    """Registered with ``multiprocessing.util.register_after_fork`` (it needs a weak-referable)."""


_GUARD = _Guard()


REFUSED = 70  # exit status of a worker forked from a server where CUDA was initialised


def _refuse_in_child(_: Any) -> None:
    """In each worker before its target runs (multiprocessing swallows exceptions here)."""
    if _SERVER.get("cuda"):
        sys.stderr.write(f"packer {_SERVER.get('name', 'warm pool')}: CUDA was initialised in the fork server "
                         f"(pid {_SERVER.get('pid')}); a child forked after that cannot use CUDA. Keep "
                         "torch.cuda out of the preloaded modules\n")
        sys.stderr.flush()
        os._exit(REFUSED)


def serve_pool(prepare: Callable[..., dict[str, Any]]) -> None:
    """At the loader's import: when this process is the warm pool's fork server, prepare and guard."""
    spec = os.environ.pop(POOL_ENV, None)
    if spec is None or _SERVER:
        return
    _SERVER.update(pid=os.getpid(), error=None, cuda=False)
    try:
        _SERVER["prepared"] = prepare(**loads_json(spec, POOL_ENV))
    except Exception as e:  # reported to warm_context by the probe, not lost in the server
        _SERVER["error"] = f"{type(e).__name__}: {e}"
    guard_forks()


def guard_forks(name: str | None = None) -> None:
    """Make this process a guarded fork server: before each fork it records whether CUDA was
    initialised here, and a multiprocessing child forked after that exits with :data:`REFUSED`
    and one line on stderr before its target runs (never a child that silently cannot use CUDA).

    Args:
        name: what the refusal line calls the server (default: the warm pool).
    """
    from multiprocessing import util

    _SERVER.update(pid=os.getpid(), cuda=False)
    _SERVER.setdefault("error", None)
    if name:
        _SERVER["name"] = name
    os.register_at_fork(before=_before_fork)
    util.register_after_fork(_GUARD, _refuse_in_child)


def server_state() -> dict[str, Any]:
    """What the warm pool's fork server recorded (``pid``, ``cuda``, ``error``, ``prepared``); {} outside one.

    A worker forked from the server inherits it, so a worker can tell where it came from.
    """
    return dict(_SERVER)


def _probe(conn: multiprocessing.connection.Connection) -> None:
    conn.send(server_state())
    conn.close()


def _stop_server() -> None:
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)  # the standard library's own test hook
    if stop is not None:
        stop()


def start_pool(module: str, preload: list[str], *, root: str | Path | None = None,
               prefetch: bool = False) -> multiprocessing.context.ForkServerContext:
    """Start the fork server with ``preload`` then ``module`` imported; see ``warm_context``."""
    import multiprocessing
    from multiprocessing import forkserver

    if module == "__main__":
        raise RuntimeError("warm_context: import this loader by its module name, "
                           "not run it as a script: the fork server imports it by name")
    if "forkserver" not in multiprocessing.get_all_start_methods():
        raise RuntimeError("warm_context: this platform has no 'forkserver' start method")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*preload, module])  # ours last: it sees what the others did
    saved = {k: os.environ.get(k) for k in (POOL_ENV, "PYTHONPATH")}
    os.environ[POOL_ENV] = json.dumps({"root": str(root) if root else None, "prefetch": prefetch})
    # Python < 3.12 does not hand the caller's sys.path to the server
    os.environ["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [saved["PYTHONPATH"] or ""])
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    state = _ask(ctx)
    problem = _problem(state, module)
    if problem:
        _stop_server()
        ctx.set_forkserver_preload([])
        raise RuntimeError(problem)
    return ctx


def _ask(ctx: multiprocessing.context.ForkServerContext) -> dict[str, Any] | None:
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_probe, args=(send,), name="packer-pool-probe")
    p.start()
    send.close()
    try:
        state: dict[str, Any] | None = recv.recv() if recv.poll(120) else None
    except EOFError:
        state = None
    p.join(30)
    if state is None and p.exitcode == REFUSED:  # the guard refused before the target ran
        state = {"cuda": True}
    return state


def _problem(state: dict[str, Any] | None, module: str) -> str:
    if not state or "pid" not in state and not state.get("cuda"):
        return (f"warm_context: the fork server did not prepare {module!r}: it was already running "
                "(call warm_context before anything starts a forkserver process) or cannot import it")
    if state.get("cuda"):
        return ("warm_context: CUDA was initialised in the fork server (by a preloaded module); a "
                "child forked after CUDA initialisation cannot use CUDA. Keep torch.cuda out of "
                "the preloaded modules: each worker initialises CUDA itself")
    if state.get("error"):
        return f"warm_context: prepare() failed in the fork server: {state['error']}"
    return ""
