"""The runtime's Loader against the safetensors library's own load, on CPU.

The CUDA pipeline's scheduling (ring, reader threads, copy engine) runs here against the CPU
engine: same code, a copy thread in place of the CUDA stream.
"""

from __future__ import annotations

import gc
import io
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from packer.runtime.empty import init_empty
from packer.runtime.engines import CpuEngine
from packer.runtime.env import STARTUP_ENV, ArtifactMismatchError
from packer.runtime.graphs import Captured, GraphPool, warmup
from packer.runtime.loader import check_loaded, selftest
from packer.runtime.loading import Loader
from packer.runtime.ring import RingStats, plan_chunks, run_pipeline
from packer.runtime.timeline import Timeline
from tests.loader_fixtures import (
    WatchedEngine,
    make_artifacts,
    make_bundle,
    misaligned,
    sample_tensors,
    write_raw_safetensors,
)
from tests.loader_fixtures import make_loader as loader

ROOT = Path(__file__).resolve().parents[1]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(_bytes(got[k]), _bytes(v)), k


def reference(root: Path, m: dict[str, Any]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for rel in m["weights"]["files"]:
        out.update(load_file(root / rel))
    return out


@pytest.fixture()
def two_shards(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    big = {"big.weight": torch.randn(300, 70), "big.bias": torch.randn(70).to(torch.bfloat16)}
    m = make_artifacts(tmp_path, [sample_tensors(), big], aliases={"lm_head.weight": "embed.weight"})
    return tmp_path, m


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACKER_STARTUP_LOG", "off")


# --- CPU zero copy -----------------------------------------------------------------------


def test_cpu_views_share_one_private_mapping(two_shards: tuple[Path, dict[str, Any]]) -> None:
    root, m = two_shards
    ld = loader(root, m)
    sd = ld.load_weights("cpu")
    assert_same(sd, reference(root, m))
    # what lies 64-aligned in the file is a view, only the rest (odd sizes after odd sizes) a copy
    copied = misaligned(root, m)
    assert copied and sorted(ld.last_copied) == sorted(copied)
    assert all(t.data_ptr() % 64 == 0 for t in sd.values())
    shard1 = [k for k, v in m["weights"]["tensors"].items() if v["file"] == m["weights"]["files"][0]]
    bases = {sd[k].untyped_storage().data_ptr() for k in shard1 if k not in copied}
    assert len(bases) == 1  # every aligned tensor is a view of the one mapping
    assert sd["embed.weight"].untyped_storage().nbytes() == m["files"][m["weights"]["files"][0]]["size"]
    before = (root / m["weights"]["files"][0]).read_bytes()
    sd["embed.weight"].fill_(7.0)  # copy-on-write: the file never changes
    assert (root / m["weights"]["files"][0]).read_bytes() == before


def test_aliases_are_the_same_tensor(two_shards: tuple[Path, dict[str, Any]]) -> None:
    root, m = two_shards
    for kw in ({}, {"copy": True}, {"pipeline": True}):
        sd = loader(root, m).load_weights("cpu", **kw)
        assert sd["lm_head.weight"] is sd["embed.weight"], kw


def _vm_flags(ptr: int) -> list[str]:
    """The kernel's VmFlags of the mapping holding address ``ptr`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {ptr:#x}")


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()


@pytest.mark.parametrize("hugepages", ["0", "1"])
def test_copy_mode_is_private_memory(two_shards: tuple[Path, dict[str, Any]], hugepages: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACKER_HUGEPAGES", hugepages)
    root, m = two_shards
    ld = loader(root, m)
    sd = ld.load_weights("cpu", copy=True)
    want = {k: v.clone() for k, v in reference(root, m).items()}
    assert_same(sd, want)
    # huge pages are advised only when asked, and the stage says whether the kernel took it;
    # the kernel's own flag ("hg": MADV_HUGEPAGE) agrees, buffer by buffer
    (read,) = [s for s in ld.report() if s["stage"] == "read"]
    on = hugepages == "1" and THP
    assert read["hugepages"] == (len(m["weights"]["files"]) if on else 0)
    buffers = {t.untyped_storage().data_ptr() for n, t in sd.items() if t.numel() and n not in ld.last_copied}
    assert len(buffers) == len(m["weights"]["files"])
    for ptr in buffers:
        assert ("hg" in _vm_flags(ptr)) == on, _vm_flags(ptr)
    path = root / m["weights"]["files"][1]
    path.write_bytes(bytes(path.stat().st_size))  # the file changes, the tensors do not
    assert_same(sd, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pipeline", [False, True])
def test_dtype_override_casts_floats_only(two_shards: tuple[Path, dict[str, Any]],
                                          dtype: torch.dtype, pipeline: bool) -> None:
    root, m = two_shards
    sd = loader(root, m).load_weights("cpu", dtype=dtype, pipeline=pipeline)
    ref = reference(root, m)
    for k, v in ref.items():
        if v.is_floating_point():
            assert sd[k].dtype == dtype and torch.equal(sd[k], v.to(dtype)), k
        else:
            assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
    assert sd["lm_head.weight"] is sd["embed.weight"]


def test_misaligned_offsets_are_copied_not_misread(tmp_path: Path) -> None:
    vals = torch.arange(6, dtype=torch.float32)
    write_raw_safetensors(tmp_path / "weights/model.safetensors",
                          [("odd", "U8", [3], b"\x01\x02\x03"),
                           ("f", "F32", [2, 3], vals.numpy().tobytes()),
                           ("h", "BF16", [2], torch.ones(2, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())],
                          pad=3)
    from tests.loader_fixtures import describe

    m = describe(tmp_path, ["weights/model.safetensors"])
    for kw in ({}, {"copy": True}, {"pipeline": True}):
        sd = loader(tmp_path, m).load_weights("cpu", **kw)
        assert torch.equal(sd["f"], vals.view(2, 3)), kw
        assert sd["odd"].tolist() == [1, 2, 3] and sd["h"].tolist() == [1.0, 1.0]


# --- the pipeline through the CPU engine -------------------------------------------------


@pytest.mark.parametrize(("slots", "chunk"), [(1, 4096), (3, 4096), (4, 2**20), (2, 512)])
def test_pipeline_bitwise_equal(two_shards: tuple[Path, dict[str, Any]], slots: int, chunk: int) -> None:
    root, m = two_shards
    ld = loader(root, m, slots=slots, chunk=chunk, readers=3)
    engine = WatchedEngine()
    ld.make_engine = lambda dev: engine
    sd = ld.load_weights("cpu", pipeline=True)
    assert_same(sd, reference(root, m))
    stats = ld.last_stats
    assert stats is not None and stats.host_bytes <= slots * chunk and stats.max_chunk <= chunk
    assert engine.copies == stats.chunks and engine.overwritten == 0 and engine.max_pending <= slots


def test_ring_stays_within_budget_under_a_slow_stream(two_shards: tuple[Path, dict[str, Any]]) -> None:
    root, m = two_shards
    ld = loader(root, m)
    shards = ld.open_shards()
    try:
        engine = WatchedEngine(copy_delay=0.002)  # copies lag behind reads: slots must wait
        bufs = [engine.device_buffer(s.size - s.data_start) for s in shards]
        segs = [(i, s.data_start, s.size - s.data_start, b) for i, (s, b) in enumerate(zip(shards, bufs, strict=True))]
        stats = RingStats()
        run_pipeline(shards, plan_chunks(segs, 8192), engine, slots=3, chunk=8192, readers=4,
                       stats=stats)
    finally:
        for s in shards:
            s.close()
    assert stats.chunks > 3 * 3 and stats.host_bytes <= 3 * 8192
    # measured by the engine, not the ring: no slot refilled under a waiting copy, at most one
    # copy in flight per slot (tests/test_ring.py shows the watch catches a ring that refills early)
    assert engine.copies == stats.chunks and engine.overwritten == 0 and 1 < engine.max_pending <= 3
    for s, b in zip(shards, bufs, strict=True):
        assert bytes(b.numpy()) == (root / s.rel).read_bytes()[s.data_start:]


def test_reader_errors_reach_the_caller(two_shards: tuple[Path, dict[str, Any]]) -> None:
    root, m = two_shards
    ld = loader(root, m, chunk=4096, slots=2)
    shards = ld.open_shards()
    try:
        os.truncate(root / shards[1].rel, shards[1].size - 100)  # shrinks after the header check
        segs = [(i, s.data_start, s.size - s.data_start, torch.empty(s.size - s.data_start, dtype=torch.uint8))
                for i, s in enumerate(shards)]
        with pytest.raises(ArtifactMismatchError, match="truncated at byte"):
            run_pipeline(shards, plan_chunks(segs, 4096), CpuEngine(), slots=2, chunk=4096, readers=2)
    finally:
        for s in shards:
            s.close()


def test_ring_refuses_over_budget() -> None:
    with pytest.raises(ValueError, match="512 MiB"):
        run_pipeline([], [], CpuEngine(), slots=9, chunk=64 * 2**20, readers=1)


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=12),
       gaps=st.lists(st.booleans(), min_size=12, max_size=12),
       chunk=st.integers(1, 3000))
def test_plan_chunks_covers_every_byte_once(sizes: list[int], gaps: list[bool], chunk: int) -> None:
    segs, off = [], 0
    for i, n in enumerate(sizes):
        off += 7 if gaps[i] else 0
        segs.append((i % 2, off, n, torch.zeros(n, dtype=torch.uint8)))
        off += n
    chunks = plan_chunks(segs, chunk)
    assert all(0 < c.nbytes <= chunk for c in chunks)
    for c in chunks:  # copies tile the chunk exactly, in order
        assert [a for a, _ in c.copies] == [sum(d.numel() for _, d in c.copies[:i]) for i in range(len(c.copies))]
        assert sum(d.numel() for _, d in c.copies) == c.nbytes
    assert sum(c.nbytes for c in chunks) == sum(sizes)


# --- refusing artifacts that do not match ------------------------------------------------


def test_verify_catches_a_flipped_byte(two_shards: tuple[Path, dict[str, Any]]) -> None:
    root, m = two_shards
    path = root / m["weights"]["files"][1]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(data)
    loader(root, m).load_weights("cpu")  # sizes and headers still match
    for kw in ({}, {"pipeline": True}):
        with pytest.raises(ArtifactMismatchError, match=r"model-00002-of-00002.safetensors: sha256"):
            loader(root, m).load_weights("cpu", verify=True, **kw)


def test_refuses_wrong_size_header_and_missing_file(two_shards: tuple[Path, dict[str, Any]]) -> None:
    root, m = two_shards
    rel = m["weights"]["files"][0]
    good = (root / rel).read_bytes()
    (root / rel).write_bytes(good + b"\0")
    with pytest.raises(ArtifactMismatchError,
                       match=rf"^{re.escape(str(root / rel))}: {len(good) + 1} bytes, the manifest says {len(good)}"):
        loader(root, m).load_weights("cpu")
    (root / rel).write_bytes(good.replace(b'"embed.weight"', b'"embed.weighX"', 1))
    with pytest.raises(ArtifactMismatchError, match=r"header tensors differ.*embed.weighX"):
        loader(root, m).load_weights("cpu")
    (root / rel).write_bytes(good)
    bad = json.loads(json.dumps(m))
    bad["weights"]["tensors"]["embed.weight"]["shape"] = [32, 64]
    with pytest.raises(ArtifactMismatchError, match=r"'embed.weight' shape is \[64, 32\]"):
        loader(root, bad).load_weights("cpu")
    (root / rel).unlink()
    with pytest.raises(ArtifactMismatchError, match=rf"^{rel}: missing .*PACKER_WEIGHTS_DIR"):
        loader(root, m).load_weights("cpu", pipeline=True)
    (root / rel).write_bytes(good)
    (root / m["weights"]["index"]).write_text("{}")
    with pytest.raises(ArtifactMismatchError, match="index.json: 2 bytes"):
        loader(root, m).load_weights("cpu")


def _with_header(raw: bytes, change: Any) -> bytes:
    """``raw`` (a safetensors file) with ``change(header)`` applied, the header's length kept."""
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    return raw[:8] + text + b" " * (n - len(text)) + raw[8 + n:]


@pytest.mark.parametrize("change", [
    lambda h: h.update({"embed.weight": 7}),
    lambda h: h.update({"embed.weight": "x"}),
    lambda h: h.update({"embed.weight": None}),
    lambda h: h["embed.weight"].update(shape=5),
    lambda h: h["embed.weight"].update(data_offsets="0"),
    lambda h: h["embed.weight"].pop("dtype"),
], ids=["number", "string", "null", "shape-int", "offsets-string", "no-dtype"])
def test_a_corrupt_header_entry_is_an_artifact_mismatch(two_shards: tuple[Path, dict[str, Any]],
                                                        change: Any) -> None:
    root, m = two_shards
    rel = m["weights"]["files"][0]
    (root / rel).write_bytes(_with_header((root / rel).read_bytes(), change))
    with pytest.raises(ArtifactMismatchError, match=rf"^{re.escape(str(root / rel))}: tensor 'embed.weight'"):
        loader(root, m).load_weights("cpu")


def test_weights_dir_override(two_shards: tuple[Path, dict[str, Any]],
                              tmp_path_factory: pytest.TempPathFactory) -> None:
    root, m = two_shards
    other = tmp_path_factory.mktemp("mounted")
    for rel in [*m["weights"]["files"], m["weights"]["index"]]:
        (root / rel).rename(other / Path(rel).name)
    ld = Loader(m, root, weights_dir=other, timeline=Timeline())
    assert ld.load_weights("cpu")["lm_head.weight"].shape == (64, 32)


@pytest.mark.slow
def test_mapping_outlives_the_loader(two_shards: tuple[Path, dict[str, Any]]) -> None:
    root, m = two_shards
    (root / "m.json").write_text(json.dumps(m))
    want = float(reference(root, m)["big.weight"].double().sum())
    script = textwrap.dedent(f"""
        import gc, json, os, sys
        from pathlib import Path
        from packer.runtime.loading import Loader
        root = Path({str(root)!r})
        m = json.loads((root / "m.json").read_text())
        ld = Loader(m, root)
        sd = ld.load_weights("cpu")
        del ld, Loader
        for name in [k for k in sys.modules if k.startswith("packer")]:
            del sys.modules[name]
        gc.collect()
        for rel in m["weights"]["files"]:
            os.unlink(root / rel)
        total = sum(float(t.double().sum()) for t in sd.values() if t.is_floating_point())
        print(float(sd["big.weight"].double().sum()))
    """)
    env = {**os.environ, "PACKER_STARTUP_LOG": "off"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr  # -7 would be SIGBUS
    assert float(r.stdout) == pytest.approx(want)


# --- load_into ---------------------------------------------------------------------------


class Tiny(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8, dtype=dtype)
        self.proj = torch.nn.Linear(8, 8, dtype=dtype)
        self.head = torch.nn.Linear(8, 10, bias=False, dtype=dtype)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.norm = torch.nn.LayerNorm(8, dtype=dtype)


def tiny_artifacts(root: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    src = Tiny()
    torch.manual_seed(1)
    for p in src.parameters():
        torch.nn.init.normal_(p)
    sd = {k: v.detach().clone() for k, v in src.state_dict().items() if k != "head.weight"}
    sd["steps"] = torch.tensor(42)
    sd["extra.unused"] = torch.ones(3)
    del sd["norm.bias"]
    m = make_artifacts(root, [sd], aliases={"head.weight": "embed.weight"})
    return m, sd


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_load_into_copies_into_the_parameters(tmp_path: Path, pipeline: bool, dtype: torch.dtype) -> None:
    m, sd = tiny_artifacts(tmp_path)
    model = Tiny(dtype)
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    ld = loader(tmp_path, m, chunk=256, slots=2)
    with pytest.raises(RuntimeError, match=r"missing keys \['norm.bias'\], unexpected keys \['extra.unused'\]"):
        ld.load_into(model, pipeline=pipeline)
    missing, unexpected = ld.load_into(model, strict=False, pipeline=pipeline)
    assert (missing, unexpected) == (["norm.bias"], ["extra.unused"])
    got = model.state_dict()
    assert {k: v.data_ptr() for k, v in got.items()} == ptrs  # same storage, no second copy
    for k, v in sd.items():
        if k in got:
            assert torch.equal(got[k], v.to(got[k].dtype)), k
    assert model.head.weight is model.embed.weight and int(model.steps) == 42
    assert torch.equal(got["head.weight"], sd["embed.weight"].to(dtype))


def test_load_into_assigns_meta_parameters_and_checks_shapes(tmp_path: Path) -> None:
    m, sd = tiny_artifacts(tmp_path)
    with init_empty():
        meta = Tiny()
    assert meta.embed.weight.is_meta and not meta.steps.is_meta  # buffers are real
    result = loader(tmp_path, m).load_into(meta, strict=False)
    assert (result.missing, result.unexpected) == (["norm.bias"], ["extra.unused"])
    assert any("norm.bias: nothing to load; left on meta" in n for n in result.notes)
    got = meta.state_dict()
    assert all(torch.equal(got[k], v) for k, v in sd.items() if k in got)
    assert meta.head.weight is meta.embed.weight  # the tie survives: one Parameter
    assert isinstance(meta.proj.weight, torch.nn.Parameter) and meta.proj.weight.requires_grad
    assert int(meta.steps) == 42
    model = Tiny()
    model.proj = torch.nn.Linear(8, 4)
    want = r"size mismatch for proj.weight: the weights have shape \[8, 8\], the module \[4, 8\]"
    with pytest.raises(RuntimeError, match=want):
        loader(tmp_path, m).load_into(model, strict=False)


# --- warm-up and the graph pool ----------------------------------------------------------


def fake_capture(calls: list[tuple[int, ...]]) -> Any:
    """A CPU stand-in for CUDA graph capture: static inputs, a replay that reruns the model."""

    def capture(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], pool: Any) -> Captured:
        calls.append(tuple(args[0].shape))
        if args[0].shape[0] == 3:
            raise RuntimeError("operation not permitted when stream is capturing")
        static = [args[0].clone()]
        out = model(static[0])
        holder = {"out": out}

        def replay() -> None:
            holder["out"].copy_(model(static[0]))

        return Captured(replay, static, out)

    return capture


def test_graph_pool_replays_known_shapes_and_falls_back_otherwise() -> None:
    model = torch.nn.Linear(4, 2)
    calls: list[tuple[int, ...]] = []
    pool = GraphPool(model, capture=fake_capture(calls))
    assert pool.capture((torch.zeros(2, 4),), {})
    with pytest.warns(RuntimeWarning, match="capture failed"):
        assert not pool.capture((torch.zeros(3, 4),), {})
    for n in (2, 3, 5, 2):
        x = torch.randn(n, 4)
        out = pool(x)
        assert torch.allclose(out, model(x).detach())
    assert (pool.replays, pool.fallbacks) == (2, 2)
    first = pool(torch.ones(2, 4))
    pool(torch.zeros(2, 4))
    assert torch.allclose(first, model(torch.ones(2, 4)).detach())  # outputs are not overwritten


def test_warmup_on_cpu_runs_examples_and_returns_a_fallback_pool() -> None:
    seen: list[tuple[int, ...]] = []

    class Probe(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(tuple(x.shape))
            return x * 2

    tl = Timeline()
    fn = warmup(Probe(), [torch.ones(1, 3), (torch.ones(2, 3),), {"x": torch.ones(4, 3)}],
                  cuda_graphs=True, iters=2, timeline=tl)
    assert seen == [(1, 3), (1, 3), (2, 3), (2, 3), (4, 3), (4, 3)]
    assert fn.graphs == {} and torch.equal(fn(torch.ones(2)), torch.full((2,), 2.0))
    assert [s["stage"] for s in tl.stages] == ["warm-up"]
    seen.clear()
    warmup(Probe(), {"x": torch.ones(5, 3)}, iters=1, timeline=tl)  # one kwargs example, not a list
    warmup(Probe(), torch.ones(6, 3), iters=1, timeline=tl)  # one tensor
    assert seen == [(5, 3), (6, 3)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="hardware: CUDA graph capture needs a GPU")
def test_cuda_graph_capture_on_gpu() -> None:
    model = torch.nn.Linear(16, 4).cuda()
    fn = warmup(model, [torch.randn(8, 16, device="cuda")], cuda_graphs=True)
    x = torch.randn(8, 16, device="cuda")
    assert torch.allclose(fn(x), model(x)) and fn.replays == 1
    assert fn(torch.randn(3, 16, device="cuda")).shape == (3, 4) and fn.fallbacks == 1


# --- timing, trace, environment, prefetch, bundle ----------------------------------------


def test_stage_table_text_json_and_off(two_shards: tuple[Path, dict[str, Any]],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    root, m = two_shards
    ld = loader(root, m)
    ld.load_weights("cpu", pipeline=True)
    for mode in ("text", "json", "off"):
        monkeypatch.setenv("PACKER_STARTUP_LOG", mode)
        ld.timeline._printed = 0
        buf = io.StringIO()
        ld.timeline.flush(buf)
        lines = buf.getvalue().splitlines()
        if mode == "text":
            assert lines[0].startswith("[startup] headers: ") and lines[-1].startswith("[startup] total: ")
            assert any(x.startswith("[startup] read: ") and "MB/s" not in x and "GB/s" in x for x in lines)
        elif mode == "json":
            (line,) = lines
            rec = json.loads(line)
            assert {s["stage"] for s in rec["startup"]} >= {"headers", "read"} and rec["total_s"] >= 0
        else:
            assert lines == []


def test_chrome_trace(two_shards: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    root, m = two_shards
    ld = loader(root, m)
    ld.load_weights("cpu", pipeline=True)
    stages = ld.report(trace=tmp_path / "startup.json")
    trace = json.loads((tmp_path / "startup.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == [s["stage"] for s in stages]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 and e["args"]["bytes"] >= 0 for e in spans)
    assert {e["tid"] for e in spans} >= {0, 1, 2}  # main, read, copy lanes
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names[1] == "reader threads" and names[2] == "copy engine"


def run_py(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in STARTUP_ENV}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, cwd=ROOT, env={**base, **(env or {})})


def test_environment_is_set_before_cuda_and_never_overridden() -> None:
    r = run_py("""
        import os, sys
        import packer.runtime.loader
        assert "torch" not in sys.modules  # torch is imported lazily
        print(os.environ["CUDA_MODULE_LOADING"], os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "-"))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["LAZY", "-"]  # the allocator is left alone (tests/test_env.py)
    r = run_py("import os, packer.runtime.loader; print(os.environ['CUDA_MODULE_LOADING'])",
               {"CUDA_MODULE_LOADING": "EAGER"})
    assert r.stdout.strip() == "EAGER"


def test_warns_when_cuda_was_initialised_first() -> None:
    r = run_py("""
        import sys, types, warnings
        fake = types.ModuleType("torch")
        fake.cuda = types.SimpleNamespace(is_initialized=lambda: True)
        sys.modules["torch"] = fake
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import packer.runtime.loader
        print(w[0].message)
    """)
    assert r.returncode == 0, r.stderr
    assert "CUDA was initialised before the loader was imported; CUDA_MODULE_LOADING" in r.stdout


def test_prefetch_reads_every_weight_file(two_shards: tuple[Path, dict[str, Any]]) -> None:
    root, m = two_shards
    ld = loader(root, m)
    t = ld.prefetch()
    assert t is not None
    t.join(10)
    assert ld.prefetch(background=False) is None
    stages = [s for s in ld.report() if s["stage"] == "prefetch"]
    assert len(stages) == 2 and stages[0]["bytes"] == sum(m["files"][r]["size"] for r in m["weights"]["files"])


def test_bundle_dir_extracts_once(two_shards: tuple[Path, dict[str, Any]], tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    root, m = two_shards
    m["bundle"] = make_bundle(root / "bundle.tar.zst", {"tokenizer.json": b"{}", "config.json": b'{"a":1}'})
    m["files"]["bundle.tar.zst"] = {k: m["bundle"][k] for k in ("size", "sha256")}
    monkeypatch.setenv("PACKER_BUNDLE_CACHE", str(tmp_path / "cache"))
    ld = loader(root, m)
    d = ld.bundle_dir()
    assert (d / "config.json").read_bytes() == b'{"a":1}' and ld.bundle_dir() == d
    assert selftest(ld, "cpu", verify=True) == []
    m["bundle"]["sha256"] = "0" * 64
    with pytest.raises(ArtifactMismatchError, match="bundle.tar.zst: .*sha256"):
        loader(root, m).bundle_dir()
    m["bundle"] = None
    with pytest.raises(ArtifactMismatchError, match="no bundle"):
        loader(root, m).bundle_dir()


def test_selftest_reports_bytes_that_differ(two_shards: tuple[Path, dict[str, Any]]) -> None:
    root, m = two_shards
    ld = loader(root, m)
    sd = ld.load_weights("cpu", copy=True)
    assert check_loaded(ld, sd) == []
    sd["big.weight"][0, 0] += 1
    sd["lm_head.weight"] = sd["embed.weight"].clone()
    problems = check_loaded(ld, sd)
    assert problems == [
        "alias 'lm_head.weight' is not the same tensor as 'embed.weight'",
        "weights/model-00002-of-00002.safetensors: tensor 'big.weight' bytes differ from the file",
    ]


def test_gc_keeps_pipeline_buffers(two_shards: tuple[Path, dict[str, Any]]) -> None:
    root, m = two_shards
    sd = loader(root, m).load_weights("cpu", pipeline=True)
    gc.collect()
    assert_same(sd, reference(root, m))


def test_one_process_prints_growing_totals_and_the_last_is_the_whole_start_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from packer.runtime.timeline import Timeline

    monkeypatch.setenv("PACKER_STARTUP_LOG", "text")
    tl = Timeline()
    t0 = tl.t0
    tl.add("headers", t0 + 1.0, t0 + 1.5)
    first = io.StringIO()
    tl.flush(first)
    tl.add("read", t0 + 2.0, t0 + 4.0)
    second = io.StringIO()
    tl.flush(second)
    assert first.getvalue().splitlines()[-1] == "[startup] total: 0.50s since the first stage (this call: 0.50s)"
    assert second.getvalue().splitlines() == ["[startup] read: 2.00s",
                                              "[startup] total: 3.00s since the first stage (this call: 2.00s)"]
