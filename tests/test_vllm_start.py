"""``python -m packer.adapters.vllm_start``: vLLM's default process layout, every process forked from one
parent that imported torch and vLLM once; the same token ids as vLLM's own start (marker ``vllm``).

torch's imports are counted by a ``sitecustomize`` the test writes: each interpreter that imports
torch appends its pid to a file (a forked process finds torch imported already and appends nothing).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_vllm_format import PROMPTS, REPO, build, env, vllm_python
from tests.torch_imports import count_in, imports


def counted_env(tmp: Path, name: str) -> tuple[dict[str, str], Path]:
    """vLLM's default process layout (no ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with torch's imports counted."""
    site, log = tmp / f"site-{name}", tmp / f"torch-imports-{name}"
    count_in(site, log)
    e = {k: v for k, v in env(tmp).items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    e["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    return e, log


def start(tmp: Path, model_dir: Path, name: str, launcher: list[str]) -> tuple[list[list[int]], int, str]:
    """Token ids, the number of interpreters that imported torch, and the log of one start."""
    e, log = counted_env(tmp, name)
    args = [str(vllm_python()), *launcher, str(REPO / "tests" / "vllm_generate.py"), str(model_dir), "packer", "1",
            json.dumps(PROMPTS)]
    r = subprocess.run(args, capture_output=True, text=True, env=e, timeout=900, check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    lines = [x for x in r.stdout.splitlines() if x.startswith('{"ids": ')]
    assert len(lines) == 1, out[-4000:]
    return json.loads(lines[0])["ids"], imports(log), out


@pytest.mark.vllm
def test_one_import_of_torch_and_the_same_token_ids(tmp_path: Path) -> None:
    _, d = build(tmp_path, tied=False)
    want, imports, _ = start(tmp_path, d, "default", [])
    got, once, log = start(tmp_path, d, "once", ["-m", "packer.adapters.vllm_start"])
    assert got == want and all(len(ids) == 8 for ids in got)
    assert imports >= 3 and once == 1, (imports, once)  # the caller, the engine core, the worker: then one
    assert "changed after the fork server's imports" not in log
    assert "CUDA was initialised" not in log


# --- the launcher's own faults: the command line, odd OpenMP values, a dead server, SIGTERM -------

def launch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "packer.adapters.vllm_start", *args], capture_output=True,
                          text=True, timeout=60, check=False, cwd=REPO)


@pytest.mark.parametrize(("args", "code", "says"), [
    (["nope.py"], 2, "can't open file nope.py: not a file, nor a folder with a __main__.py"),
    (["tests"], 2, "can't open file tests: not a file, nor a folder with a __main__.py"),
    (["-m", "no_such_module_here.api"], 1, "cannot import no_such_module_here in "),
    (["-m", "bad\x1b]0;title\x07"], 1, ": no module named 'bad\\x1b]0;title\\x07'"),
    (["-m"], 2, "usage: python -m packer.adapters.vllm_start"),
    (["-c", "print(1)"], 2, "usage: python -m packer.adapters.vllm_start"),
])
def test_a_bad_command_line_is_one_line_before_any_import(args: list[str], code: int, says: str) -> None:
    # this venv has no vLLM: a launcher that imported before checking would say "cannot import vllm"
    r = launch(*args)
    assert (r.returncode, r.stdout) == (code, "")
    assert r.stderr.count("\n") == 1 and says in r.stderr, r.stderr


def test_a_module_found_still_needs_vllm_in_this_python() -> None:
    r = launch("-m", "json.tool")
    assert r.returncode == 1 and r.stderr.startswith("packer vllm_start: cannot import "), r.stderr


ODD = {"OMP_NUM_THREADS": ["99999999999999999999", "\u00b2", "0", "abc", "4,2", "4097"],
       "OMP_PLACES": ["{999}", "{0-99999999}", "{3-1}", "{\u00b2}", "{123456}", "{" + "9" * 5000 + "}"],
       "KMP_AFFINITY": ["granularity=fine,proclist=[7777],explicit"],
       "TORCHINDUCTOR_COMPILE_THREADS": ["\u00b2", "99999999999999999999"]}


ODD_CHECK = """\
import json, os, sys, tempfile, torch
import torch._inductor.config
from packer.adapters import forked_env

forked_env.remember()
before = (torch.get_num_threads(), sorted(os.sched_getaffinity(0)))
for name, value in json.loads(sys.argv[1]):
    err = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:  # each value in a child of its own: adopt replaces the environment and the CPU set
        os.dup2(err.fileno(), 2)
        left = forked_env.adopt({**os.environ, name: value})
        same = before == (torch.get_num_threads(), sorted(os.sched_getaffinity(0)))
        sys.stdout.write(json.dumps([name, value, left, same]) + "\\n")
        sys.stdout.flush()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    err.seek(0)
    print(json.dumps(["stderr", err.read().decode()]), flush=True)
"""


def test_odd_openmp_values_keep_the_values_from_before_in_one_line() -> None:
    # nothing raised, the thread count and CPU set unchanged, the variable named on stderr once
    cases = [(name, value) for name, values in ODD.items() for value in values]
    r = subprocess.run([sys.executable, "-c", ODD_CHECK, json.dumps(cases)], capture_output=True, text=True,
                       timeout=120, check=False, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(lines) == 2 * len(cases), r.stdout
    for (name, value), got, err in zip(cases, lines[::2], lines[1::2], strict=True):
        assert got == [name, value, [name], True], got
        assert err[1].count("\n") == 1 and f"packer vllm_start: {name} changed" in err[1], err


def test_cpu_lists_read_as_vllm_writes_them() -> None:
    from packer.adapters.forked_env import cpu_list

    assert cpu_list("OMP_PLACES", "{0,1,2}") == {0, 1, 2}
    assert cpu_list("GOMP_CPU_AFFINITY", "0 2-4") == {0, 2, 3, 4}
    assert cpu_list("KMP_AFFINITY", "granularity=fine,proclist=[1,3],explicit") == {1, 3}
    assert cpu_list("OMP_PLACES", "cores") == set() == cpu_list("OMP_PLACES", "{0-8192}")


def test_a_dead_server_is_gone_though_its_launcher_has_not_reaped_it() -> None:
    from packer.adapters.vllm_start import server_alive

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while server_alive(pid) and time.monotonic() < deadline:  # a zombie: kill(pid, 0) still finds it
            time.sleep(0.01)
        assert not server_alive(pid)
        os.kill(pid, 0)  # the zombie is there
        assert server_alive(os.getpid())
    finally:
        os.waitpid(pid, 0)
    assert not server_alive(pid)


TITLED = """\
import multiprocessing, os, sys, time
from pathlib import Path


def child(out):
    import setproctitle
    setproctitle.setproctitle("VLLM::TitleTest")
    Path(out, "title").write_bytes(Path("/proc/self/cmdline").read_bytes())
    time.sleep(600)


if __name__ == "__main__":
    out = sys.argv[1]
    os.environ["PACKER_TEST_CHANGED"] = "1"  # the child adopts a changed environment
    p = multiprocessing.get_context("forkserver").Process(target=child, args=(out,), daemon=True)
    p.start()
    from multiprocessing import forkserver
    Path(out, "pids").write_text(f"{forkserver._forkserver._forkserver_pid} {p.pid}")
    time.sleep(600)
"""


@pytest.mark.vllm
def test_sigterm_ends_the_start_its_server_and_children_and_titles_show(tmp_path: Path) -> None:
    script, tmp = tmp_path / "titled.py", tmp_path / "tmp"
    script.write_text(TITLED)
    tmp.mkdir()
    e = {**env(tmp_path), "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([str(vllm_python()), "-m", "packer.adapters.vllm_start", str(script), str(tmp_path)],
                         env=e, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "title").exists() or not (tmp_path / "pids").exists():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.2)
        assert (tmp_path / "title").read_bytes().rstrip(b"\0") == b"VLLM::TitleTest"
        pids = [int(x) for x in (tmp_path / "pids").read_text().split()]
        server, child = pids
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 143, err[-3000:]
        from packer.adapters.vllm_start import server_alive

        deadline = time.monotonic() + 30
        while (server_alive(server) or server_alive(child)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not server_alive(server) and not server_alive(child)
        assert list(tmp.glob("pymp-*")) == []  # the server's socket folder removed
    finally:
        for pid in pids:  # a failed check leaves no server or child behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if p.poll() is None:
            p.kill()
            p.wait()
