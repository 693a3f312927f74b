"""Benchmark: ``packer convert`` of a ``torch.distributed.checkpoint`` folder against its floor.

Writes (once, cached under benchmarks/_work/) the llama-style bf16 state dict of
``benchmarks/convert.py`` as DCP folders, the way training ends: ``dcp.save({"model": ...,
"step": ...})`` from one process, and, with ``--ranks 2``, an FSDP2-style folder in which two gloo
ranks each write their row shard of every tensor (``Shard(0)``, FSDP2's placement; uneven where
the rows do not split evenly), so every tensor is assembled from two pieces in two files.

Each round, interleaved and with a warm page cache, measures the floor the weights stage is
measured against (benchmarks/RESULTS.md, "One copy of the weights"): the slower of a durable copy
of the folder's ``.distcp`` files (``cp``, then ``fsync``) and the faster of two sha256 passes over
them (over an mmap; ``hashlib.file_digest``), and then ``packer convert FOLDER -o OUT`` as a user
runs it (the CLI in a fresh process, sandboxed conversion, sha256 of the output as it is written),
as it returns and until OUT is durable (``fsync``, what the floor's copy pays). Then the peak
anonymous memory of the conversion (the sandboxed child's, where the bytes move) at two sizes:
it must not grow with the model.

    .venv/bin/python benchmarks/dcp_convert.py [--reps 5] [--gb 1.0] [--small-gb 0.25] [--ranks 2]
"""

from __future__ import annotations

import compileall
import os
import shutil
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build import fsync_tree, time_durable_cp, time_sha256_read  # noqa: E402
from convert import WORK, base_parser, settle, stats, time_sha256  # noqa: E402

PACKER = Path(sys.executable).with_name("packer")

# the state dict, built one tensor at a time from a per-tensor seed, so a rank can make its rows
# alone; convert.py's shapes (a llama of about ``gb`` GB in bf16)
STATE = textwrap.dedent("""
    import torch, convert

    def shapes(gb):
        H, I = convert.HIDDEN, convert.INTER
        V = min(convert.VOCAB, int(gb * 1e9 / 16 / H))  # untied: the two at most a quarter of a small model
        per_layer = 2 * (4 * H * H + 3 * H * I + 2 * H)
        out = {"model.embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "model.norm.weight": (H,)}
        for i in range(max(1, round((gb * 1e9 - 4 * V * H) / per_layer))):
            for name, shape in {"self_attn.q_proj": (H, H), "self_attn.k_proj": (H, H), "self_attn.v_proj": (H, H),
                                "self_attn.o_proj": (H, H), "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H),
                                "mlp.down_proj": (H, I)}.items():
                out[f"model.layers.{i}.{name}.weight"] = shape
            for norm in ("input_layernorm", "post_attention_layernorm"):
                out[f"model.layers.{i}.{norm}.weight"] = (H,)
        return out

    def tensor(i, shape):
        g = torch.Generator().manual_seed(i)
        return torch.empty(shape, dtype=torch.bfloat16).normal_(generator=g)
""")

SINGLE = STATE + textwrap.dedent("""
    import sys, warnings
    import torch.distributed.checkpoint as dcp
    warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
    gb, out = float(sys.argv[1]), sys.argv[2]
    sd = {name: tensor(i, shape) for i, (name, shape) in enumerate(shapes(gb).items())}
    dcp.save({"model": sd, "step": 1000}, checkpoint_id=out)
""")

RANKS = STATE + textwrap.dedent("""
    import os, sys, warnings
    import torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh
    warnings.simplefilter("ignore")

    def main(rank, gb, out, port, world):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        sd = {}
        for i, (name, shape) in enumerate(shapes(gb).items()):
            full = tensor(i, shape)  # each rank keeps only its rows, as FSDP2 does
            local = full.chunk(world, dim=0)[rank].clone() if rank < len(full.chunk(world, dim=0)) else full[:0].clone()
            sd[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape,
                                          stride=full.stride())
            del full
        dcp.save({"model": sd, "step": 1000}, checkpoint_id=out)
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        torch.multiprocessing.spawn(main, args=(float(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])),
                                    nprocs=int(sys.argv[4]))
""")


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def generate(gb: float, ranks: int) -> Path:
    """The DCP folder of a llama of about ``gb`` GB written by ``ranks`` processes (1: one ``dcp.save``)."""
    path = WORK / f"dcp_{gb:g}gb_{ranks}r"
    if (path / ".metadata").is_file():
        return path
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    script = WORK / f"dcp_write_{ranks}.py"
    script.write_text(SINGLE if ranks == 1 else RANKS)
    args = [str(gb), str(tmp)] + ([] if ranks == 1 else [_port(), str(ranks)])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(script), *args], check=True, env=env)
    os.replace(tmp, path)
    return path


def data_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.distcp"))


def warm(folder: Path) -> None:
    for p in [folder / ".metadata", *data_files(folder)]:
        with open(p, "rb", buffering=0) as f:
            while f.read(64 * 2**20):
                pass


def floor(folder: Path) -> dict[str, float]:
    """The floor's parts over every ``.distcp`` file of ``folder``, summed: seconds."""
    place = WORK / "dcp_cp"
    place.mkdir(exist_ok=True)
    copy = sum(time_durable_cp(p, place) for p in data_files(folder))
    mmap_pass = sum(next(iter(time_sha256(p).values())) for p in data_files(folder))
    read_pass = sum(time_sha256_read(p) for p in data_files(folder))
    return {"durable copy of the .distcp files (cp + fsync)": copy,
            "one sha256 pass: over an mmap, 8 MiB at a time": mmap_pass,
            "one sha256 pass: hashlib.file_digest": read_pass,
            "floor: the slower of the copy and the faster pass": max(copy, min(mmap_pass, read_pass))}


def time_convert(folder: Path) -> dict[str, float]:
    """``packer convert`` through the CLI: wall seconds as it returns and until OUT is durable."""
    out = WORK / "dcp_out"
    shutil.rmtree(out, ignore_errors=True)
    settle()
    start = time.perf_counter()
    subprocess.run([str(PACKER), "convert", str(folder), "-o", str(out), "-q"], check=True)
    wall = time.perf_counter() - start
    fsync_tree(out)
    durable = time.perf_counter() - start
    shutil.rmtree(out)
    return {"packer convert (whole process)": wall, "packer convert until OUT is durable (+ fsync)": durable}


# the call the CLI makes (sandboxed: a child converts), timed after the imports, as the weights
# stage's own timing in a build is
CALL = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from packer.recipe import WeightsConfig
    from packer.weights.options import ConvertOptions
    from packer.weights.sandbox import convert_cli
    t = time.perf_counter()
    convert_cli(Path(sys.argv[1]), Path(sys.argv[2]), WeightsConfig(), ConvertOptions())
    print(time.perf_counter() - t)
""")


def time_call(folder: Path) -> dict[str, float]:
    """The conversion call alone (imports done before the clock starts): seconds."""
    out = WORK / "dcp_out"
    shutil.rmtree(out, ignore_errors=True)
    settle()
    done = subprocess.run([sys.executable, "-c", CALL, str(folder), str(out)], capture_output=True, text=True,
                          check=True)
    shutil.rmtree(out)
    return {"packer convert's call (sandboxed, imports before the clock)": float(done.stdout)}


# the sandboxed child is where the tensor bytes move: its peak RssAnon is sampled from outside, and
# the parent's own VmHWM read at the end, by a small driver running the CLI's function in process
MEMORY = textwrap.dedent("""
    import sys, threading, time
    from pathlib import Path
    from packer.recipe import WeightsConfig
    from packer.weights.options import ConvertOptions
    from packer.weights.sandbox import convert_cli

    def anon(pid):
        try:
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return 0
        return 0

    def kids():
        import os
        me, out = str(os.getpid()), []
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    if open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == me:
                        out.append(int(p))
                except OSError:
                    pass
        return out

    peak, stop = [0], False
    def sample():
        while not stop:
            peak.append(max([anon(k) for k in kids()] or [0])); time.sleep(0.002)
        assert sum(p > 0 for p in peak) > 5, "the child was never seen"
    th = threading.Thread(target=sample); th.start()
    convert_cli(Path(sys.argv[1]), Path(sys.argv[2]), WeightsConfig(), ConvertOptions())
    stop = True; th.join()
    hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
    print(max(peak), int(hwm) * 1024)
""")


def peak_memory(folder: Path) -> tuple[int, int]:
    """(the sandboxed child's peak RssAnon, the parent's VmHWM) of converting ``folder``, bytes."""
    out = WORK / "dcp_mem"
    shutil.rmtree(out, ignore_errors=True)
    done = subprocess.run([sys.executable, "-c", MEMORY, str(folder), str(out)], capture_output=True, text=True,
                          check=True)
    shutil.rmtree(out)
    child, hwm = (int(x) for x in done.stdout.split())
    return child, hwm


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--small-gb", type=float, default=0.25, help="the second size of the memory check")
    parser.add_argument("--ranks", type=int, default=2, help="also an FSDP2-style folder by this many ranks (1: not)")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    # as a pip install has it: this machine sets PYTHONDONTWRITEBYTECODE, and an editable checkout
    # would compile every module again in both of a conversion's processes (0.2 s a process)
    compileall.compile_dir(Path(__file__).resolve().parents[1] / "packer", quiet=1)
    folders = {"dcp.save, 1 process": generate(args.gb, 1)}
    if args.ranks > 1:
        folders[f"FSDP2-style, {args.ranks} ranks (Shard(0))"] = generate(args.gb, args.ranks)
    results: dict[str, dict[str, list[float]]] = {k: {} for k in folders}
    for _ in range(args.reps):
        for label, folder in folders.items():
            warm(folder)
            for part in (floor(folder), time_convert(folder), time_call(folder)):
                for name, value in part.items():
                    results[label].setdefault(name, []).append(value)
    print(f"\n{args.reps} interleaved rounds, warm page cache, {os.cpu_count()} CPUs")
    print("\n| input | what | seconds (min / median / max) | median / the floor's median |")
    print("|---|---|---|---|")
    for label, folder in folders.items():
        size = sum(p.stat().st_size for p in data_files(folder)) / 1e9
        base = statistics.median(results[label]["floor: the slower of the copy and the faster pass"])
        for name, vals in results[label].items():
            print(f"| {label}, {size:.2f} GB | {name} | {stats(vals)} | {statistics.median(vals) / base:.2f} × |")
    print("\n| input | the child's peak RssAnon | the parent's VmHWM |")
    print("|---|---|---|")
    sizes = [generate(args.small_gb, 1), folders["dcp.save, 1 process"]]
    if args.ranks > 1:
        sizes += [generate(args.small_gb, args.ranks), folders[f"FSDP2-style, {args.ranks} ranks (Shard(0))"]]
    for folder in sizes:
        child, hwm = peak_memory(folder)
        size = sum(p.stat().st_size for p in data_files(folder)) / 1e9
        print(f"| {folder.name}, {size:.2f} GB | {child / 2**20:.0f} MiB | {hwm / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
