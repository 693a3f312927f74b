"""Chunk digests: what a chunk size costs in table bytes and in bytes a tensor-parallel rank hashes.

``python benchmarks/chunk_size.py`` prints, for a Llama-2-7B and a Llama-3-70B layout (bf16,
Hugging Face tensor order, shards of at most 5 GB, as ``packer build`` writes them) and chunks of
1, 4 and 16 MiB: the chunk table's size (``weights/packer-chunks.json``: one 64-hex digest per
chunk, as packer writes it) and, per rank under TP 2/4/8 (transformers' Llama plan: every sharded
tensor is one contiguous span of rows per rank in packer's read, see packer/runtime/tp.py), the
bytes a verified load hashes against the rank's share (its spans + the replicated tensors). Then
the cost of hashing chunks in the build's re-read: ``sha256_chunked`` against ``sha256_range`` over
the same bytes (page cache warm), per chunk size.

Each layout twice: the fixed grid of a ``packer-chunks/v1`` table (older builds), and the chunks
a build cuts now (``packer-chunks/v2``: cut at the header's end, each tensor's start and end and
its row splits at TP 2, 4 and 8, by the runtime's own :func:`packer.runtime.chunks.tp_cuts`),
with TP 3 and 16 beside them as degrees the cuts were not made for. ``--aligned-only`` skips the
grid and the hashing timings (seconds, not minutes).

Nothing here reads a model: the layouts are computed from the shapes.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: this tree's packer

from packer.runtime.chunks import FileChunks, pieces, split, tp_cuts  # noqa: E402

MIB = 1 << 20
BF16 = 2
LLAMAS = {
    "llama-2-7b": {"hidden": 4096, "inter": 11008, "layers": 32, "heads": 32, "kv": 32, "vocab": 32000, "tied": False},
    "llama-3-70b": {"hidden": 8192, "inter": 28672, "layers": 80, "heads": 64, "kv": 8, "vocab": 128256, "tied": False},
}


def tensors(c: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, how a rank reads it)`` in the files' (sorted) order; ``rows``: a 1/N span of rows."""
    h, d = c["hidden"], c["hidden"] // c["heads"]
    out = [("model.embed_tokens.weight", (c["vocab"], h), "rows"), ("model.norm.weight", (h,), "whole"),
           ("lm_head.weight", (c["vocab"], h), "rows")]
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,), "whole"), (p + "post_attention_layernorm.weight", (h,), "whole"),
                (p + "mlp.down_proj.weight", (h, c["inter"]), "rows"),  # rowwise: 1/N rows, then all_to_all
                (p + "mlp.gate_proj.weight", (c["inter"], h), "rows"),
                (p + "mlp.up_proj.weight", (c["inter"], h), "rows"),
                (p + "self_attn.k_proj.weight", (c["kv"] * d, h), "rows"),
                (p + "self_attn.o_proj.weight", (h, h), "rows"),
                (p + "self_attn.q_proj.weight", (h, h), "rows"),
                (p + "self_attn.v_proj.weight", (c["kv"] * d, h), "rows")]
    return sorted(out)


def files(c: dict, max_shard: int = 5 * 10**9) -> list[list[tuple[int, int, str, tuple[int, ...]]]]:
    """Shards of ``(offset, nbytes, how, shape)``, a 64 KiB header first (a safetensors header's order)."""
    shards: list[list[tuple[int, int, str, tuple[int, ...]]]] = [[]]
    at = 64 * 1024
    for _, shape, how in tensors(c):
        n = BF16
        for s in shape:
            n *= s
        if shards[-1] and at + n > max_shard:
            shards.append([])
            at = 64 * 1024
        shards[-1].append((at, n, how, shape))
        at += n
    return shards


HEADER = 64 * 1024  # the header's bytes in these layouts (files() starts the data there)


def cut_table(shard: list[tuple[int, int, str, tuple[int, ...]]], chunk: int, aligned: bool) -> FileChunks:
    """The chunks of one shard as a build cuts them (``aligned``: v2; else the v1 grid)."""
    size = shard[-1][0] + shard[-1][1]
    tensors = [(at - HEADER, at - HEADER + n, shape) for at, n, _, shape in shard]
    cuts = tp_cuts(HEADER, tensors, size) if aligned else ()
    starts, firsts, _ = pieces(size, chunk, cuts)
    return FileChunks(chunk, size, "0" * 64, "", starts, firsts)


def per_rank(c: dict, chunk: int, world: int, rank: int, aligned: bool = False) -> tuple[int, int, int]:
    """``(share, hashed, spans)`` bytes of ``rank``: its spans and replicated tensors, the chunks
    covering them (and the header's), as ``SpanCheck`` hashes them: per span, a shared edge chunk twice."""
    share = hashed = spans = 0
    for shard in files(c):
        fc = cut_table(shard, chunk, aligned)
        hashed += sum(b - a for a, b in map(fc.bounds, fc.cover(0, HEADER)))
        for at, n, how, shape in shard:
            if how == "rows":
                rows, row = shape[0], n // shape[0]
                k, first = split(rows, world, rank)  # the runtime's split (packer/runtime/tp.py)
                lo, hi = at + first * row, at + (first + k) * row
            else:
                lo, hi = at, at + n
            share += hi - lo
            spans += 1
            hashed += sum(b - a for a, b in map(fc.bounds, fc.cover(lo, hi)))
    return share, hashed, spans


def table_bytes(c: dict, chunk: int, aligned: bool = False) -> int:
    """The table's bytes as packer writes it (v2 ``aligned``: each file's cuts and their chunks)."""
    doc: dict = {"algorithm": "sha256", "chunk_size": chunk,
                 "format": "packer-chunks/v2" if aligned else "packer-chunks/v1", "files": {}}
    for i, shard in enumerate(files(c)):
        fc = cut_table(shard, chunk, aligned)
        rec = {"size": fc.size, "sha256": "0" * 64, "chunks": "0" * 64 * pieces(fc.size, chunk, fc.cuts[1:])[2]}
        if aligned:
            rec["cuts"] = list(fc.cuts[1:])
        doc["files"][f"weights/model-{i:05d}-of-99999.safetensors"] = rec
    return len(json.dumps(doc, sort_keys=True, separators=(",", ":")))


def chunk_total(c: dict, chunk: int, aligned: bool) -> int:
    return sum(pieces(fc.size, chunk, fc.cuts[1:])[2] for fc in (cut_table(s, chunk, aligned) for s in files(c)))


def parse_cost(c: dict, chunk: int, aligned: bool = False) -> float:
    """Seconds the runtime takes to parse and check the table of ``c`` (best of 3)."""
    from packer.runtime.chunks import parse_table, table_doc

    table, pinned = {}, {}
    for i, shard in enumerate(files(c)):
        fc, rel = cut_table(shard, chunk, aligned), f"weights/model-{i:05d}-of-99999.safetensors"
        table[rel] = (fc.size, "0" * 64, ("0" * 64,) * pieces(fc.size, chunk, fc.cuts[1:])[2], fc.cuts[1:])
        pinned[rel] = {"size": fc.size, "sha256": "0" * 64}
    data = json.dumps(table_doc(chunk, table), sort_keys=True, separators=(",", ":")).encode()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        parse_table(data, "bench", pinned)
        best = min(best, time.perf_counter() - t)
    return best


def hashing_cost(size: int = 512 * MIB) -> None:
    from packer.hashing import sha256_chunked, sha256_range

    with tempfile.NamedTemporaryFile() as f:
        f.write(os.urandom(size))
        f.flush()
        fd = f.fileno()
        sha256_range(fd, 0, size)  # page cache warm
        # a 7B's density of cuts (2 328 in 13.5 GB: one per ~5.8 MB), none on the MiB grid
        cuts = tuple(range(5_800_007, size, 5_800_007))
        for name, run in [("whole only (before)", lambda: sha256_range(fd, 0, size)),
                          *[(f"whole + {c // MIB} MiB chunks", lambda c=c: sha256_chunked(fd, 0, size, c))
                            for c in (1 * MIB, 4 * MIB, 16 * MIB)],
                          ("whole + 1 MiB chunks, cut", lambda: sha256_chunked(fd, 0, size, MIB, cuts))]:
            cpu = min(_cpu(run) for _ in range(3))
            wall = min(_wall(run) for _ in range(3))
            print(f"  {name:24s} {cpu:6.3f} CPU-s, {wall:6.3f} s wall for {size // MIB} MiB "
                  f"({size / wall / 1e9:5.2f} GB/s)")


def reread_cost(size: int = 512 * MIB, rounds: int = 5) -> None:
    """Wall time of the build's re-read of one weight layer blob: two threads (the blob, the file
    inside it), the file hashed whole (before) or whole and in 1 MiB chunks (now)."""
    from concurrent.futures import ThreadPoolExecutor

    from packer.hashing import sha256_chunked, sha256_range

    with tempfile.NamedTemporaryFile() as f, ThreadPoolExecutor(2) as pool:
        f.write(os.urandom(size))
        f.flush()
        fd = f.fileno()
        file_hashers = {"before": lambda: sha256_range(fd, 4096, size - 1024),
                        "now": lambda: sha256_chunked(fd, 4096, size - 1024, MIB)}
        times: dict[str, list[float]] = {k: [] for k in file_hashers}
        for _ in range(rounds):  # interleaved
            for name, hash_file in file_hashers.items():
                t = time.perf_counter()
                jobs = [pool.submit(sha256_range, fd, 0, size), pool.submit(hash_file)]
                for j in jobs:
                    j.result()
                times[name].append(time.perf_counter() - t)
        for name, ts in times.items():
            ts.sort()
            print(f"  re-read {name:6s}: {ts[0]:.3f} / {ts[len(ts) // 2]:.3f} / {ts[-1]:.3f} s "
                  f"(min/median/max) for a {size // MIB} MiB blob")


def _wall(run) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    run()
    return time.perf_counter() - t


def _cpu(run) -> float:  # type: ignore[no-untyped-def]
    t = time.process_time()
    run()
    return time.process_time() - t


def aligned() -> None:
    """The chunks a build cuts now: hashed/share per degree, the table and its parse."""
    print("chunks cut at the ranks' splits (packer-chunks/v2; cut for TP 2, 4, 8):")
    for name, c in LLAMAS.items():
        for chunk in (1 * MIB, 4 * MIB):
            grid, cut = chunk_total(c, chunk, False), chunk_total(c, chunk, True)
            line = [f"  {name} {chunk // MIB:2d} MiB: table {table_bytes(c, chunk, True) / 1e6:6.3f} MB "
                    f"(grid {table_bytes(c, chunk) / 1e6:6.3f}), {cut} chunks (grid {grid}, +{cut - grid}), "
                    f"parsed in {parse_cost(c, chunk, True) * 1e3:5.1f} ms"]
            for world in (2, 4, 8, 3, 16):
                worst = max((per_rank(c, chunk, world, r, aligned=True) for r in range(world)),
                            key=lambda x: x[1] / x[0])
                line.append(f"TP{world}: {worst[1] / worst[0]:.4f} ({(worst[1] - worst[0]) / 1e6:.2f} MB over)")
            print(" | ".join(line))


def main() -> None:
    aligned()
    if "--aligned-only" in sys.argv:
        return
    for name, c in LLAMAS.items():
        total = sum(s[-1][0] + s[-1][1] for s in files(c))
        print(f"{name}: {total / 1e9:.1f} GB in {len(files(c))} files")
        for chunk in (1 * MIB, 2 * MIB, 4 * MIB, 16 * MIB):
            line = [f"  {chunk // MIB:2d} MiB: table {table_bytes(c, chunk) / 1e6:6.2f} MB, "
                    f"parsed in {parse_cost(c, chunk) * 1e3:5.1f} ms"]
            for world in (2, 4, 8):
                share, hashed, spans = per_rank(c, chunk, world, 0)
                line.append(f"TP{world}: hashed/share {hashed / share:5.3f} ({(hashed - share) / 1e6:6.0f} MB over, "
                            f"{spans} spans)")
            print(" | ".join(line))
    print("build re-read, hashing the file whole and in chunks from one buffer:")
    hashing_cost()
    reread_cost()


if __name__ == "__main__":
    main()
