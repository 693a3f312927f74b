"""One rank of a tensor-parallel load, run as ``python -m tests.tp_worker MODE WORK`` (not by pytest).

``MODE``: ``packer`` (the emitted loader's ``from_pretrained(tp_plan="auto")``), ``hf``
(transformers' own ``from_pretrained(tp_plan="auto")`` on the same weights) or ``single`` (the
emitted loader in one process, no process group). ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` as torchrun sets them. Rank ``r`` reads its own copy ``WORK/rank{r}`` of the
build, dropped from the page cache first, so ``read_bytes`` of ``/proc/self/io`` counts what it
read from the disk from the start of the load to the end of the first forward pass (of a
second load: the first also faults in library code pages).
Writes ``WORK/MODE-r.pt``: the logits, the bytes read and the plan's sharded/replicated bytes.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

IDS = [[1, 5, 9, 200, 33, 7, 512, 3, 80, 1000, 14, 2]]


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("no read_bytes in /proc/self/io")


def drop_cache(folder: Path, pattern: str = "*.safetensors") -> None:
    """Evict ``folder``'s files matching ``pattern`` (its weight files) from the page cache,
    written back first; a build's weights lie in its layer blobs too: ``pattern="*"``."""
    for f in sorted(folder.rglob(pattern)):
        if not f.is_file() or f.is_symlink():
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def emitted_loader(out: Path) -> Any:
    spec = importlib.util.spec_from_file_location("packer_loader", out / "packer_loader.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["packer_loader"] = mod
    spec.loader.exec_module(mod)
    return mod


def plan_bytes(model: Any) -> tuple[int, int]:
    """Bytes of the stored tensors the plan shards, and of those it replicates."""
    from torch.distributed.tensor import DTensor

    sharded = replicated = 0
    for _, p in model.named_parameters():
        n = p.numel() * p.element_size()
        if isinstance(p, DTensor) and any(x.is_shard() for x in p.placements):
            sharded += n
        else:
            replicated += n
    return sharded, replicated


def main(mode: str, work: Path) -> int:
    import torch

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    # imports and the bundle before the count: it is the weight files' bytes that are measured
    import safetensors.torch  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import transformers.distributed.tensor_parallel  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM

    mine = work / f"rank{rank}"
    ids = torch.tensor(IDS)
    pl = None if mode == "hf" else emitted_loader(mine / "out")
    # twice: the first pass also faults in code pages of torch's libraries that no import touched
    # (first use of a kernel); the second, on a cold cache again, reads the weight files alone
    for _ in range(2):
        model = logits = None  # the last pass's mappings (transformers maps the files) pin its pages
        gc.collect()
        if pl is None:
            drop_cache(mine / "hf")
            before = read_bytes()
            model = AutoModelForCausalLM.from_pretrained(mine / "hf", tp_plan="auto", dtype=torch.bfloat16)
        else:
            pl.bundle_dir()
            drop_cache(mine / "out")
            before = read_bytes()
            model = pl.from_pretrained(AutoModelForCausalLM, device="cpu",
                                       **({"tp_plan": "auto"} if world > 1 else {}))
        with torch.no_grad():
            logits = model(ids).logits
        got = read_bytes() - before
    sharded, replicated = plan_bytes(model) if world > 1 else (0, 0)
    torch.save({"logits": logits.detach().clone(), "read_bytes": got, "sharded": sharded,
                "replicated": replicated}, work / f"{mode}-{rank}.pt")
    if world > 1:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
