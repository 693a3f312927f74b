"""Layer writing speed against the tools a release engineer would otherwise use.

Two comparisons on the same >= 1 GB of weight-like files (float16 normal values, as
safetensors holds them), interleaved runs, page cache warm for both sides:

* uncompressed weight layers (one layer per file, diff_id and digest hashed in the same
  pass) against ``cp`` of the same files, and against ``cp`` followed by ``sha256sum``
  (what a script must do to get the digests packer computes);
* uncompressed weight layers whose digests are already known (``packer build`` hashes them
  while the weights stage writes the files: ``benchmarks/convert_layer.py`` shows that
  cost), so the layers are only copied, against ``cp``;
* one zstd-compressed layer of all files against ``tar -c | zstd -T0`` (level 3, the
  default of both), which hashes nothing.

Usage::

    .venv/bin/python benchmarks/layers.py [--size-mb 1024] [--files 4] [--reps 5] [--gzip]

Prints a markdown table; the ratio is reference time / packer time (>= 0.8 is the target).
Scratch data lives in benchmarks/_work/ and is deleted at the end.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packer.oci.layer import LayerJob, write_layer, write_layers  # noqa: E402
from packer.oci.plan import weight_layer_framing  # noqa: E402
from packer.oci.tar_writer import Owner, SourceFile, tar_members, tar_pieces  # noqa: E402
from packer.recipe import ImageConfig  # noqa: E402


def make_weights(src: Path, size_mb: int, files: int) -> list[Path]:
    import numpy as np

    src.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per = size_mb * 2**20 // files // 2  # float16 values per file
    paths = []
    for i in range(files):
        p = src / f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        with open(p, "wb") as f:
            for start in range(0, per, 2**24):
                n = min(2**24, per - start)
                f.write((rng.standard_normal(n, dtype=np.float32) * 0.02).astype(np.float16).tobytes())
        paths.append(p)
    return paths


def _fresh(d: Path) -> Path:
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


def packer_uncompressed(paths: list[Path], dst: Path, known: dict[Path, str] | None = None) -> None:
    jobs = []
    for p in paths:  # one layer per weight file, written concurrently as the stage does
        src = SourceFile(f"/opt/model/weights/{p.name}", p.stat().st_size, source=p)
        members = tar_members([src], owner=Owner(), prefix="/opt/model")
        jobs.append(LayerJob(tar_pieces(members, mtime=0), "none",
                             digest=known[p] if known else None))
    write_layers(jobs, dst)


def check_blobs(dst: Path) -> None:
    """Every blob's sha256 is its name (the known digests were right)."""
    for blob in dst.iterdir():
        h = hashlib.sha256()
        with open(blob, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        assert h.hexdigest() == blob.name, blob


def layer_digests(paths: list[Path]) -> dict[Path, str]:
    """Each file's layer digest, as the weights stage computes it (outside the timed runs)."""
    out = {}
    for p in paths:
        head, tail = weight_layer_framing(ImageConfig(), f"weights/{p.name}", p.stat().st_size, mtime=0)
        h = hashlib.sha256(head)
        with open(p, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        h.update(tail)
        out[p] = "sha256:" + h.hexdigest()
    return out


def cp(paths: list[Path], dst: Path) -> None:
    subprocess.run(["cp", *map(str, paths), str(dst)], check=True)


def cp_sha256sum(paths: list[Path], dst: Path) -> None:
    """What a script needs for digests: copy, then hash (two sha256sum in parallel)."""
    cp(paths, dst)
    half = len(paths) // 2 or 1
    procs = [subprocess.Popen(["sha256sum", *map(str, part)], stdout=subprocess.DEVNULL)
             for part in (paths[:half], paths[half:]) if part]
    for p in procs:
        p.wait()


def packer_zstd(paths: list[Path], dst: Path) -> None:
    files = [SourceFile(f"/opt/model/weights/{p.name}", p.stat().st_size, source=p) for p in paths]
    members = tar_members(files, owner=Owner(), prefix="/opt/model")
    write_layer(tar_pieces(members, mtime=0), dst, compression="zstd")


def packer_gzip(paths: list[Path], dst: Path) -> None:
    files = [SourceFile(f"/opt/model/weights/{p.name}", p.stat().st_size, source=p) for p in paths]
    members = tar_members(files, owner=Owner(), prefix="/opt/model")
    write_layer(tar_pieces(members, mtime=0), dst, compression="gzip")


def tar_zstd(paths: list[Path], dst: Path) -> None:
    names = " ".join(p.name for p in paths)
    subprocess.run(f"tar -cf - -C {paths[0].parent} {names} | zstd -T0 -3 -q -o {dst}/l.tar.zst",
                   shell=True, check=True)


def tar_gzip(paths: list[Path], dst: Path) -> None:
    names = " ".join(p.name for p in paths)
    subprocess.run(f"tar -cf - -C {paths[0].parent} {names} | gzip -6 > {dst}/l.tar.gz",
                   shell=True, check=True)


Runner = Callable[[list[Path], Path], None]


def _cpu() -> float:
    """CPU seconds (user + system) of this process and its finished children."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def compare(name: str, ours: Runner, ref: Runner, ref_name: str, paths: list[Path],
            work: Path, reps: int) -> str:
    times: dict[str, list[float]] = {"packer": [], ref_name: []}
    cpu: dict[str, list[float]] = {"packer": [], ref_name: []}
    for _ in range(reps):  # interleaved, so drift in the machine's load hits both sides
        for label, fn in (("packer", ours), (ref_name, ref)):
            dst = _fresh(work / "dst")
            subprocess.run(["sync"], check=True)
            c0 = _cpu()
            t = time.perf_counter()
            fn(paths, dst)
            times[label].append(time.perf_counter() - t)
            cpu[label].append(_cpu() - c0)
    total = sum(p.stat().st_size for p in paths) / 1e6
    rows = []
    for label, ts in times.items():
        mn, md, mx = min(ts), statistics.median(ts), max(ts)
        c = statistics.median(cpu[label])
        rows.append(f"| {name} | {label} | {mn:.2f} | {md:.2f} | {mx:.2f} | {total / md:.0f} "
                    f"| {c:.2f} |")
    ratio = statistics.median(times[ref_name]) / statistics.median(times["packer"])
    best = min(times[ref_name]) / min(times["packer"])
    rows.append(f"| {name} | **ratio {ref_name}/packer** | **{best:.2f}** (min) | "
                f"**{ratio:.2f}** (median) | | | |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gzip", action="store_true", help="also compare gzip (slower by nature)")
    args = ap.parse_args()
    work = ROOT / "benchmarks" / "_work" / "layers"
    try:
        paths = make_weights(_fresh(work / "src"), args.size_mb, args.files)
        for p in paths:  # warm the page cache for both sides
            p.read_bytes()
        print(f"{args.files} files, {args.size_mb} MiB of float16 weights, {args.reps} reps, "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start\n")
        print("| case | tool | min s | median s | max s | MB/s (median) | CPU s (median) |")
        print("|---|---|---|---|---|---|---|")
        print(compare("uncompressed weight layers", packer_uncompressed, cp, "cp", paths, work,
                      args.reps))
        print(compare("uncompressed weight layers", packer_uncompressed, cp_sha256sum,
                      "cp + sha256sum", paths, work, args.reps))
        known = functools.partial(packer_uncompressed, known=layer_digests(paths))
        print(compare("uncompressed weight layers, digest known", known, cp, "cp", paths, work,
                      args.reps))
        known(paths, _fresh(work / "dst"))
        check_blobs(work / "dst")
        print(compare("zstd layer", packer_zstd, tar_zstd, "tar|zstd -T0", paths, work, args.reps))
        if args.gzip:
            print(compare("gzip layer", packer_gzip, tar_gzip, "tar|gzip", paths, work, 1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
