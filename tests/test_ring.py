"""The staging ring through the CPU stand-in engine: kept per process, hashing, geometry, layout."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from packer.runtime import ring
from packer.runtime.engines import ALIGN, CopyEngine, CpuEngine
from packer.runtime.env import ArtifactMismatchError
from packer.runtime.layout import plan_layout
from packer.runtime.loading import Loader
from packer.runtime.ring import RingStats, plan_chunks, release_ring, run_pipeline
from tests.loader_fixtures import WatchedEngine, describe, make_artifacts, sample_tensors, write_raw_safetensors
from tests.loader_fixtures import make_loader as loader

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh_ring(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("PACKER_STARTUP_LOG", "off")
    ring.release_ring()
    yield
    ring.release_ring()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def reference(root: Path, m: dict[str, Any]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for rel in m["weights"]["files"]:
        out.update(load_file(root / rel))
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(_bytes(got[k]), _bytes(v)), k


@pytest.fixture()
def model(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """Two shards; F32 tensors of odd sizes before BF16 ones, as safetensors packs them."""
    g = torch.Generator().manual_seed(1)
    big = {"big.weight": torch.randn(300, 70, generator=g), "big.bias": torch.randn(70).to(torch.bfloat16),
           "odd.f32": torch.randn(1001, 3, generator=g), "late.bf16": torch.randn(64, 33).to(torch.bfloat16)}
    m = make_artifacts(tmp_path, [sample_tensors(), big], aliases={"lm_head.weight": "embed.weight"})
    return tmp_path, m


# --- the ring is pinned once per process ---------------------------------------------------


class RecordingEngine(CpuEngine):
    """The CPU engine; counts the host buffers it hands out and the ones freed."""

    made: list[int] = []
    freed: list[int] = []

    def host_buffer(self, nbytes: int) -> tuple[Any, Any, str]:
        buf, _, kind = super().host_buffer(nbytes)
        ptr = buf.data_ptr()
        RecordingEngine.made.append(ptr)
        return buf, lambda: RecordingEngine.freed.append(ptr), kind


def test_cpu_engine_imports_torch_itself() -> None:
    script = textwrap.dedent("""
        import sys
        from packer.runtime.engines import CpuEngine
        assert "torch" not in sys.modules
        engine = CpuEngine()
        src, dst = engine.host_buffer(4)[0], engine.device_buffer(4)
        src.fill_(7)
        engine.wait(engine.copy([(dst, src)]))
        engine.finish()
        print(dst.tolist())
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[7, 7, 7, 7]"


def test_engines_satisfy_the_copy_engine_protocol() -> None:
    engines = [CpuEngine(), RecordingEngine(), CpuEngine(copy_delay=0.001)]
    try:
        assert all(isinstance(e, CopyEngine) for e in engines)
        assert not isinstance(object(), CopyEngine)
    finally:
        for e in engines:
            e.finish()


def test_ring_is_kept_across_loads_and_freed_only_on_request(model: tuple[Path, dict[str, Any]]) -> None:
    root, m = model
    RecordingEngine.made, RecordingEngine.freed = [], []
    ld = loader(root, m, slots=3, chunk=4096)
    ld.make_engine = lambda dev: RecordingEngine()
    for _ in range(3):
        assert_same(ld.load_weights("cpu", pipeline=True), reference(root, m))
    assert len(RecordingEngine.made) == 3 and RecordingEngine.freed == []  # pinned once, kept
    pins = [s for s in ld.report() if s["stage"].startswith("pin ring")]
    assert len(pins) == 1 and pins[0]["bytes"] == 3 * 4096
    assert ld.last_stats is not None and ld.last_stats.pin_seconds == 0.0  # the third load pinned nothing
    assert release_ring() == 3 * 4096
    assert sorted(RecordingEngine.freed) == sorted(RecordingEngine.made)
    assert ring.release_ring() == 0
    ld.load_weights("cpu", pipeline=True)
    assert len(RecordingEngine.made) == 6  # pinned again after the release


def test_ring_is_repinned_only_when_a_load_needs_more_or_allows_less(model: tuple[Path, dict[str, Any]]) -> None:
    root, m = model
    RecordingEngine.made = []
    ld = loader(root, m, slots=4, chunk=8192)
    ld.make_engine = lambda dev: RecordingEngine()
    ld.load_weights("cpu", pipeline=True)
    ld.slots = 2  # fewer slots of the same size: the ring is reused
    ld.load_weights("cpu", pipeline=True)
    assert len(RecordingEngine.made) == 4
    ld.chunk = 2048  # slots larger than this load's budget: pinned again, smaller
    ld.load_weights("cpu", pipeline=True)
    assert len(RecordingEngine.made) == 6
    assert ld.last_stats is not None and ld.last_stats.host_bytes == 2 * 2048


def test_concurrent_loads_take_turns_on_the_ring(model: tuple[Path, dict[str, Any]]) -> None:
    root, m = model
    want = reference(root, m)
    results: list[dict[str, torch.Tensor]] = []

    def work() -> None:
        ld = loader(root, m, slots=2, chunk=4096)
        ld.make_engine = lambda dev: CpuEngine(copy_delay=0.0005)
        results.append(ld.load_weights("cpu", pipeline=True))

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 3
    for sd in results:
        assert_same(sd, want)


# --- verified loads hash on their own thread ------------------------------------------------


class SlowSha:
    """sha256 whose update lags (as a slow core would), recording the thread it ran on."""

    def __init__(self, head: bytes) -> None:
        self.h = hashlib.sha256(head)
        self.threads: set[str] = set()

    def update(self, data: Any) -> None:
        time.sleep(0.001)  # a refill before the hash is done would change these bytes
        self.threads.add(threading.current_thread().name)
        self.h.update(data)

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def test_hash_thread_sees_every_byte_in_file_order_before_a_refill(model: tuple[Path, dict[str, Any]]) -> None:
    root, m = model
    ld = loader(root, m)
    shards = ld.open_shards()
    try:
        engine = WatchedEngine()
        bufs = [engine.device_buffer(s.size - s.data_start) for s in shards]
        segs = [(i, s.data_start, s.size - s.data_start, b) for i, (s, b) in enumerate(zip(shards, bufs, strict=True))]
        hashers = {i: SlowSha(s.head) for i, s in enumerate(shards)}
        stats = RingStats()
        run_pipeline(shards, plan_chunks(segs, 1024), engine, slots=2, chunk=1024, readers=3,
                       hashers=hashers, stats=stats)
    finally:
        for s in shards:
            s.close()
    assert stats.chunks > 20 and engine.overwritten == 0
    for s, b in zip(shards, bufs, strict=True):
        assert bytes(b.numpy()) == (root / s.rel).read_bytes()[s.data_start:]
    for i, s in enumerate(shards):
        assert hashers[i].hexdigest() == hashlib.sha256((root / s.rel).read_bytes()).hexdigest()
        assert hashers[i].threads == {"packer-hash"}


def test_the_engine_watch_catches_a_ring_that_refills_early(model: tuple[Path, dict[str, Any]],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above can fail: a ring that reuses a slot without waiting for its copy."""
    root, m = model
    monkeypatch.setattr(ring, "_reusable", lambda slot, engine: True)
    ld = loader(root, m)
    shards = ld.open_shards()
    try:
        engine = WatchedEngine(copy_delay=0.002)
        bufs = [engine.device_buffer(s.size - s.data_start) for s in shards]
        segs = [(i, s.data_start, s.size - s.data_start, b) for i, (s, b) in enumerate(zip(shards, bufs, strict=True))]
        run_pipeline(shards, plan_chunks(segs, 1024), engine, slots=2, chunk=1024, readers=3)
    finally:
        for s in shards:
            s.close()
    assert engine.overwritten > 0 and engine.max_pending > 2
    wrong = [bytes(b.numpy()) != (root / s.rel).read_bytes()[s.data_start:] for s, b in zip(shards, bufs, strict=True)]
    assert any(wrong)


def test_verified_pipeline_load_checks_and_refuses(model: tuple[Path, dict[str, Any]]) -> None:
    root, m = model
    ld = loader(root, m, slots=2, chunk=4096)
    assert_same(ld.load_weights("cpu", pipeline=True, verify=True), reference(root, m))
    assert any(s["stage"] == "sha256 (hash thread)" and s["lane"] == 4 for s in ld.report())
    rel = m["weights"]["files"][1]
    data = bytearray((root / rel).read_bytes())
    data[-5] ^= 1
    (root / rel).write_bytes(bytes(data))
    with pytest.raises(ArtifactMismatchError, match=f"{rel}: sha256"):
        loader(root, m, slots=2, chunk=4096).load_weights("cpu", pipeline=True, verify=True)


# --- geometry: readers, chunk sizes ---------------------------------------------------------


def test_zero_readers_still_reads(model: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    root, m = model
    monkeypatch.setenv("PACKER_READERS", "0")
    ld = loader(root, m)
    assert ld.readers == 1
    ld.readers = 0  # set past the environment: the pool still starts one thread
    out: list[dict[str, torch.Tensor]] = []
    t = threading.Thread(target=lambda: out.append(ld.load_weights("cpu", pipeline=True)), daemon=True)
    t.start()
    t.join(60)
    assert out, "a load with no reader threads waited for ever"
    assert_same(out[0], reference(root, m))


def test_chunk_sizes_are_powers_of_two(model: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    assert [ring.ring_chunk(n) for n in (1, 3000, 4096, 48 * 2**20, 2**40)] == [1, 2048, 4096, 32 * 2**20, 64 * 2**20]
    with pytest.raises(ValueError, match="powers of two"):
        run_pipeline([], [], CpuEngine(), slots=2, chunk=3000, readers=1)
    root, m = model
    ld = loader(root, m, slots=3, chunk=3000)
    assert_same(ld.load_weights("cpu", pipeline=True), reference(root, m))
    assert ld.last_stats is not None
    assert ld.last_stats.max_chunk <= 2048 and ld.last_stats.host_bytes <= 3 * 2048
    monkeypatch.setenv("PACKER_CHUNK_MB", "48")
    assert ring.ring_chunk(Loader(m, root).chunk) == 32 * 2**20


# --- 256-byte aligned device offsets --------------------------------------------------------


def test_every_ring_tensor_is_aligned_and_a_view(model: tuple[Path, dict[str, Any]]) -> None:
    root, m = model
    ld = loader(root, m, slots=2, chunk=4096)
    sd = ld.load_weights("cpu", pipeline=True)
    assert_same(sd, reference(root, m))
    for name, t in sd.items():
        if t.numel():
            assert t.data_ptr() % ALIGN == 0, name
    shard_of = {n: rec["file"] for n, rec in m["weights"]["tensors"].items()}
    for rel in m["weights"]["files"]:  # no extra copy: one device buffer per shard
        storages = {sd[n].untyped_storage().data_ptr() for n, f in shard_of.items() if f == rel and sd[n].numel()}
        assert len(storages) == 1, rel


def test_misaligned_file_offsets_are_split_not_copied(tmp_path: Path) -> None:
    vals = torch.arange(6, dtype=torch.float32)
    bf = torch.arange(130, dtype=torch.bfloat16)
    write_raw_safetensors(tmp_path / "weights/model.safetensors",
                          [("odd", "U8", [3], b"\x01\x02\x03"),
                           ("f", "F32", [2, 3], vals.numpy().tobytes()),
                           ("h", "BF16", [130], bf.view(torch.uint8).numpy().tobytes()),
                           ("e", "F32", [0], b"")],
                          pad=3)
    m = describe(tmp_path, ["weights/model.safetensors"])
    sd = loader(tmp_path, m, chunk=4096).load_weights("cpu", pipeline=True, verify=True)
    assert sd["odd"].tolist() == [1, 2, 3] and torch.equal(sd["f"], vals.view(2, 3)) and torch.equal(sd["h"], bf)
    assert all(t.data_ptr() % ALIGN == 0 for t in (sd["odd"], sd["f"], sd["h"]))
    assert sd["e"].shape == (0,)


def test_cpu_views_and_copies_are_64_byte_aligned(model: tuple[Path, dict[str, Any]]) -> None:
    root, m = model
    for kw in ({}, {"copy": True}):
        sd = loader(root, m).load_weights("cpu", **kw)
        assert all(t.data_ptr() % 64 == 0 for t in sd.values()), kw


def test_aligned_files_need_one_segment() -> None:
    tensors = [("a", "F32", [64], 0, 256), ("b", "F32", [128], 256, 768), ("c", "BF16", [3], 768, 774),
               ("d", "F32", [64], 774, 1030), ("e", "F32", [64], 1030, 1286)]
    lay = plan_layout(tensors, 1286)
    assert [seg[:2] for seg in lay.segments] == [(0, 0), (774, 1024)]  # split once, before "d"
    assert lay.offsets == {"a": 0, "b": 256, "c": 768, "d": 1024, "e": 1280}
    assert lay.nbytes == 1286 + 250


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 700), min_size=1, max_size=14),
       gaps=st.lists(st.integers(0, 9), min_size=14, max_size=14))
def test_layout_covers_the_data_once_and_aligns_every_tensor(sizes: list[int], gaps: list[int]) -> None:
    tensors, off = [], 0
    for i, n in enumerate(sizes):
        off += gaps[i]
        tensors.append((f"t{i}", "U8", [n], off, off + n))
        off += n
    data_len = off + gaps[-1]
    lay = plan_layout(tensors, data_len)
    assert [s[0] for s in lay.segments] == sorted(s[0] for s in lay.segments)
    assert sum(s[2] for s in lay.segments) == data_len  # every byte of the file, once, in order
    segs = lay.segments
    assert all(a[0] + a[2] == b[0] and a[1] + a[2] <= b[1] for a, b in zip(segs, segs[1:], strict=False))
    assert max((s[1] + s[2] for s in lay.segments), default=0) <= lay.nbytes <= data_len + ALIGN * len(lay.segments)
    for name, _, _, begin, end in tensors:
        at = lay.offsets[name]
        if end > begin:
            assert at % ALIGN == 0, name
        seg = next(s for s in lay.segments if s[0] <= begin < s[0] + s[2]) if end > begin else None
        if seg is not None:  # the tensor lies inside one segment, at its file position shifted
            assert end <= seg[0] + seg[2] and at == seg[1] + begin - seg[0]
