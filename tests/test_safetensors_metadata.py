"""The source's safetensors ``__metadata__`` kept beside packer's keys, or a refusal.

torchao's flattened form (what transformers writes for a torchao-quantized model) keeps each
quantized tensor's class in the header's metadata; without it ``from_pretrained`` refuses the
file. The test quantizes a tiny Llama on CPU, saves it with transformers, builds it, and loads
it back from ``model_dir()``: the logits are bitwise those of the source directory.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from packer.cli import main
from tests.built import build_dir
from tests.component_fixtures import import_loader

pytestmark = pytest.mark.usefixtures("build_env")  # tests/conftest.py: no start-up log, a private bundle cache


def metadata(path: Path) -> dict[str, str]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]).get("__metadata__", {})


def _tiny_llama(base: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(base)


@pytest.mark.parametrize("shard", [None, "10KB"])
def test_torchao_flattened_form_loads_from_model_dir(tmp_path: Path, shard: str | None) -> None:
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, TorchAoConfig

    base, src = tmp_path / "base", tmp_path / "quantized"
    _tiny_llama(base)
    model = AutoModelForCausalLM.from_pretrained(
        base, quantization_config=TorchAoConfig(Int8WeightOnlyConfig()), device_map="cpu")
    model.save_pretrained(src, **({"max_shard_size": shard} if shard else {}))
    source_meta = metadata(sorted(src.glob("*.safetensors"))[0])
    assert "Int8Tensor" in source_meta["model.layers.0.self_attn.q_proj.weight"]
    out = tmp_path / "out"
    result = build_dir(src, out)
    assert any("kept the source's safetensors __metadata__ in every shard" in n for n in result.notes)
    md = import_loader(out).model_dir()
    for f in (md.glob("*.safetensors")):
        assert {k: v for k, v in metadata(f).items() if k != "format"} == \
               {k: v for k, v in source_meta.items() if k != "format"}
    ids = torch.tensor([[1, 5, 9, 33, 2]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(src, device_map="cpu")(ids).logits
        got = AutoModelForCausalLM.from_pretrained(md, device_map="cpu")(ids).logits
    assert torch.equal(got, want)


def _convert(src: Path, out: Path, *extra: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["convert", "--no-sandbox", str(src), "-o", str(out), *extra])
    return result.exit_code, result.output


def _two_shards(src: Path, meta_a: dict[str, str], meta_b: dict[str, str]) -> None:
    src.mkdir()
    save_file({"a": torch.ones(2)}, src / "model-00001-of-00002.safetensors", metadata=meta_a)
    save_file({"b": torch.zeros(2)}, src / "model-00002-of-00002.safetensors", metadata=meta_b)
    index = {"metadata": {"total_size": 16}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                            "b": "model-00002-of-00002.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


def test_agreeing_shards_carry_their_keys_to_every_output_shard(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _two_shards(src, {"format": "pt", "quant": "x1"}, {"format": "pt", "quant": "x1", "extra": "y"})
    code, output = _convert(src, tmp_path / "out", "--max-shard-size", "8B")
    assert code == 0, output
    files = sorted((tmp_path / "out").glob("*.safetensors"))
    assert len(files) == 2
    for f in files:
        assert metadata(f) == {"format": "pt", "quant": "x1", "extra": "y"}


def test_unloadable_metadata_is_refused(tmp_path: Path) -> None:
    cases = {
        "conflict": ({"quant": "x1"}, {"quant": "x2"}, (), "set __metadata__ 'quant' to different values"),
        "namespace": ({"packer.sign": "1"}, {}, (), "key 'packer.sign' is in packer's own namespace"),
        "renamed": ({"quant": "x1"}, {}, ("--rename", "^a$=c"), "tensor 'a' is renamed to 'c'"),
    }
    for case, (meta_a, meta_b, extra, reason) in cases.items():
        src, out = tmp_path / case, tmp_path / f"{case}-out"
        _two_shards(src, meta_a, meta_b)
        code, output = _convert(src, out, *extra)
        assert code == 1 and reason in output and not out.exists(), (case, output)
        assert len(output.strip().splitlines()) == 1


def test_the_advice_for_conflicting_shards_works(tmp_path: Path) -> None:
    """Followed, 're-save the model as one file' builds: one input, nothing to disagree."""
    from transformers import LlamaForCausalLM

    base = tmp_path / "base"
    _tiny_llama(base)
    model = LlamaForCausalLM.from_pretrained(base)
    model.save_pretrained(tmp_path / "one", max_shard_size="100GB")
    code, output = _convert(tmp_path / "one", tmp_path / "out")
    assert code == 0, output


def test_reconverting_packers_output_keeps_its_aliases(tmp_path: Path) -> None:
    shared = torch.arange(6, dtype=torch.float32)
    src = tmp_path / "pytorch_model.bin"
    torch.save({"embed.weight": shared, "lm_head.weight": shared, "norm": torch.ones(2)}, src)
    assert _convert(src, tmp_path / "once")[0] == 0
    once = tmp_path / "once" / "model.safetensors"
    assert json.loads(metadata(once)["packer.aliases"]) == {"lm_head.weight": "embed.weight"}
    code, output = _convert(once, tmp_path / "twice")
    assert code == 0, output
    twice = tmp_path / "twice" / "model.safetensors"
    assert twice.read_bytes() == once.read_bytes()
