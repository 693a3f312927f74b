"""``init_empty`` + ``load_into`` by assignment: zero copy, buffers, ties, keys, patterns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from packer.runtime.assign import LoadResult
from packer.runtime.empty import init_empty
from packer.runtime.loading import Loader
from packer.runtime.timeline import Timeline
from tests.loader_fixtures import make_artifacts, misaligned


class Rotary(torch.nn.Module):
    """Parameters, a persistent buffer and non-persistent ones, as Llama and BERT have."""

    _keys_to_ignore_on_load_unexpected = [r"^old\.", r"rotary\.cache$"]
    _keys_to_ignore_on_load_missing = [r"^aux\."]

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.proj = torch.nn.Linear(8, 8)
        self.aux = torch.nn.Linear(8, 2)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)
        self.register_buffer("position_ids", torch.arange(12).expand(1, -1), persistent=False)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * self.scale
        h = h + torch.sin(self.position_ids[:, : ids.shape[1], None].float() * self.inv_freq.repeat(2))
        return self.head(torch.tanh(self.proj(h)))


def weights(seed: int = 3) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    src = Rotary()
    for p in src.parameters():
        torch.nn.init.normal_(p)
    sd = {k: v.detach().clone() for k, v in src.state_dict().items() if k != "head.weight"}
    return sd


def artifacts(root: Path, sd: dict[str, torch.Tensor], shards: int = 1) -> Loader:
    names = sorted(sd)
    parts = [{k: sd[k] for k in names[i::shards]} for i in range(shards)]
    m = make_artifacts(root, parts, aliases={"head.weight": "embed.weight"})
    return Loader(m, root, timeline=Timeline())


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACKER_STARTUP_LOG", "off")


def reference(sd: dict[str, torch.Tensor]) -> Rotary:
    ref = Rotary()
    ref.load_state_dict(sd, strict=False)
    return ref


def storage_inside(t: torch.Tensor, views: list[torch.Tensor]) -> bool:
    return any(v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for v in views)


@pytest.mark.parametrize("shards", [1, 3])
def test_assigned_parameters_are_views_of_the_mapping_and_forward_matches(tmp_path: Path, shards: int) -> None:
    sd = weights()
    ld = artifacts(tmp_path, sd, shards)
    with init_empty():
        model = Rotary()
    assert all(p.is_meta for p in model.parameters()) and not model.inv_freq.is_meta
    result = ld.load_into(model, device="cpu")
    assert (result.missing, result.unexpected) == ([], [])
    mapped = list(ld.load_weights("cpu").values())  # the same files mapped again: other storages
    own = dict(model.named_parameters())
    assert not any(storage_inside(p, mapped) for p in own.values())
    assert all(p.data_ptr() % 64 == 0 for p in own.values())
    # every parameter whose file offset is 64-aligned lies inside its shard's mapping; only the
    # others are copies (odd sizes after odd sizes), and the notes say how many
    copied = misaligned(tmp_path, ld.manifest)
    assert copied and sorted(ld.last_copied) == sorted(copied)
    assert f"{len(copied)} tensors copied to 64-byte aligned memory" in " ".join(result.notes)
    views = [p for n, p in own.items() if n not in copied]
    bases = {p.untyped_storage().data_ptr() for p in views}
    assert len(bases) == shards and all(p.untyped_storage().nbytes() > p.nbytes for p in views)
    assert model.head.weight is model.embed.weight
    ids = torch.tensor([[1, 5, 7, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids), reference(sd)(ids))


@pytest.mark.parametrize("shards", [1, 2])
def test_assignment_through_the_ring_uses_one_allocation_per_shard(tmp_path: Path, shards: int) -> None:
    """The CUDA path's scheduling on the CPU engine: views of per-shard buffers the ring filled."""
    sd = weights()
    ld = artifacts(tmp_path, sd, shards)
    ld.chunk, ld.slots = 256, 2
    with init_empty():
        model = Rotary()
    ld.load_into(model, pipeline=True)
    own = list(model.parameters())
    assert len({p.untyped_storage().data_ptr() for p in own}) == shards
    assert any(s["stage"] == "assign" for s in ld.report())
    ids = torch.tensor([[2, 9, 11]])
    with torch.no_grad():
        assert torch.equal(model(ids), reference(sd)(ids))


def test_init_empty_restores_the_hook_and_dtype_on_error() -> None:
    with pytest.raises(ValueError), init_empty(dtype=torch.float64):
        raise ValueError("boom")
    assert torch.get_default_dtype() == torch.float32 and not torch.nn.Linear(2, 2).weight.is_meta


def test_non_persistent_buffer_keys_load_when_they_fit_and_are_noted(tmp_path: Path) -> None:
    sd = weights()
    sd["position_ids"] = torch.arange(12).expand(1, -1).flip(-1).contiguous()  # same shape, dtype
    sd["inv_freq"] = torch.ones(3)  # another shape: skipped
    ld = artifacts(tmp_path, sd)
    with init_empty():
        model = Rotary()
    result = ld.load_into(model)  # strict: neither key is unexpected
    assert (result.missing, result.unexpected) == ([], [])
    assert torch.equal(model.position_ids, sd["position_ids"])
    assert torch.equal(model.inv_freq, Rotary().inv_freq)
    assert any(n.startswith("position_ids: a non-persistent buffer") and "loaded" in n for n in result.notes)
    assert any(n.startswith("inv_freq: a non-persistent buffer") and "skipped" in n for n in result.notes)


def test_ignore_patterns_hide_missing_and_unexpected_keys(tmp_path: Path) -> None:
    sd = weights()
    del sd["aux.weight"], sd["aux.bias"]  # missing, but the model says to ignore them
    sd["old.rotary.weight"] = torch.ones(2)
    sd["layers.0.rotary.cache"] = torch.ones(2)
    ld = artifacts(tmp_path, sd)
    with init_empty():
        model = Rotary()
    result = ld.load_into(model)
    assert (result.missing, result.unexpected) == ([], [])
    assert model.aux.weight.is_meta and any("aux.weight: nothing to load" in n for n in result.notes)
    Rotary._keys_to_ignore_on_load_missing = []
    try:
        with init_empty():
            model = Rotary()
        with pytest.raises(RuntimeError, match=r"missing keys \['aux.bias', 'aux.weight'\], unexpected keys \[\]"):
            ld.load_into(model)
    finally:
        Rotary._keys_to_ignore_on_load_missing = [r"^aux\."]


def test_tied_module_loads_from_either_stored_name(tmp_path: Path) -> None:
    sd = weights()
    sd["head.weight"] = sd.pop("embed.weight")  # stored under the other name, no alias
    m = make_artifacts(tmp_path, [sd])
    with init_empty():
        model = Rotary()
    result = Loader(m, tmp_path, timeline=Timeline()).load_into(model)
    assert (result.missing, result.unexpected) == ([], [])
    assert model.embed.weight is model.head.weight and torch.equal(model.embed.weight, sd["head.weight"])
    assert any("embed.weight: tied to head.weight" in n for n in result.notes)
    sd["embed.weight"] = torch.zeros_like(sd["head.weight"])  # both stored: the first name wins
    m = make_artifacts(tmp_path / "both", [sd])
    with init_empty():
        model = Rotary()
    result = Loader(m, tmp_path / "both", timeline=Timeline()).load_into(model)
    assert model.embed.weight is model.head.weight and not torch.equal(model.head.weight, sd["head.weight"])
    assert any("head.weight: also stored, but the module ties it to embed.weight" in n for n in result.notes)


def test_dtype_of_the_module_wins_with_a_note(tmp_path: Path) -> None:
    sd = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in weights().items()}
    ld = artifacts(tmp_path, sd)
    with init_empty(dtype=torch.bfloat16):
        model = Rotary()
    assert model.proj.weight.dtype == torch.bfloat16 and torch.get_default_dtype() == torch.float32
    result = ld.load_into(model)
    assert not any("cast" in n for n in result.notes)
    with init_empty():
        model32 = Rotary()
    result = ld.load_into(model32)
    assert model32.proj.weight.dtype == torch.float32 and any("cast from torch.bfloat16" in n for n in result.notes)
    assert torch.equal(model32.proj.weight, sd["proj.weight"].float())


def test_mixed_module_is_assigned_and_filled(tmp_path: Path) -> None:
    sd = weights()
    ld = artifacts(tmp_path, sd)
    with init_empty():
        model = Rotary()
    model.proj = torch.nn.Linear(8, 8)  # already allocated: filled by copy
    ptr = model.proj.weight.data_ptr()
    ld.load_into(model)
    assert model.proj.weight.data_ptr() == ptr and torch.equal(model.proj.weight, sd["proj.weight"])
    assert torch.equal(model.embed.weight, sd["embed.weight"])
    with init_empty():
        model = Rotary()
    model.proj = torch.nn.Linear(8, 8, dtype=torch.float64).to("meta").to_empty(device="cpu")
    with pytest.raises(RuntimeError, match="already on"):
        ld.load_into(model, device="cuda")


def test_load_result_unpacks_and_pickles() -> None:
    import pickle

    r = LoadResult(["a"], ["b"], ["note"])
    missing, unexpected = r
    back = pickle.loads(pickle.dumps(r))
    assert (missing, unexpected) == (["a"], ["b"]) and back == r and back.notes == ["note"]
