"""``packer warm``: run the engine once against a build and keep what it wrote for its start-up.

The engine runs in its own interpreter (``--python``; vLLM's environment, where packer's
plugin is installed) as a server would: the ``packer`` load format, compile mode unless the
engine arguments say otherwise, and a mix of requests that takes the paths a server's requests
take (:mod:`packer.warm.requests`). Every cache directory the engine and its kernel libraries
use (:data:`packer.adapters.gate.CACHE_ENV`: vLLM's, Inductor's, Triton's, FlashInfer's,
DeepGEMM's, TileLang's, CuTe DSL's and the CUDA driver's) is new and empty, so everything in
them after the run is this model's start-up state (a root nothing wrote is simply absent). What
is copied is only what that run wrote there (:func:`check_roots`, :func:`packer.warm.pins.collect`):
each root must still be the very directory packer made (no link, no other directory swapped in,
inside the run's private folder), and each file a plain one of that directory's file system,
changed since the root was made, with no name outside the roots; anything else refuses the
capture in one line, before a byte under it is read. The
plugin records the key of exactly that run (:mod:`packer.adapters.vllm_warm`), and the mix is
recorded beside it. The files are pinned into ``OUT/warm/<name>/``
(:mod:`packer.warm.pins`), beside the build and outside its manifest: the build stays byte for
byte what it was, and ``packer verify OUT`` checks the state's pins too. The state is written
to a staging directory first; :mod:`packer.warm_step` verifies OUT before and renames it in after.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from packer.errors import UsageError, WarmStateError
from packer.reading import REPORT, parse_json, read_bytes
from packer.util.formats import LOADER_NAME
from packer.util.fsutil import atomic_write_bytes, canonical_json, remove_tree
from packer.util.show import show
from packer.warm.key import CAPTURE, CAPTURE_NONCE, STATE_ENV, capture_mark, state_name
from packer.warm.pins import WARM_DIR, collect
from packer.warm.requests import DEFAULT_REQUESTS, ENGINE_MISSING, REQUESTS_ENV, check_requests
from packer.warm.roots import CACHE_ENV, ROOTS

ENGINES = ("vllm",)
RUNNER = "packer.adapters.vllm_warm_run"
# the engine flags that name what is served, or a file of flags that could: OUT's model is the one warmed
_MODEL_FLAGS = ("--model", "--config")
# run by the engine's interpreter: the stub from its checked bytes, never through the import system
# (which would take a ``__pycache__`` file beside it): the engine side's trust gate loads it
_LAY_OUT = """import sys
from pathlib import Path
from packer.adapters.gate import load_stub
print(load_stub(Path(sys.argv[1])).model_dir())
"""


def check_request(out: Path, *, engine: str, engine_args: list[str], model_dir: Path | None) -> None:
    """Refuse, before anything runs, a request that would warm something else than ``out``'s model.

    Raises:
        WarmStateError: an unknown engine, or ``out`` has no stub.
        UsageError: as :func:`check_engine_args`.
    """
    check_engine_args(out, engine=engine, engine_args=engine_args, model_dir=model_dir)
    if not (out / LOADER_NAME).is_file():
        raise WarmStateError(f"{show(str(out))}: no {LOADER_NAME}; `packer warm` takes a build output "
                             "(packer build -o OUT)")


def check_engine_args(out: Path, *, engine: str, engine_args: list[str], model_dir: Path | None) -> None:
    """The checks of a warm request that need no build (``packer build`` makes them before its first stage).

    Args:
        out: the build output to be warmed (named in the messages; it need not exist yet).

    Raises:
        WarmStateError: an unknown engine.
        UsageError: the engine flags name a model or a config file (``--model X``, ``--model=X``,
            ``--config F``, a positional first argument), or ``model_dir`` is not an existing directory.
    """
    if engine not in ENGINES:
        raise WarmStateError(f"--engine {show(engine)!r}: packer warms {', '.join(ENGINES)}")
    for arg in engine_args:
        flag = arg.split("=", 1)[0]
        if flag.replace("_", "-") in _MODEL_FLAGS:
            raise UsageError(f"packer warm -- {show(arg)}: the engine flags may not name the model (packer warm "
                             f"runs {show(str(out))}'s own); leave {show(flag)} out (--model-dir names the path "
                             "the server uses)")
    if engine_args and not engine_args[0].startswith("-"):
        raise UsageError(f"packer warm -- {show(engine_args[0])}: a positional argument names another model; "
                         f"packer warm runs {show(str(out))}'s own (engine flags start with --)")
    if model_dir is not None and not model_dir.is_dir():
        raise UsageError(f"--model-dir {show(str(model_dir))}: no such directory; the state is keyed on the exact "
                         "path the server is given: pass an existing model directory (the one `python "
                         f"{show(str(out / LOADER_NAME))} --model-dir` prints), or leave --model-dir out for that one")


Keep = Callable[[str, dict[str, Any], dict[str, Path]], dict[str, Any]]


def warm(out: Path, *, engine: str, engine_args: list[str], keep: Keep, python: str | None = None,
         model_dir: Path | None = None, timeout: float = 1800.0,
         requests: tuple[dict[str, Any], ...] = DEFAULT_REQUESTS) -> dict[str, Any]:
    """Capture the engine's start-up state for the verified build ``out``; ``keep`` pins and publishes it.

    The caller has verified ``out`` (:func:`packer.verifying.verify`); nothing in ``out`` is
    written here. The stub is never imported: the model directory is laid out by the engine
    side's trust gate, which loads ``packer_loader.py`` from its checked bytes (no bytecode
    file is read).

    Args:
        out: a build output (``packer_loader.py`` at its top), verified.
        engine: ``"vllm"``.
        engine_args: the engine's own flags (``--dtype float32 --max-model-len 4096``), as the
            server will be given them: the state is keyed on them (:func:`check_request` first).
        keep: called as ``keep(name, key, files)`` while the engine's cache files (``{rel: path}``,
            :func:`packer.warm.pins.collect`) still exist; writes the state (``packer.warm_step``:
            staged inside ``out``, then renamed in) and returns its manifest.
        python: the engine's interpreter (default: this one).
        model_dir: the existing model directory the server will be given (vLLM hashes the path,
            so the state is keyed for exactly it); default: the one ``packer_loader.py
            --model-dir`` prints on this machine.
        timeout: seconds for the engine's run.
        requests: the request mix (checked: :func:`packer.warm.requests.check_requests`), sent one
            after the other; recorded in the key as ``requests``, never compared (see that module).

    Returns:
        a summary: the state's directory (``out/warm/<name>``), name, file count, bytes, the
        model path it is keyed for, seconds, the first request's token ids, how many requests were sent.

    Raises:
        WarmStateError: the engine's run failed (its log's end in the message), or recorded no key.
        UsageError: ``requests`` is not a request mix.
    """
    python = python or sys.executable
    requests = check_requests(list(requests), where="the warm request mix", error=UsageError)
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="packer-warm-run-"))
    try:
        model = model_dir.absolute() if model_dir is not None else _model_dir(out, python, work, timeout)
        roots = {root: work / root for root in ROOTS}
        for d in roots.values():
            d.mkdir(mode=0o700)
        made = {root: os.lstat(d) for root, d in roots.items()}
        nonce = secrets.token_hex(16)  # the plugin writes the key only over the file holding it
        atomic_write_bytes(work / "key.json", capture_mark(nonce))
        env = {**os.environ, **{CACHE_ENV[r]: str(d) for r, d in roots.items()},
               **STATE_ENV, CAPTURE: str(work / "key.json"), CAPTURE_NONCE: nonce, "PACKER_WARM": "off",
               REQUESTS_ENV: canonical_json(list(requests)).decode()}
        env.pop("PACKER_WARM_STATE", None)
        # vLLM's own process layout, as a pod serves: a state captured with the engine core in
        # the capturing process (VLLM_ENABLE_V1_MULTIPROCESSING=0) was not loaded by vLLM 0.32's
        # later starts (tests/test_vllm_warm.py captures under that setting)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        report = _run(python, [str(model), *engine_args], env, timeout, work)
        recorded, name = _read_key(work / "key.json", capture_mark(nonce))
        key = {**recorded, "requests": list(requests)}
        check_roots(roots, made)
        since = min(st.st_ctime_ns for st in made.values())
        doc = keep(name, key, collect(roots, since_ns=since))
    finally:
        remove_tree(work, ignore_errors=True)
    return {"state": str(out / WARM_DIR / name), "name": name,
            "files": len(doc["files"]), "bytes": sum(p["size"] for p in doc["files"].values()),
            "model_path": key["model_path"], "seconds": round(time.monotonic() - start, 2), "token_ids": report["ids"],
            "requests": report["requests"]}


def check_roots(roots: dict[str, Path], made: dict[str, os.stat_result]) -> None:
    """Refuse a cache root that is no longer the empty directory packer made for the engine's run.

    The engine's process (the engine, its kernel libraries, the model's own code under
    ``trust_remote_code``) could replace a root by a link to any folder it can read, or rename
    another folder into its place; following it would copy that folder into OUT and the image.
    So each root is checked by ``lstat`` (never followed) before anything under it is read.

    Args:
        roots: ``{root: the directory its variable named}``, inside the run's private folder.
        made: each root's ``lstat`` right after packer made it.

    Raises:
        WarmStateError: a root that is a link, not a directory, another directory than the one
            made (device and inode), or that resolves outside the run's folder; one line naming
            the root and the variable that set it. Nothing under any root has been read.
    """
    for root, path in sorted(roots.items()):
        said = f"packer warm: cache root {root} ({CACHE_ENV[root]}={show(str(path))})"
        try:
            st = os.lstat(path)
        except OSError as e:
            raise WarmStateError(f"{said}: gone after the engine's run ({e.strerror or e}); refused") from None
        if stat.S_ISLNK(st.st_mode):
            raise WarmStateError(f"{said}: the engine's run replaced it by a symbolic link (to "
                                 f"{show(os.readlink(path))}); refused: a warm state holds only what the run "
                                 "wrote into the directory packer made, nothing under the link was read")
        if not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) != (made[root].st_dev, made[root].st_ino):
            raise WarmStateError(f"{said}: no longer the directory packer made for the engine's run (another "
                                 "entry was put in its place); refused, nothing under it was read")
        real = Path(os.path.realpath(path))
        if real != Path(os.path.realpath(path.parent)) / root:
            raise WarmStateError(f"{said}: resolves to {show(str(real))}, outside the run's own folder; refused")


def _model_dir(out: Path, python: str, work: Path, timeout: float) -> Path:
    """The default model directory, laid out by the stub loaded from its checked bytes (in ``python``)."""
    loader = out.resolve() / LOADER_NAME
    r = subprocess.run([python, "-c", _LAY_OUT, str(loader)], capture_output=True, text=True, timeout=timeout,
                       check=False, cwd=work)
    if r.returncode != 0:
        raise WarmStateError(f"{loader}: laying out the model directory failed: {show(r.stderr.strip()[-600:])}")
    return Path(r.stdout.strip().splitlines()[-1])


def _run(python: str, argv: list[str], env: dict[str, str], timeout: float, cwd: Path) -> dict[str, Any]:
    """The engine's run: ``{"ids": the first request's token ids, "requests": how many were sent}``."""
    # In a fresh directory (``-m`` puts the working directory first on sys.path), in a session of
    # its own, under a reaper (:data:`_REAPER`): whatever the run left running, a process that left
    # its session included, is killed before its cache roots are checked and copied. Its output
    # goes to files of which only the end is read: an engine that prints without end costs disk
    # in the run's folder, never this process's memory.
    with tempfile.TemporaryFile(dir=cwd) as out, tempfile.TemporaryFile(dir=cwd) as err:
        proc = subprocess.Popen([sys.executable, "-I", "-c", _REAPER, python, "-m", RUNNER, *argv], stdout=out,
                                stderr=err, env=env, cwd=cwd, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise WarmStateError(f"{python} -m {RUNNER}: the engine's warm run took over {timeout:.0f} s") from None
        finally:
            _end_session(proc)
        r = subprocess.CompletedProcess(proc.args, proc.returncode, _tail(out), _tail(err))
    lines = [x for x in r.stdout.splitlines() if x.startswith('{"ids": ')]
    if r.returncode != 0 or not lines:
        raise WarmStateError(_failure(python, r))
    report = parse_json(lines[-1], REPORT, where=f"{python} -m {RUNNER}", error=WarmStateError)
    if not isinstance(report, dict) or not isinstance(report.get("ids"), list):
        raise WarmStateError(f"{python} -m {RUNNER}: its report has no token ids: {show(lines[-1][:200])}")
    return {"ids": list(report["ids"]), "requests": report.get("requests")}


# The engine's run as a child of a subreaper (Linux's PR_SET_CHILD_SUBREAPER): every process of
# the run whose parent ends is handed to it, a double fork that left the session (setsid)
# included. When the run ends, or the reaper is told to end (SIGTERM: packer warm's timeout), it
# kills its children until none is left, then exits with the run's status.
_REAPER = """
import ctypes, os, signal, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
run = subprocess.Popen(sys.argv[1:])
def children():
    me, found = str(os.getpid()), []
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open(f'/proc/{pid}/stat', 'rb') as f:
                if f.read().rsplit(b')', 1)[1].split()[1].decode() == me:
                    found.append(int(pid))
        except (OSError, IndexError):
            pass
    return found
def end(*_):
    for _ in range(1000):
        left = children()
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass
signal.signal(signal.SIGTERM, lambda *_: (end(), os._exit(143)))
code = run.wait()
end()
sys.exit(code if code >= 0 else 128 - code)
"""


def _end_session(proc: subprocess.Popen[Any]) -> None:
    """End the engine's run: its reaper told to kill what the run left (SIGTERM, 5 s), then every
    process left in the run's session (its own process group) killed, and the reaper reaped."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
    with contextlib.suppress(ProcessLookupError, PermissionError):  # an empty group: everything has exited
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


OUTPUT_TAIL = 64 * 1024  # bytes of the engine's stdout and of its stderr read back: its report, its last error


def _tail(f: Any) -> str:
    """The last :data:`OUTPUT_TAIL` bytes written to the file ``f``, as text (undecodable bytes replaced)."""
    end = f.seek(0, os.SEEK_END)
    f.seek(max(end - OUTPUT_TAIL, 0))
    return f.read(OUTPUT_TAIL).decode("utf-8", "replace")


def _read_key(path: Path, mark: bytes) -> tuple[dict[str, Any], str]:
    """The key the engine's run recorded over ``mark`` (what packer warm wrote there), and the
    state's name; checked whole before anything is published.

    Raises:
        WarmStateError: no key recorded, or one that is not a key (no configuration hash, no
            model path, engine and device that make no plain name, a number that is not
            finite, text that is not UTF-8): one line naming the file.
    """
    raw = read_bytes(path, REPORT, error=WarmStateError) if path.exists() else mark
    if raw == mark:
        raise WarmStateError(f"{path}: the engine's run recorded no key (is packer's vLLM plugin installed "
                             "in that interpreter?)")
    key = parse_json(raw, REPORT, where=str(path), error=WarmStateError)
    if not isinstance(key, dict) or "config" not in key:
        raise WarmStateError(f"{path}: the recorded key has no engine configuration hash")
    if not isinstance(key.get("model_path"), str):
        raise WarmStateError(f"{path}: the recorded key names no model path")
    try:
        json.dumps(key, allow_nan=False, ensure_ascii=False).encode("utf-8")  # as the state's manifest holds it
        return key, state_name(key)
    except (ValueError, UnicodeEncodeError) as e:
        raise WarmStateError(f"{path}: the recorded key is not one a warm state can hold: "
                             f"{show(str(e)[:200])}") from None


def _failure(python: str, r: subprocess.CompletedProcess[str]) -> str:
    """One line for a failed warm run: the engine's last error line (a missing vLLM said as such)."""
    said = [x.strip() for x in (r.stdout + r.stderr).splitlines() if x.strip()]
    last = said[-1] if said else "no output"
    if r.returncode == ENGINE_MISSING:  # the runner's own status for an interpreter without vllm
        return (f"{python} cannot import vllm: run packer warm with --python pointing at the engine's "
                "interpreter (the one vLLM is installed in), or pip install vllm there")
    return f"{python} -m {RUNNER}: the engine's warm run failed (exit {r.returncode}): {show(last[-600:])}"
