"""vllm_start's fork server without vLLM (packer/adapters/vllm_start.py, forked_env.py): children forked
from the pre-imported caller's server, with the asking process's environment, and CUDA initialised
before a fork refused in one line (no GPU here: the tests set torch's own flag, which
``torch.cuda.is_initialized()`` reads, as tests/test_warm_pool.py does)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, multiprocessing, os, sys
import torch
import torch._inductor.config  # imported before the variables below change, as vLLM's caller does
from packer.adapters import forked_env, vllm_start
from packer.runtime import pool


def report(q, depth):
    import torch._inductor.config as c
    got = {{"pid": os.getpid(), "ppid": os.getppid(), "asked": os.environ.get("PACKER_TEST_ASKED"),
           "threads": torch.get_num_threads(), "affinity": sorted(os.sched_getaffinity(0)),
           "compile_threads": c.compile_threads, "server": pool.server_state()}}
    if depth:
        os.environ["PACKER_TEST_ASKED"] = "by the child"
        inner = multiprocessing.get_context("forkserver").SimpleQueue()
        p = multiprocessing.get_context("forkserver").Process(target=report, args=(inner, depth - 1))
        p.start()
        got["grandchild"] = inner.get()
        p.join()
    q.put(got)


if __name__ == "__main__":
    if {cuda_before!r}:
        torch.cuda._initialized = True
    if {cuda_in_server!r}:  # after vllm_start's check, just before its fork: the server has it
        os.register_at_fork(before=lambda: setattr(torch.cuda, "_initialized", True))
    try:
        server = vllm_start.start_server()
    except vllm_start.StartRefused as e:
        print(f"packer vllm_start: {{e}}", file=sys.stderr)
        sys.exit(1)
    os.environ.update(PACKER_TEST_ASKED="by the caller", OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1",
                      OMP_PLACES="{{0}}", OMP_PROC_BIND="true")
    ctx = multiprocessing.get_context("forkserver")
    q = ctx.SimpleQueue()
    p = ctx.Process(target=report, args=(q, 1))
    p.start()
    p.join(120)
    print(json.dumps({{"caller": os.getpid(), "server": server, "exitcode": p.exitcode,
                      "child": None if q.empty() else q.get()}}))
"""


def run(tmp: Path, *, cuda_before: bool = False, cuda_in_server: bool = False) -> subprocess.CompletedProcess[str]:
    script = tmp / "caller.py"
    script.write_text(textwrap.dedent(SCRIPT.format(cuda_before=cuda_before, cuda_in_server=cuda_in_server)))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp,
                          timeout=300, check=False)


@pytest.mark.slow
def test_children_come_from_the_server_with_the_askers_environment(tmp_path: Path) -> None:
    r = run(tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    child, grandchild = got["child"], got["child"]["grandchild"]
    assert got["exitcode"] == 0 and got["server"] != got["caller"]
    # both forked from the server (not from the caller, not the child), the server guarded
    assert child["ppid"] == got["server"] and grandchild["ppid"] == got["server"]
    assert child["server"]["pid"] == got["server"] and child["server"]["cuda"] is False
    # the environment of the process that asked, as a spawned child would have it
    assert child["asked"] == "by the caller" and grandchild["asked"] == "by the child"
    # what libraries read only at load: set as a library loaded now would read it
    for c in (child, grandchild):
        assert c["threads"] == 1 and c["affinity"] == [0] and c["compile_threads"] == 1
    assert "changed after the fork server's imports" not in r.stderr


def test_refuses_to_fork_after_cuda_was_initialised(tmp_path: Path) -> None:
    r = run(tmp_path, cuda_before=True)
    assert r.returncode == 1 and not r.stdout
    assert r.stderr.strip().splitlines() == [
        "packer vllm_start: CUDA was initialised before the fork server started; a child forked after that "
        "cannot use CUDA. Keep torch.cuda out of what runs before vllm_start forks"]


@pytest.mark.slow
def test_a_server_where_cuda_was_initialised_refuses_every_child(tmp_path: Path) -> None:
    r = run(tmp_path, cuda_in_server=True)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["exitcode"] == 70 and got["child"] is None  # pool.REFUSED: before the target ran
    assert f"packer vllm_start: CUDA was initialised in the fork server (pid {got['server']})" in r.stderr


def test_cpu_lists_in_the_forms_vllm_writes() -> None:
    from packer.adapters.forked_env import cpu_list

    assert cpu_list("OMP_PLACES", "{0,1,2}") == {0, 1, 2}
    assert cpu_list("GOMP_CPU_AFFINITY", "4 5 6-8") == {4, 5, 6, 7, 8}
    assert cpu_list("KMP_AFFINITY", "granularity=fine,explicit,proclist=[3,9]") == {3, 9}
    assert cpu_list("OMP_PLACES", "cores") == set() and cpu_list("OMP_PLACES", "{0:4}") == set()


GPU_SCRIPT = """
import json, multiprocessing, os, sys
import torch
from packer.adapters import vllm_start


def on_gpu(q):
    q.put(torch.ones(2, device="cuda").sum().item())


if __name__ == "__main__":
    if sys.argv[1] == "fork-after-init":  # the advice "initialise CUDA, then fork", without the guard
        torch.zeros(1, device="cuda")
        pid = os.fork()
        if pid == 0:
            try:
                torch.zeros(1, device="cuda")
                os._exit(0)
            except Exception as e:
                print(f"child: {type(e).__name__}: {e}".splitlines()[0], flush=True)
                os._exit(3)
        print(json.dumps({"child exit": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}))
        sys.exit(0)
    if sys.argv[1] == "init-first":
        torch.cuda.init()
    try:
        vllm_start.start_server()
    except vllm_start.StartRefused as e:
        print(f"packer vllm_start: {e}", file=sys.stderr)
        sys.exit(1)
    ctx = multiprocessing.get_context("forkserver")
    q = ctx.SimpleQueue()
    p = ctx.Process(target=on_gpu, args=(q,))
    p.start()
    p.join(120)
    print(json.dumps({"exitcode": p.exitcode, "sum": None if q.empty() else q.get(),
                      "caller initialised CUDA": torch.cuda.is_initialized()}))
"""


@pytest.mark.cuda
def test_on_a_gpu_children_of_the_server_use_cuda_and_cuda_first_is_refused(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("hardware: no CUDA device")
    script = tmp_path / "gpu_caller.py"
    script.write_text(GPU_SCRIPT)

    def go(mode: str) -> subprocess.CompletedProcess[str]:
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
        return subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=300, check=False)

    r = go("plain")  # the server forked before CUDA: its child initialises CUDA itself and uses it
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"exitcode": 0, "sum": 2.0,
                                                               "caller initialised CUDA": False}
    r = go("init-first")  # CUDA initialised, then vllm_start would fork: refused, one line
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(
        "packer vllm_start: CUDA was initialised before the fork server started"), r.stderr
    r = go("fork-after-init")  # why: a child forked after CUDA initialisation cannot use CUDA
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"child exit": 3}, r.stdout


def test_without_vllm_the_start_is_one_line(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here: this test is for a python without it")
    r = subprocess.run([sys.executable, "-m", "packer.adapters.vllm_start", "-m", "vllm.entrypoints.openai.api_server"],
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
                       cwd=tmp_path, timeout=120, check=False)
    assert r.returncode == 1 and not r.stdout
    assert r.stderr.startswith(f"packer vllm_start: cannot import vllm in {sys.executable}: ") and \
        r.stderr.count("\n") == 1, r.stderr
