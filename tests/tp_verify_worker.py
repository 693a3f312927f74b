"""One rank of a verified tensor-parallel load, run as ``python -m tests.tp_verify_worker WORK`` (not by pytest).

Rank ``r`` loads its own copy ``WORK/rank{r}/out`` of a ``packer build`` with the emitted loader's
``from_pretrained(tp_plan="auto", verify=True)`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` as torchrun sets them) and writes ``WORK/verify-r.pt``: the logits, the bytes
the ``verify chunks`` stage hashed and its chunks (with ``PACKER_TEST_ROOT=oci://...``, a
streamed load: the bytes the ``fetch`` stage fetched, each proven), the plan's sharded/replicated bytes,
for a local load ``disk``: what a second verified load read from the disk (``read_bytes`` of
``/proc/self/io``, the copy dropped from the page cache first, as tests/tp_worker.py counts), and
``error``: "" after a load, ``mismatch: <message>`` when the loader refused a byte, else the
exception that ended the rank (a peer that left mid-exchange).
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path
from typing import Any

from tests.tp_worker import IDS, drop_cache, emitted_loader, plan_bytes, read_bytes


def _load(pl: Any, torch: Any, mine: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    root = os.environ.get("PACKER_TEST_ROOT") or None  # an oci:// reference: the streamed load
    model = pl.from_pretrained(AutoModelForCausalLM, device="cpu", tp_plan="auto", verify=True, root=root)
    with torch.no_grad():
        logits = model(torch.tensor(IDS)).logits
    stage = [s for s in pl.report() if s["stage"] == ("fetch (registry, proven)" if root else "verify chunks")]
    sharded, replicated = plan_bytes(model)
    disk = -1
    if root is None:  # again, on a cold cache: the first load also faulted in code pages
        model = None
        drop_cache(mine, "*")  # the weights lie in layer blobs too
        before = read_bytes()
        pl.from_pretrained(AutoModelForCausalLM, device="cpu", tp_plan="auto", verify=True)
        disk = read_bytes() - before
    return {"logits": logits.detach().clone(), "hashed": stage[-1]["bytes"] if stage else -1,
            "chunks": stage[-1].get("chunks", 0) if stage else 0, "sharded": sharded, "replicated": replicated,
            "disk": disk, "error": ""}


def main(work: Path) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    pl = emitted_loader(work / f"rank{rank}" / "out")
    try:
        result = _load(pl, torch, work / f"rank{rank}" / "out")
    except pl.ArtifactMismatchError as e:
        result = {"error": f"mismatch: {e}"}
    except Exception as e:  # noqa: BLE001 - the peer that refused left mid-exchange
        result = {"error": f"{type(e).__name__}: {e}"}
    torch.save(result, work / f"verify-{rank}.pt")
    sys.stdout.flush()
    os._exit(0)  # no teardown collective with a peer that may be gone


if __name__ == "__main__":
    main(Path(sys.argv[1]))
