"""The CUDA path on a real GPU: ring race hunting, pinned ring, alignment, verify, graph capture.

Every test here is marked ``cuda``: CI (no GPU) skips them; ``benchmarks/gpu_check.sh`` runs
them on a GPU machine. They use only the standard library, torch, safetensors and
transformers, all present on a bare GPU image.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from packer.runtime import ring
from packer.runtime.engines import ALIGN, CudaEngine
from packer.runtime.env import ArtifactMismatchError
from packer.runtime.graphs import warmup
from packer.runtime.loading import Loader
from packer.runtime.timeline import Timeline
from tests.loader_fixtures import make_artifacts, sample_tensors

pytestmark = pytest.mark.cuda
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("PACKER_STARTUP_LOG", "off")
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _model(root: Path, mib: float) -> dict[str, Any]:
    """Odd-sized F32 before BF16 (misaligned bf16 offsets, as safetensors packs them), ~``mib`` MiB."""
    g = torch.Generator().manual_seed(3)
    big: dict[str, torch.Tensor] = {"odd.f32": torch.randn(1001, 3, generator=g)}
    i = 0
    while sum(t.numel() * t.element_size() for t in big.values()) < mib * 2**20:
        big[f"layers.{i}.w"] = torch.randn(512, 1024, generator=g).to(torch.bfloat16)
        big[f"layers.{i}.b"] = torch.randn(1023, generator=g).to(torch.bfloat16)  # odd: shifts what follows
        i += 1
    return make_artifacts(root, [sample_tensors(), big], aliases={"lm_head.weight": "embed.weight"})


def _reference(root: Path, m: dict[str, Any]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for rel in m["weights"]["files"]:
        out.update(load_file(root / rel, device="cuda"))
    return out


def _check(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for k, v in want.items():
        t = got[k]
        assert t.is_cuda and t.dtype == v.dtype and t.shape == v.shape, k
        assert torch.equal(t.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
        assert t.numel() == 0 or t.data_ptr() % ALIGN == 0, f"{k} at {t.data_ptr() % ALIGN} past {ALIGN}"


def _loader(root: Path, m: dict[str, Any], **opts: Any) -> Loader:
    ld = Loader(m, root, timeline=Timeline())
    for k, v in opts.items():
        setattr(ld, k, v)
    return ld


# --- the ring ---------------------------------------------------------------------------------


def test_cuda_load_is_bitwise_aligned_and_pins_once(tmp_path: Path) -> None:
    m = _model(tmp_path, 24)
    want = _reference(tmp_path, m)
    ring.release_ring()
    ld = _loader(tmp_path, m)
    for _ in range(3):
        sd = ld.load_weights("cuda")
        _check(sd, want)
        assert sd["lm_head.weight"] is sd["embed.weight"]
    assert ld.last_stats is not None
    assert ld.last_stats.host_kind == "registered" and ld.last_stats.pin_seconds == 0.0
    assert [s["stage"] for s in ld.report()].count("pin ring (registered)") == 1
    assert len(ring.staging_ring("cuda").slots) == ld.slots
    assert ring.release_ring() > 0 and not ring.staging_ring("cuda").slots


def test_two_slots_reused_thousands_of_times(tmp_path: Path) -> None:
    m = _model(tmp_path, 24)
    ld = _loader(tmp_path, m, slots=2, chunk=8192)
    _check(ld.load_weights("cuda"), _reference(tmp_path, m))
    assert ld.last_stats is not None and ld.last_stats.chunks > 2000  # bytes checked above: no early refill
    ring.release_ring()


@pytest.mark.parametrize("verify", [False, True])
def test_a_slowed_stream_never_lets_a_slot_be_refilled_early(tmp_path: Path, verify: bool) -> None:
    m = _model(tmp_path, 8)
    ld = _loader(tmp_path, m, slots=3, chunk=65536)
    ld.make_engine = lambda dev: CudaEngine(dev, stall_cycles=1_000_000)  # ~0.5 ms before each copy
    _check(ld.load_weights("cuda", verify=verify), _reference(tmp_path, m))
    assert ld.last_stats is not None and ld.last_stats.chunks > 100  # bytes checked above under the stall
    ring.release_ring()


def test_the_loader_leaves_the_pinned_cache_alone(tmp_path: Path) -> None:
    m = _model(tmp_path, 4)
    held = torch.empty(8 * 2**20, dtype=torch.uint8, pin_memory=True)
    ptr = held.data_ptr()
    del held  # now a cached block of PyTorch's pinned allocator (someone else's)
    _loader(tmp_path, m).load_weights("cuda")
    ring.release_ring()
    model = torch.nn.Linear(16, 16).cuda()  # torch.cuda.graph() would empty that cache: not used
    assert len(warmup(model, [torch.randn(4, 16, device="cuda")], cuda_graphs=True).graphs) == 1
    again = torch.empty(8 * 2**20, dtype=torch.uint8, pin_memory=True)
    assert again.data_ptr() == ptr  # still cached: nobody emptied the process-wide cache


def test_verified_cuda_load_catches_a_flipped_byte(tmp_path: Path) -> None:
    m = _model(tmp_path, 8)
    _check(_loader(tmp_path, m).load_weights("cuda", verify=True), _reference(tmp_path, m))
    rel = m["weights"]["files"][1]
    data = bytearray((tmp_path / rel).read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / rel).write_bytes(bytes(data))
    with pytest.raises(ArtifactMismatchError, match="sha256"):
        _loader(tmp_path, m).load_weights("cuda", verify=True)


def test_load_into_cuda_module(tmp_path: Path) -> None:
    m = _model(tmp_path, 4)
    want = _reference(tmp_path, m)
    root = torch.nn.Module()
    for name, t in want.items():
        *path, leaf = name.split(".")
        parent = root
        for p in path:
            if not hasattr(parent, p):
                parent.add_module(p, torch.nn.Module())
            parent = getattr(parent, p)
        parent.register_buffer(leaf, torch.zeros_like(t))  # the module's own (aligned) tensors
    missing, unexpected = _loader(tmp_path, m).load_into(root, strict=False)
    got = root.state_dict()
    assert not missing and unexpected == ["lm_head.weight"]
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_cuda_init_stage_creates_the_context(tmp_path: Path) -> None:
    m = _model(tmp_path, 1)
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    code = f"""
import json, torch
from packer.runtime.loading import Loader
from packer.runtime.timeline import Timeline
assert not torch.cuda.is_initialized()
ld = Loader(json.load(open({str(tmp_path / 'manifest.json')!r})), {str(tmp_path)!r}, timeline=Timeline())
ld.load_weights("cuda")
stages = [s["stage"] for s in ld.report()]
print(stages.index("CUDA init") < stages.index("headers"), torch._C._cuda_hasPrimaryContext(0))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "PACKER_STARTUP_LOG": "off"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True"]


# --- graph warm-up ----------------------------------------------------------------------------


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(logits=self.lin(x).relu())


def test_replayed_model_output_keeps_logits() -> None:
    model = TinyLM().cuda()
    fn = warmup(model, [torch.randn(8, 64, device="cuda")], cuda_graphs=True)
    x = torch.randn(8, 64, device="cuda")
    with torch.inference_mode():
        want = model(x).logits
    got = fn(x)
    assert fn.replays == 1 and type(got).__name__ == "CausalLMOutputWithPast"
    assert torch.allclose(got.logits, want, atol=1e-5) and got["logits"] is got.logits


class ItemModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * float(y.abs().max().item() > 0)  # a host sync: cannot be captured


class SyncsWhileCapturing(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream().synchronize()  # invalidates the capture; eager runs are fine
        return self.lin(x)


@pytest.mark.parametrize("cls", [ItemModel, SyncsWhileCapturing])
def test_uncapturable_models_stay_eager_and_the_stream_comes_back(cls: type[torch.nn.Module]) -> None:
    model = cls().cuda()
    before = torch.cuda.current_stream()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = warmup(model, [torch.randn(4, 16, device="cuda"), torch.randn(2, 16, device="cuda")],
                      cuda_graphs=True)
    assert any("capture failed" in str(w.message) for w in caught)
    assert not fn.graphs and not fn.capturing
    assert torch.cuda.current_stream() == before and not torch.cuda.is_current_stream_capturing()
    x = torch.randn(4, 16, device="cuda")
    with torch.inference_mode():
        want = model(x)
    assert torch.equal(fn(x), want) and fn.fallbacks == 1
    big = torch.randn(1024, 1024, device="cuda") @ torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    assert torch.isfinite(big).all()


def test_capture_is_not_disturbed_by_a_load_on_another_thread(tmp_path: Path) -> None:
    m = _model(tmp_path, 16)
    want = _reference(tmp_path, m)
    ld = _loader(tmp_path, m)
    ld.load_weights("cuda")  # the ring is pinned before the race starts
    stop, errors, loaded = threading.Event(), [], []

    def loads() -> None:  # no checks here: torch.equal syncs, and sync-debug mode is process-wide
        try:
            while not stop.is_set():
                loaded.append(_loader(tmp_path, m).load_weights("cuda"))
                del loaded[:-2]
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=loads)
    t.start()
    try:
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()
        shapes = [torch.randn(n, 64, device="cuda") for n in (16, 8, 4, 2)]
        fn = warmup(model, shapes, cuda_graphs=True)
    finally:
        stop.set()
        t.join(120)
    assert not errors, errors
    assert loaded and len(fn.graphs) == 4 and fn.capturing
    for sd in loaded:
        _check(sd, want)
    x = torch.randn(8, 64, device="cuda")
    with torch.inference_mode():
        assert torch.allclose(fn(x), model(x), atol=1e-5)
    ring.release_ring()
