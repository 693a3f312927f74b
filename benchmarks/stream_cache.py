"""Streaming through a pull-through cache (issue 51): cold and warm, against the registry itself.

``python benchmarks/stream_cache.py [--rounds 3] [--work DIR]`` builds the 1 GB Llama layout of
``stream_load.py`` (bf16, random weights, one safetensors file, 1 MiB chunks cut at the ranks'
splits) and pushes it to Debian's ``docker-registry`` on loopback. Each round, in turn, each
load in a fresh process (``stream_load.py``'s child: ``load_weights("cpu", root="oci://...")``,
torch imported before the clock):

* **cold cache**: a new pull-through cache (a second ``docker-registry`` with ``proxy:
  remoteurl:`` in front of the first, empty storage) answers the load's ``Range`` requests with
  the whole blob (HTTP 200) while it fetches it: packer reads that answer once, in order;
* **warm cache**: a second load through the same cache once it holds the blob and answers
  ``Range`` (distribution commits the blob some seconds after the cold load's last byte; until
  then it answers 200 again, and the load reads that in one pass too: the seconds are reported);
* **direct**: a load from the registry itself.

Reported (min / median / max): seconds to all tensors, bytes fetched over the weight bytes, peak
memory above the process's size before the call.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stream_load import SIZES, make_model, run_child, start_registry  # noqa: E402


def start_cache(work: Path, upstream: str) -> tuple[subprocess.Popen[bytes], str]:
    """A pull-through cache of ``upstream`` with empty storage under ``work``."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return start_registry(work, upstream)


def wait_warm(at: str, digest: str, limit: float = 120.0) -> float:
    """Seconds until the cache at ``at`` answers a ``Range`` read of the image's largest blob with 206."""
    accept = "application/vnd.oci.image.manifest.v1+json"
    with urllib.request.urlopen(urllib.request.Request(f"http://{at}/v2/bench/1gb/manifests/{digest}",
                                                       headers={"Accept": accept})) as r:
        blob = max(json.load(r)["layers"], key=lambda layer: layer["size"])["digest"]
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit:
        with urllib.request.urlopen(urllib.request.Request(f"http://{at}/v2/bench/1gb/blobs/{blob}",
                                                           headers={"Range": "bytes=0-0"})) as r:
            if r.status == 206:
                return time.perf_counter() - t0
        time.sleep(0.25)
    raise RuntimeError(f"the cache at {at} answered no Range within {limit:.0f} s")


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"


def spread3(xs: list[float]) -> str:
    return f"{min(xs):.4f} / {statistics.median(xs):.4f} / {max(xs):.4f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/packer-cache-bench"))
    args = ap.parse_args()
    from packer.building import build
    from packer.oci.push import push
    from packer.recipe import recipe_from_dict

    src, out = args.work / "src", args.work / "out"
    if not (out / "manifest.json").is_file():
        shutil.rmtree(args.work, ignore_errors=True)
        make_model(src, SIZES["1GB"])
        build(recipe_from_dict({"name": "bench", "version": "1", "source": str(src)}), out, sandbox=False)
        shutil.rmtree(src)
    upstream, address = start_registry(args.work)
    runs: dict[str, list[dict[str, Any]]] = {"cold cache": [], "warm cache": [], "direct": []}
    commits: list[float] = []  # seconds from the cold load's end until the cache answers Range
    try:
        digest = push(out, f"{address}/bench/1gb:1", tls_verify=False)[f"{address}/bench/1gb:1"]
        for _ in range(args.rounds):
            cache, at = start_cache(args.work / "cache", address)
            try:
                for name in ("cold cache", "warm cache"):
                    if name == "warm cache":
                        commits.append(wait_warm(at, digest))
                    env = {"PACKER_REGISTRY_INSECURE": at}
                    runs[name].append(run_child(["--child", "stream", str(out), f"oci://{at}/bench/1gb@{digest}",
                                                 str(args.work)], env))
            finally:
                cache.terminate()
                cache.wait()
            env = {"PACKER_REGISTRY_INSECURE": address}
            runs["direct"].append(run_child(["--child", "stream", str(out), f"oci://{address}/bench/1gb@{digest}",
                                             str(args.work)], env))
    finally:
        upstream.terminate()
        upstream.wait()
    nbytes = runs["direct"][0]["nbytes"]
    print(f"\n1 GB model: {nbytes} bytes of weights, {args.rounds} rounds, min / median / max")
    print("| load | all tensors (s) | fetched / weight bytes | peak above start (MB) |")
    print("|---|---|---|---|")
    for name, rs in runs.items():
        print(f"| {name} | {spread([r['all_s'] for r in rs])} | {spread3([r['fetched'] / nbytes for r in rs])} | "
              f"{spread([r['peak_extra'] / 1e6 for r in rs])} |")
    print(f"the cache answered Range {spread(commits)} s after the cold load ended")
    med = {n: statistics.median(r["all_s"] for r in rs) for n, rs in runs.items()}
    print(f"cold / direct: {med['cold cache'] / med['direct']:.2f}; "
          f"warm / direct: {med['warm cache'] / med['direct']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
