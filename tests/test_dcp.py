"""torch.distributed.checkpoint folders in: written by torch itself (single process, and FSDP2 on
gloo with two ranks), converted and built bitwise, training state left out, refusals in one line."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from packer.checkpoint.reader import read_checkpoint
from packer.errors import CheckpointError, UnsafeInputError
from tests.built import build_dir
from tests.hf_fixtures import llama

dcp = pytest.importorskip("torch.distributed.checkpoint")


def packer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "packer", *args], capture_output=True, text=True, check=False)


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3).to(torch.bfloat16))
    opt = torch.optim.AdamW(m.parameters())
    m[2].float()(m[1](m[0](torch.randn(2, 6)))).sum().backward()
    m[2].to(torch.bfloat16)
    opt.step()
    return m, opt


def save_dcp(state: dict[str, object], folder: Path) -> None:
    import warnings

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(folder))


def loaded(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert got[k].contiguous().view(torch.uint8).equal(v.contiguous().view(torch.uint8)), k


def test_single_process_dcp_converts_bitwise_from_folder_metadata_or_distcp(tmp_path: Path) -> None:
    m, opt = trained()
    save_dcp({"model": m.state_dict(), "optim": opt.state_dict(), "step": 3}, tmp_path / "ck")
    data = sorted((tmp_path / "ck").glob("*.distcp"))
    outs = []
    for i, src in enumerate([tmp_path / "ck", tmp_path / "ck" / ".metadata", data[0]]):
        r = packer("convert", str(src), "-o", str(tmp_path / f"out{i}"))
        assert r.returncode == 0, r.stderr
        assert "left out as training state, not model weights: optim, step" in r.stdout
        outs.append((tmp_path / f"out{i}" / "model.safetensors").read_bytes())
        same(loaded(tmp_path / f"out{i}" / "model.safetensors"), m.state_dict())
    assert outs[0] == outs[1] == outs[2]
    r = packer("inspect", str(tmp_path / "ck"))
    assert r.returncode == 0, r.stderr
    assert "torch-dcp" in r.stdout and "model.0.weight" in r.stdout


def test_a_flat_state_dict_and_a_named_key(tmp_path: Path) -> None:
    m, _ = trained()
    save_dcp(dict(m.state_dict()), tmp_path / "flat")
    c = read_checkpoint(tmp_path / "flat")
    assert c.format == "torch-dcp" and [r.name for r in c.tensors] == list(m.state_dict())
    save_dcp({"student": m.state_dict(), "teacher": m.state_dict()}, tmp_path / "two")
    with pytest.raises(CheckpointError, match=r"several parts; choose one with --key .*student \(6 tensors\)"):
        read_checkpoint(tmp_path / "two")
    assert len(read_checkpoint(tmp_path / "two", key="teacher").tensors) == 6


def test_optimizer_only_dcp_is_refused_in_one_line(tmp_path: Path) -> None:
    _, opt = trained()
    save_dcp({"optimizer": opt.state_dict()}, tmp_path / "optimizer_0")
    r = packer("convert", str(tmp_path / "optimizer_0"), "-o", str(tmp_path / "out"))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "torch.distributed.checkpoint of training state only" in r.stderr and "no model weights" in r.stderr
    assert not (tmp_path / "out").exists()


def test_hostile_metadata_and_truncated_chunk(tmp_path: Path) -> None:
    import pickle

    m, _ = trained()
    save_dcp({"model": m.state_dict()}, tmp_path / "ck")
    meta = tmp_path / "ck" / ".metadata"
    good = meta.read_bytes()
    meta.write_bytes(pickle.dumps(print, protocol=4))
    with pytest.raises(UnsafeInputError, match=r"global builtins.print is not allowed"):
        read_checkpoint(tmp_path / "ck")
    meta.write_bytes(good)
    data = next((tmp_path / "ck").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    r = packer("convert", str(tmp_path / "ck"), "-o", str(tmp_path / "out"))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "run past the file's 100 bytes (truncated?)" in r.stderr


FSDP2 = textwrap.dedent("""
    import os, sys, warnings, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    from torch.distributed.checkpoint.state_dict import get_state_dict
    warnings.simplefilter("ignore")

    def main(rank, out, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
        fully_shard(m)  # uneven: 7 and 3 rows over two ranks
        opt = torch.optim.AdamW(m.parameters())
        m(torch.randn(2, 5)).sum().backward()
        opt.step()
        msd, osd = get_state_dict(m, opt)
        mesh = init_device_mesh("cpu", (2,))  # a column-sharded DTensor: gathered, not concatenated
        msd["extra.col"] = distribute_tensor(torch.arange(30, dtype=torch.float32).reshape(3, 10), mesh, [Shard(1)])
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=out)
        full = {k: v.full_tensor() for k, v in msd.items()}
        if rank == 0:
            torch.save(full, out + ".full.pt")
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        torch.multiprocessing.spawn(main, args=(sys.argv[1], sys.argv[2]), nprocs=2)
""")


@pytest.mark.slow
def test_fsdp2_two_ranks_on_gloo_assemble_bitwise(tmp_path: Path) -> None:
    import shutil
    import socket

    script = tmp_path / "fsdp2.py"
    script.write_text(FSDP2)
    out = tmp_path / "ck"
    for _ in range(3):  # the fixture's own flakes: gloo's threads abort at exit now and then
        with socket.socket() as s:  # ("terminate called without an active exception"), or the
            s.bind(("127.0.0.1", 0))  # free port is taken before the ranks bind it
            port = str(s.getsockname()[1])
        shutil.rmtree(out, ignore_errors=True)
        r = subprocess.run([sys.executable, str(script), str(out), port], capture_output=True, text=True,
                           timeout=300)
        if r.returncode == 0:
            break
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(list(out.glob("*.distcp"))) == 2
    want = torch.load(str(out) + ".full.pt", weights_only=True)
    r = packer("convert", str(out), "-o", str(tmp_path / "st"))
    assert r.returncode == 0, r.stderr
    same(loaded(tmp_path / "st" / "model.safetensors"), want)
    c = read_checkpoint(out)
    assert {r.name: len(r.pieces) for r in c.tensors}["extra.col"] == 2  # two pieces, assembled


@pytest.mark.slow
def test_dcp_of_a_llama_builds_and_loads_bitwise_with_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = tmp_path / "src"
    model = llama(tmp_path / "hf")
    opt = torch.optim.AdamW(model.parameters())
    src.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (tmp_path / "hf" / name).is_file():
            (src / name).write_bytes((tmp_path / "hf" / name).read_bytes())
    save_dcp({"model": model.state_dict(), "optimizer": opt.state_dict()}, src)
    out = tmp_path / "out"
    result = build_dir(src, out)
    assert any("left out as training state" in n for n in result.notes), "\n".join(result.notes)
    env = {"PATH": "/usr/bin:/bin", "PACKER_BUNDLE_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, str(out / "packer_loader.py"), "--model-dir"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    got = AutoModelForCausalLM.from_pretrained(Path(r.stdout.strip()), dtype=torch.bfloat16)
    want = model.state_dict()
    for k, v in got.state_dict().items():
        assert v.view(torch.uint8).equal(want[k].contiguous().view(torch.uint8)), k
