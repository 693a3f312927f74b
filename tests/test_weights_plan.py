"""Planning: names, exact-alias dedupe and the kept name, casts, shards, headers, index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from packer.checkpoint.records import DTYPE_SIZES, CheckpointContents, StorageRange, TensorRecord
from packer.errors import WeightsError
from packer.recipe import Rename, WeightsConfig
from packer.weights.plan import ALIGN, WeightsPlan, file_order, is_contiguous, map_name, plan_weights

SRC = Path("/nonexistent/ck.pt")  # planning never opens files


def rec(name: str, shape: tuple[int, ...], *, dtype: str = "F32", stride: tuple[int, ...] | None = None,
        key: str = "s0", nbytes: int | None = None, offset: int = 0, path: Path = SRC) -> TensorRecord:
    if stride is None:
        stride, acc = [], 1
        for d in reversed(shape):
            stride.insert(0, acc)
            acc *= d
    numel = 1
    for d in shape:
        numel *= d
    size = nbytes if nbytes is not None else (offset + numel) * DTYPE_SIZES[dtype]
    return TensorRecord(name, dtype, shape, tuple(stride), StorageRange(key, path, 64, size), offset)


def contents(*records: TensorRecord, path: Path = SRC) -> CheckpointContents:
    return CheckpointContents(path, "torch-zip", records)


def test_order_offsets_and_single_file() -> None:
    plan = plan_weights([contents(rec("b", (2, 3)), rec("a", (4,), key="s1"))], WeightsConfig())
    assert [s.filename for s in plan.shards] == ["model.safetensors"] and plan.index is None
    # neither size is a multiple of 64: the larger goes first, at the aligned start
    assert [(t.name, t.begin, t.end) for t in plan.shards[0].tensors] == [("b", 0, 24), ("a", 24, 40)]
    assert plan.total_size == 40
    header = plan.shards[0].header
    n = int.from_bytes(header[:8], "little")
    assert n == len(header) - 8 and len(header) % 64 == 0
    table = json.loads(header[8:])
    assert table == {"__metadata__": {"format": "pt"},
                     "a": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]},
                     "b": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}
    assert plan == plan_weights([contents(rec("b", (2, 3)), rec("a", (4,), key="s1"))], WeightsConfig())


def test_tied_embeddings_keep_the_input_embedding() -> None:
    # alphabetically lm_head comes first: the reference tools would keep it
    tied = [rec("lm_head.weight", (8, 4)), rec("model.embed_tokens.weight", (8, 4))]
    plan = plan_weights([contents(*tied)], WeightsConfig())
    assert list(plan.tensors) == ["model.embed_tokens.weight"]
    assert plan.aliases == (("lm_head.weight", "model.embed_tokens.weight"),)
    meta = json.loads(plan.shards[0].header[8:])["__metadata__"]
    assert json.loads(meta["packer.aliases"]) == {"lm_head.weight": "model.embed_tokens.weight"}


@pytest.mark.parametrize("names, kept", [
    (("transformer.wte.weight", "lm_head.weight"), "transformer.wte.weight"),
    (("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"),
     "bert.embeddings.word_embeddings.weight"),
    (("z.weight", "a.weight"), "a.weight"),
])
def test_kept_name_ranking(names: tuple[str, str], kept: str) -> None:
    plan = plan_weights([contents(*(rec(n, (2, 2)) for n in names))], WeightsConfig())
    assert list(plan.tensors) == [kept]


def test_tie_prefer_overrides() -> None:
    tied = [rec("lm_head.weight", (8, 4)), rec("model.embed_tokens.weight", (8, 4))]
    plan = plan_weights([contents(*tied)], WeightsConfig(tie_prefer=("lm_head.*",)))
    assert list(plan.tensors) == ["lm_head.weight"]


def test_only_exact_aliases_are_deduped() -> None:
    records = [
        rec("full", (4, 6), nbytes=96),
        rec("part", (2, 6), offset=6, nbytes=96),  # overlaps "full" partly: its own tensor
        rec("t1", (6, 4), stride=(1, 6), nbytes=96),  # transposed views, exact aliases
        rec("t2", (6, 4), stride=(1, 6), nbytes=96),
        rec("other_dtype", (4, 6), dtype="I32", nbytes=96),
        rec("e1", (0, 3), nbytes=96), rec("e2", (0, 3), nbytes=96),  # empty: both kept
    ]
    plan = plan_weights([contents(*records)], WeightsConfig())
    assert sorted(plan.tensors) == ["e1", "e2", "full", "other_dtype", "part", "t1"]
    assert dict(plan.aliases) == {"t2": "t1"}
    assert not plan.tensors["t1"][1].contiguous and plan.tensors["part"][1].contiguous


def test_same_key_in_other_file_is_not_an_alias() -> None:
    a = contents(rec("x", (2,)), path=Path("/a.bin"))
    b = contents(rec("y", (2,), path=Path("/b.bin")), path=Path("/b.bin"))
    assert sorted(plan_weights([a, b], WeightsConfig()).tensors) == ["x", "y"]


def test_names_prefixes_renames() -> None:
    cfg = WeightsConfig(strip_prefixes=("module.", "_orig_mod."),
                        renames=(Rename(r"^gamma$", "weight"), Rename(r"\.gamma$", ".weight")))
    assert map_name("_orig_mod.module.ln.gamma", cfg) == "ln.weight"
    assert map_name("module.", cfg) == "module."  # never strip a whole name to nothing
    # each prefix once: a Lightning module's model. around a model whose names start with model.
    assert map_name("model.model.norm.weight", WeightsConfig(strip_prefixes=("model.",))) == "model.norm.weight"
    assert map_name("module.module.w", WeightsConfig(strip_prefixes=("module.", "module."))) == "w"
    plan = plan_weights([contents(rec("module.a.gamma", (1,)))], cfg)
    assert list(plan.tensors) == ["a.weight"]


def test_collision_after_renaming_names_both_sources() -> None:
    cfg = WeightsConfig(strip_prefixes=("module.",))
    records = [rec("module.w", (1,)), rec("w", (1,), key="s1")]
    with pytest.raises(WeightsError, match=r"ck.pt:module.w and ck.pt:w both become 'w'"):
        plan_weights([contents(*records)], cfg)


def test_out_of_bounds_view_is_refused() -> None:
    with pytest.raises(WeightsError, match=r"tensor 'w': view ends at byte 100, past its storage"):
        plan_weights([contents(rec("w", (5, 5), nbytes=96))], WeightsConfig())


def test_cast_floats_only() -> None:
    records = [rec("f", (4,)), rec("i", (4,), dtype="I64", key="s1"), rec("h", (4,), dtype="F16", key="s2")]
    plan = plan_weights([contents(*records)], WeightsConfig(dtype="bfloat16"))
    got = {n: (t.dtype, t.end - t.begin, t.cast) for n, (_, t) in plan.tensors.items()}
    assert got == {"f": ("BF16", 8, True), "h": ("BF16", 8, True), "i": ("I64", 32, False)}


def test_sharding_and_index() -> None:
    records = [rec(f"layer.{i}", (10,), key=f"s{i}") for i in range(5)]  # 40 bytes each
    records.append(rec("embed_tokens.weight", (10,), key="s0"))
    plan = plan_weights([contents(*records)], WeightsConfig(max_shard_size=100))
    assert [s.filename for s in plan.shards] == [
        "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors"]
    assert [[t.name for t in s.tensors] for s in plan.shards] == [
        ["embed_tokens.weight", "layer.1"], ["layer.2", "layer.3"], ["layer.4"]]
    assert plan.index is not None
    index = json.loads(plan.index)
    assert index["metadata"] == {"total_size": 200, "packer.aliases": {"layer.0": "embed_tokens.weight"}}
    assert list(index["weight_map"]) == sorted(index["weight_map"])
    assert index["weight_map"]["layer.3"] == "model-00002-of-00003.safetensors"
    section = plan.section("weights/")
    assert section["index"] == "weights/model.safetensors.index.json"
    assert section["tensors"]["layer.4"] == {"file": "weights/model-00003-of-00003.safetensors",
                                             "dtype": "F32", "shape": [10], "data_offsets": [0, 40]}


def test_oversized_tensor_gets_its_own_shard() -> None:
    records = [rec("a", (10,)), rec("b", (100,), key="s1"), rec("c", (10,), key="s2")]
    plan = plan_weights([contents(*records)], WeightsConfig(max_shard_size=100))
    assert sorted(tuple(t.name for t in s.tensors) for s in plan.shards) == [("a", "c"), ("b",)]


def test_empty_checkpoint_plans_one_file() -> None:
    plan = plan_weights([contents()], WeightsConfig())
    assert [s.filename for s in plan.shards] == ["model.safetensors"] and plan.total_size == 0


@pytest.mark.parametrize("shape, stride, expected", [
    ((2, 3), (3, 1), True), ((3, 2), (1, 3), False), ((1, 4), (99, 1), True),
    ((4, 1), (1, 7), True), ((0, 3), (5, 7), True), ((), (), True), ((2, 3), (6, 2), False),
])
def test_is_contiguous(shape: tuple[int, ...], stride: tuple[int, ...], expected: bool) -> None:
    assert is_contiguous(rec("x", shape, stride=stride, nbytes=10**6)) is expected


def test_reserved_name_is_refused() -> None:
    with pytest.raises(WeightsError, match=r"tensor name '__metadata__' cannot be written"):
        plan_weights([contents(rec("__metadata__", (1,)))], WeightsConfig())


@pytest.mark.parametrize("names, kept", [
    # OPT: the input embedding sits under "decoder"; it is the tie's source and is kept
    (("model.decoder.embed_tokens.weight", "lm_head.weight"), "model.decoder.embed_tokens.weight"),
    # T5 / BART: shared is the source of both embed_tokens and lm_head
    (("decoder.embed_tokens.weight", "encoder.embed_tokens.weight", "lm_head.weight", "shared.weight"),
     "shared.weight"),
    (("model.decoder.embed_tokens.weight", "model.encoder.embed_tokens.weight", "model.shared.weight"),
     "model.shared.weight"),
    # RoBERTa: lm_head.decoder is the head, tied to the word embeddings; its bias to lm_head.bias
    (("lm_head.decoder.weight", "roberta.embeddings.word_embeddings.weight"),
     "roberta.embeddings.word_embeddings.weight"),
    (("lm_head.decoder.bias", "lm_head.bias"), "lm_head.bias"),
    # Whisper / GPT-NeoX / Meta Llama heads
    (("proj_out.weight", "model.decoder.embed_tokens.weight"), "model.decoder.embed_tokens.weight"),
    (("embed_out.weight", "gpt_neox.embed_in.weight"), "gpt_neox.embed_in.weight"),
    (("output.weight", "tok_embeddings.weight"), "tok_embeddings.weight"),
    # a "decoder" or "output" path component is no output head
    (("model.decoder.layers.0.w", "model.a.w"), "model.a.w"),
])
def test_kept_name_is_the_tie_source(names: tuple[str, ...], kept: str) -> None:
    plan = plan_weights([contents(*(rec(n, (2, 2)) for n in names))], WeightsConfig())
    assert list(plan.tensors) == [kept]
    assert dict(plan.aliases) == {n: kept for n in names if n != kept}


def test_config_saying_untied_keeps_the_head_as_its_own_tensor(tmp_path: Path) -> None:
    from packer.weights.ties import read_tie_config

    tied = [rec("lm_head.weight", (8, 4)), rec("model.decoder.embed_tokens.weight", (8, 4))]
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    plan = plan_weights([contents(*tied)], WeightsConfig(), ties=read_tie_config(tmp_path))
    assert sorted(plan.tensors) == ["lm_head.weight", "model.decoder.embed_tokens.weight"]
    assert plan.aliases == ()
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"tie_word_embeddings": True}}))
    assert read_tie_config(tmp_path).tie_word_embeddings
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(WeightsError, match="config.json: cannot read the model config: not a JSON object"):
        read_tie_config(tmp_path)


@pytest.mark.parametrize("tied", [True, False])
def test_convert_reads_tie_info_from_the_source_config(tmp_path: Path, tied: bool) -> None:
    import torch

    from packer.weights.convert import convert
    from tests.weights_validate import aliases_of, validate_output

    emb = torch.randn(8, 4)
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"model.decoder.embed_tokens.weight": emb, "lm_head.weight": emb}, src / "pytorch_model.bin")
    (src / "config.json").write_text(json.dumps({"model_type": "opt", "tie_word_embeddings": tied}))
    convert(src, tmp_path / "out", WeightsConfig())
    found = validate_output(tmp_path / "out")
    want = emb.numpy().tobytes()
    if tied:
        assert list(found) == ["model.decoder.embed_tokens.weight"]
        assert aliases_of(tmp_path / "out") == {"lm_head.weight": "model.decoder.embed_tokens.weight"}
    else:
        assert sorted(found) == ["lm_head.weight", "model.decoder.embed_tokens.weight"]
        assert found["lm_head.weight"]["bytes"] == want
    assert found["model.decoder.embed_tokens.weight"]["bytes"] == want


def test_config_beside_a_single_file_is_used_and_a_broken_one_ignored(tmp_path: Path) -> None:
    import torch

    from packer.weights.convert import convert
    from tests.weights_validate import validate_output

    emb = torch.randn(8, 4)
    torch.save({"model.decoder.embed_tokens.weight": emb, "lm_head.weight": emb}, tmp_path / "m.bin")
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    convert(tmp_path / "m.bin", tmp_path / "a", WeightsConfig())
    assert sorted(validate_output(tmp_path / "a")) == ["lm_head.weight", "model.decoder.embed_tokens.weight"]
    (tmp_path / "config.json").write_text("not json")
    convert(tmp_path / "m.bin", tmp_path / "b", WeightsConfig())
    assert list(validate_output(tmp_path / "b")) == ["model.decoder.embed_tokens.weight"]


def _aligned(plan: WeightsPlan) -> dict[str, bool]:
    return {t.name: t.begin % ALIGN == 0 for s in plan.shards for t in s.tensors}


def test_sizes_that_allow_it_start_64_aligned() -> None:
    # 3-element bf16 (6 B), 7-byte int8, 32-byte residues, whole multiples of 64
    specs = [("odd_bf16", (3,), "BF16"), ("seven", (7,), "I8"), ("w1", (16, 4), "F32"),
             ("bias32", (8,), "F32"), ("w2", (5, 16), "F32"), ("half", (24,), "F32"),
             ("z", (3, 3), "I8"), ("empty", (0,), "F32")]
    records = [rec(n, shape, dtype=dt, key=n) for n, shape, dt in specs]
    plan = plan_weights([contents(*records)], WeightsConfig())
    shard = plan.shards[0]
    assert len(shard.header) % ALIGN == 0
    sizes = {t.name: t.end - t.begin for t in shard.tensors}
    assert [t.begin for t in shard.tensors] == sorted(t.begin for t in shard.tensors)
    assert all(a.end == b.begin for a, b in zip(shard.tensors, shard.tensors[1:], strict=False))
    aligned = _aligned(plan)
    assert all(aligned[n] for n, size in sizes.items() if size % ALIGN == 0)
    # the two 32-byte residues pair up: the larger ("half", 96 B) starts aligned, bias32 ends aligned
    assert aligned["half"] and not aligned["bias32"]
    # then the largest odd size ("z", 9 B) at the aligned offset the pair left; none ends aligned after it
    assert [t.name for t in shard.tensors][-3:] == ["z", "odd_bf16", "seven"] and aligned["z"]
    assert plan == plan_weights([contents(*reversed(records))], WeightsConfig())


def test_file_order_is_deterministic_and_keeps_every_name() -> None:
    sizes = {f"t{i}": (i * 37) % 200 for i in range(300)}
    names = sorted(sizes)
    order = file_order(names, sizes)
    assert sorted(order) == names and order == file_order(names, sizes)
    pos, aligned = 0, 0
    for n in order:
        aligned += pos % ALIGN == 0 and sizes[n] > 0
        assert sizes[n] % ALIGN or pos % ALIGN == 0, n
        pos += sizes[n]
    # name order would align only the whole multiples and what falls aligned by chance
    pos, by_name = 0, 0
    for n in names:
        by_name += pos % ALIGN == 0 and sizes[n] > 0
        pos += sizes[n]
    assert aligned > by_name


def test_sharded_plan_aligns_each_shard() -> None:
    records = [rec(f"layer{i}.w", (16, 16), key=f"w{i}") for i in range(6)]
    records += [rec(f"layer{i}.b", (3,), key=f"b{i}") for i in range(6)]
    plan = plan_weights([contents(*records)], WeightsConfig(max_shard_size=2500))
    assert len(plan.shards) > 1
    for s in plan.shards:
        assert len(s.header) % ALIGN == 0
        assert all(t.begin % ALIGN == 0 for t in s.tensors if t.name.endswith(".w"))
