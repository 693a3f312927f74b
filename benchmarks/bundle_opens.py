"""Opens and time to get a tokenizer-like directory of 300 small files: bundle vs directory.

Two read paths over the same files, interleaved runs, page cache warm for both:

* **bundle**: ``extract_cached`` on ``bundle.tar.zst`` into a fresh tmpfs root (one open and
  one read of the archive, decompress, validate, write all files), and ``Bundle.open`` +
  ``read`` of every member (in memory);
* **directory**: open and read every file, one by one, as a tokenizer loader would.

Opens are counted with an audit hook on ``open`` (``os.open`` and ``open`` both raise it);
"source opens" are those of the archive or of a file in the model directory (the network
filesystem, in the real case), "all opens" adds the files extraction creates on local tmpfs.
Then the same hook sleeps ``--delay-ms`` on every source open, imitating NFS round trips, and
the ratio directory time / bundle time is reported. ``--strace`` cross-checks the source opens
at the syscall level (``strace -f -e trace=openat``) in fresh processes.

Usage::

    .venv/bin/python benchmarks/bundle_opens.py [--files 300] [--reps 9] [--delay-ms 2] [--strace]

Scratch data lives in benchmarks/_work/ and is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packer.bundle import run_bundle  # noqa: E402
from packer.recipe import BundleConfig  # noqa: E402
from packer.runtime.bundle_reader import Bundle, extract_cached  # noqa: E402

WORK = ROOT / "benchmarks" / "_work" / "bundle_opens"


class Opens:
    """Audit hook state: counts opens, and sleeps on source opens when ``delay`` is set."""

    def __init__(self, sources: tuple[str, ...]) -> None:
        self.sources, self.delay, self.total, self.source = sources, 0.0, 0, 0
        sys.addaudithook(self.hook)

    def hook(self, event: str, args: tuple) -> None:  # type: ignore[type-arg]
        if event != "open":
            return
        self.total += 1
        path = args[0]
        if isinstance(path, str) and path.startswith(self.sources):
            self.source += 1
            if self.delay:
                time.sleep(self.delay)

    def reset(self) -> None:
        self.total = self.source = 0


def make_model(src: Path, n_files: int) -> list[str]:
    """tokenizer.json (~1 MB), vocab/merges, configs, and small JSON/txt files up to ``n_files``."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(40000)]
    files = {
        "tokenizer.json": json.dumps({"model": {"vocab": {w: i for i, w in enumerate(words)}}}).encode(),
        "vocab.txt": "\n".join(words).encode(),
        "merges.txt": "\n".join(f"{a} {b}" for a, b in zip(words[:20000], words[1:20001], strict=True)).encode(),
        "config.json": b'{"model_type": "bert", "hidden_size": 768}',
        "tokenizer_config.json": b'{"model_max_length": 512}',
        "special_tokens_map.json": b'{"unk_token": "[UNK]"}',
        "1_Pooling/config.json": b'{"pooling_mode_mean_tokens": true}',
    }
    i = 0
    while len(files) < n_files:
        folder = ("", "tokenizer/", "2_Normalize/")[i % 3]
        body = json.dumps({"id": i, "tokens": rng.sample(words, rng.randint(20, 400))}).encode()
        files[f"{folder}added_{i:04d}.{'json' if i % 2 else 'txt'}"] = body
        i += 1
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    return sorted(files)


def read_directory(src: Path, names: list[str]) -> int:
    total = 0
    for n in names:
        with open(src / n, "rb") as f:
            total += len(f.read())
    return total


def read_bundle(archive: Path) -> int:
    b = Bundle.open(archive)
    return sum(len(b.read(n)) for n in b.names())


def extract_bundle(archive: Path, root: Path) -> int:
    return len(os.listdir(extract_cached(archive, root)))


def measure(paths: dict[str, Callable[[], object]], reps: int, opens: Opens) -> dict[str, tuple[list[float], int, int]]:
    times: dict[str, list[float]] = {k: [] for k in paths}
    counts: dict[str, tuple[int, int]] = {}
    for _ in range(reps):
        for name, fn in paths.items():  # interleaved
            opens.reset()
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
            counts[name] = (opens.source, opens.total)
    return {k: (times[k], *counts[k]) for k in paths}


def strace_opens(code: str, needle: str) -> int | None:
    if not shutil.which("strace"):
        return None
    with tempfile.NamedTemporaryFile(suffix=".strace") as log:
        subprocess.run(["strace", "-f", "-qq", "-e", "trace=openat", "-o", log.name, sys.executable, "-c", code],
                       check=True, cwd=ROOT)
        return sum(needle in line for line in Path(log.name).read_text().splitlines())


def _ms(xs: list[float]) -> str:
    return " / ".join(f"{1000 * v:.1f}" for v in (min(xs), statistics.median(xs), max(xs)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=300)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--delay-ms", type=float, default=2.0)
    ap.add_argument("--strace", action="store_true")
    args = ap.parse_args()
    shutil.rmtree(WORK, ignore_errors=True)
    src, out = WORK / "model", WORK / "out"
    src.mkdir(parents=True)
    local = Path(tempfile.mkdtemp(prefix="packer-bench-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
    try:
        make_model(src, args.files)
        section = run_bundle(src, BundleConfig(), out).section
        archive, names = out / section["file"], [m["name"] for m in section["members"]]
        assert len(names) == args.files, len(names)
        opens = Opens((str(src) + "/", str(archive)))
        roots = iter(range(10**6))
        paths: dict[str, Callable[[], object]] = {
            "directory: open+read each file": lambda: read_directory(src, names),
            "bundle: read all into memory": lambda: read_bundle(archive),
            "bundle: read + extract to tmpfs": lambda: extract_bundle(archive, local / str(next(roots))),
        }
        plain = measure(paths, args.reps, opens)
        opens.delay = args.delay_ms / 1000
        slow = measure(paths, args.reps, opens)
        opens.delay = 0
        total = sum(m["size"] for m in section["members"])
        print(f"\n{args.files} files, {total / 1e6:.2f} MB; bundle {section['size'] / 1e6:.2f} MB "
              f"(zstd level {section['zstd_level']}); {args.reps} interleaved runs; "
              "times min / median / max ms\n")
        print(f"| read path | source opens | all opens | no delay | {args.delay_ms:g} ms per source open |")
        print("|---|---:|---:|---:|---:|")
        for k in paths:
            t0, src_opens, all_opens = plain[k]
            print(f"| {k} | {src_opens} | {all_opens} | {_ms(t0)} | {_ms(slow[k][0])} |")
        ref = statistics.median(slow["directory: open+read each file"][0])
        for k in list(paths)[1:]:
            print(f"\nwith {args.delay_ms:g} ms per open: directory / {k.split(': ')[1]} = "
                  f"{ref / statistics.median(slow[k][0]):.1f}x (medians)")
        if args.strace:
            code_b = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from packer.runtime.bundle_reader import *; " \
                     f"extract_cached({str(archive)!r}, {str(local / 'strace')!r})"
            code_d = f"[open(p, 'rb').read() for p in {[str(src / n) for n in names]!r}]"
            print(f"\nstrace openat of the source: bundle {strace_opens(code_b, str(archive))}, "
                  f"directory {strace_opens(code_d, str(src))}")
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)


if __name__ == "__main__":
    main()
