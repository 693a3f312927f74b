"""Benchmark: what hashing the weight layers during conversion costs, and what it saves.

The weights stage can hash each shard's image layer (``convert(layer_framing=...)``) on a
second thread while it writes the shard; the image stage then only copies that layer. On
the same ~1 GB llama-style checkpoint as ``benchmarks/convert.py`` (zip format), warm page
cache, interleaved runs, each in a fresh process, against ``cp`` of the input:

* ``packer convert`` and ``packer convert`` with layer digests (the cost moved into it);
* weights + weight layer, old way: convert, then write the layer hashing it;
* weights + weight layer, new way: convert with layer digests, then copy the layer.

Conversion runs with read-back verification on, as ``packer build`` and ``packer convert`` do.

    .venv/bin/python benchmarks/convert_layer.py [--reps 5] [--gb 1.0] [--clean]
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from convert import WORK, base_parser, generate, settle, stats, time_cp, warm  # noqa: E402

RUN = """
import sys, time
from functools import partial
from pathlib import Path
from packer.oci.layer import LayerJob, write_layers
from packer.oci.plan import weight_layer_framing
from packer.oci.tar_writer import Owner, SourceFile, tar_members, tar_pieces
from packer.recipe import ImageConfig, WeightsConfig
from packer.weights.convert import convert

src, out, framed, layers = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
image = ImageConfig()
framing = partial(weight_layer_framing, image, mtime=0) if framed else None
t = time.perf_counter()
result = convert(src, out / "weights", WeightsConfig(), rel_root=out, layer_framing=framing)
assert len(result.digests) == (1 if framed else 0)
if layers:
    blobs = out / "blobs"
    blobs.mkdir()
    jobs = []
    for f in result.files:
        if f.path.endswith(".safetensors"):
            sf = SourceFile("/opt/model/" + f.path, f.size, source=out / f.path)
            members = tar_members([sf], owner=Owner(), prefix="/opt/model")
            jobs.append(LayerJob(tar_pieces(members, mtime=0), "none",
                                 digest=result.digests.get("layer:" + f.path)))
    (layer,) = write_layers(jobs, blobs)
    if framed:  # outside the clock: the layer written without hashing has the known digest
        elapsed = time.perf_counter() - t
        import hashlib
        h = hashlib.sha256()
        with open(layer.path, "rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
        assert "sha256:" + h.hexdigest() == layer.digest
        print(elapsed)
        sys.exit(0)
print(time.perf_counter() - t)
"""

CASES = {
    "packer convert": ("0", "0"),
    "packer convert + layer digests": ("1", "0"),
    "convert, then weight layer hashed (before)": ("0", "1"),
    "convert + layer digests, then weight layer copied (now)": ("1", "1"),
}


def time_case(src: Path, name: str) -> float:
    out = WORK / "convert_layer.out"
    shutil.rmtree(out, ignore_errors=True)
    settle()
    done = subprocess.run([sys.executable, "-c", RUN, str(src), str(out), *CASES[name]],
                          capture_output=True, text=True)
    shutil.rmtree(out, ignore_errors=True)
    if done.returncode != 0:
        raise SystemExit(f"{name}: {done.stderr.strip().splitlines()[-1]}")
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--clean", action="store_true", help="delete the generated checkpoint after")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    src = generate(args.gb, "zip")
    size = src.stat().st_size / 1e9
    results: dict[str, list[float]] = {"cp": [], **{name: [] for name in CASES}}
    try:
        for _ in range(args.reps):
            warm(src)
            results["cp"].append(time_cp(src)["cp"])
            for name in CASES:
                results[name].append(time_case(src, name))
    finally:
        if args.clean:
            src.unlink(missing_ok=True)
    print(f"\n{args.reps} interleaved runs, warm page cache, {os.cpu_count()} CPUs, {size:.2f} GB "
          "zip checkpoint; times inside the process (imports excluded)\n")
    print("| contender | wall s (min / median / max) | median / cp |")
    print("|---|---|---|")
    cp = statistics.median(results["cp"])
    for name, vals in results.items():
        print(f"| {name} | {stats(vals)} | {statistics.median(vals) / cp:.2f}x |")


if __name__ == "__main__":
    main()
