"""Tensor parallel loading (packer/runtime/tp.py): two gloo ranks on CPU, real transformers.

Each case runs ``tests/tp_worker.py`` as two processes per contender: packer's emitted loader
``from_pretrained(tp_plan="auto")`` and transformers' own ``from_pretrained(tp_plan="auto")`` on
the same weight files, each rank on its own copy dropped from the page cache.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from packer.runtime.chunks import split
from packer.stub import emit_loader
from tests.hf_fixtures import llama, packer_artifacts

REPO = Path(__file__).resolve().parents[1]
# o_proj rows are 1 KiB and down_proj rows 3 KiB: half a row per rank is under a page
WIDE = {"hidden": 512, "heads": 8, "kv_heads": 4, "intermediate": 1536, "layers": 4, "vocab": 1024}
SMALL = {"hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "layers": 2, "vocab": 1024}


def ranks(work: Path, mode: str, world: int = 2) -> list[dict[str, Any]]:
    """Run ``world`` workers of ``mode``; return each rank's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": str(REPO),
               "PACKER_BUNDLE_CACHE": str(work / f"cache{r}"), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.tp_worker", mode, str(work)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    return [torch.load(work / f"{mode}-{r}.pt", weights_only=True) for r in range(world)]


def prepare(tmp: Path, world: int, **kw: Any) -> Path:
    """The model saved by transformers and a packer build of it, copied once per rank."""
    llama(tmp / "src" / "hf", **kw)
    out = tmp / "src" / "out"
    emit_loader(out, packer_artifacts(tmp / "src" / "hf", out))
    for r in range(world):
        shutil.copytree(tmp / "src", tmp / f"rank{r}", symlinks=True)
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize(("kw", "check_bytes"), [({**WIDE, "tied": False}, True), ({**SMALL, "tied": True}, False)],
                         ids=["untied-wide", "tied"])
def test_two_ranks_match_transformers_and_read_their_share(tmp_path: Path, kw: dict[str, Any],
                                                          check_bytes: bool) -> None:
    work = prepare(tmp_path, 2, **kw)
    ours, theirs = ranks(work, "packer"), ranks(work, "hf")
    for r in range(2):
        assert torch.equal(ours[r]["logits"], theirs[r]["logits"]), f"rank {r}"
    assert torch.equal(ours[0]["logits"], ours[1]["logits"])
    single = ranks(work, "single", world=1)[0]["logits"]
    # a rowwise split sums bf16 partial products per rank: close to one process, not bitwise
    diff = (ours[0]["logits"].float() - single.float()).abs().max().item()
    assert diff < 0.05 * single.float().abs().max().item()
    if not check_bytes:
        return
    for r in range(2):
        share = ours[r]["sharded"] / 2 + ours[r]["replicated"]
        assert ours[r]["sharded"] > 10 * ours[r]["replicated"]  # the bound is about the slices
        assert ours[r]["read_bytes"] <= 1.05 * share, (r, ours[r]["read_bytes"], share)
        assert ours[r]["read_bytes"] >= 0.9 * share  # the count sees the disk: the cache was cold
        assert theirs[r]["read_bytes"] > 1.3 * share  # the reference reads row pieces and readahead


def test_without_a_process_group_tp_plan_is_refused(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from packer.runtime.loading import Loader
    from packer.runtime.tp import tp_from_pretrained

    llama(tmp_path / "hf")
    m = packer_artifacts(tmp_path / "hf", tmp_path / "out")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised; call "
                                           "torch.distributed.init_process_group"):
        tp_from_pretrained(Loader(m, tmp_path / "out"), AutoModelForCausalLM, device="cpu", dtype=None,
                           verify=False, tp_plan="auto")


@pytest.mark.parametrize(("size", "world"), [(10, 3), (8, 2), (3, 4), (0, 2), (7, 1)])
def test_split_is_dtensor_shard(size: int, world: int) -> None:
    from torch.distributed.tensor.placement_types import Shard

    for r in range(world):
        assert split(size, world, r) == tuple(Shard.local_shard_size_and_offset(size, world, r))
