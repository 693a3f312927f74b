"""The warm pool (``warm_context``, packer/runtime/pool.py): the standard library's fork server, prepared, and
refused after CUDA init."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.hf_fixtures import llama, packer_artifacts

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]

SERVER = """
import importlib, os, sys
sys.path.insert(0, {out!r})
import packer_loader as P


def answer(ids):
    import torch
    from transformers import LlamaForCausalLM

    model = P.from_pretrained(LlamaForCausalLM, device="cpu")
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids])).logits
    pool = importlib.import_module(P.LoadResult.__module__.rpartition(".")[0] + ".pool")  # the runtime's warm pool
    return out.float().sum().item(), os.getpid(), pool.server_state(), [s["stage"] for s in P.report()].count("config")


if __name__ == "__main__":
    ctx = P.warm_context({preload!r})
    with ctx.Pool(2) as pool:
        got = pool.map(answer, [[3, 17, 42], [3, 17, 42]])
    print(repr((got, os.getpid())))
"""


def emitted(tmp_path: Path) -> Path:
    from packer.stub import emit_loader

    llama(tmp_path / "hf")
    out = tmp_path / "out"
    emit_loader(out, packer_artifacts(tmp_path / "hf", out))
    return out


def run(tmp_path: Path, out: Path, preload: list[str]) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent(SERVER.format(out=str(out), preload=preload)))
    env = {"PATH": "/usr/bin:/bin", "PACKER_STARTUP_LOG": "off", "HF_HUB_OFFLINE": "1",
           "PACKER_BUNDLE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(tmp_path)}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)


@pytest.mark.slow
def test_workers_from_the_warm_server_answer(tmp_path: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    out = emitted(tmp_path)
    r = run(tmp_path, out, ["transformers", "transformers.models.llama.modeling_llama"])
    assert r.returncode == 0, r.stderr
    got, parent = eval(r.stdout.strip().splitlines()[-1])
    want = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        ref = want(input_ids=torch.tensor([[3, 17, 42]])).logits.float().sum().item()
    for total, pid, warm, parsed_here in got:
        assert total == ref and pid != parent
        server = warm["pid"]
        assert server not in (parent, pid) and warm["cuda"] is False and warm["error"] is None
        assert warm["prepared"]["config"] is True  # parsed once, in the server
        assert parsed_here == 1  # the server's stage, inherited: the worker did not parse it again


def test_refuses_a_server_where_cuda_was_initialised(tmp_path: Path) -> None:
    out = emitted(tmp_path)
    # no GPU here: the preloaded module sets torch's own flag, which torch.cuda.is_initialized()
    # reads in the server just before each fork
    (tmp_path / "cuda_first.py").write_text("import torch\ntorch.cuda._initialized = True\n")
    r = run(tmp_path, out, ["cuda_first"])
    assert r.returncode == 1
    assert "RuntimeError: warm_context: CUDA was initialised in the fork server" in r.stderr
    assert "cannot use CUDA" in r.stderr


def test_reports_a_failed_prepare(tmp_path: Path) -> None:
    out = emitted(tmp_path)
    (out / "bundle.tar.zst").write_bytes(b"not a bundle")
    r = run(tmp_path, out, [])
    assert r.returncode == 1 and "warm_context: prepare() failed in the fork server" in r.stderr, r.stderr
