"""packer's ``from_pretrained`` follows transformers' own load-time conversion, bitwise.

transformers 5 renames legacy names (a published BERT's ``LayerNorm.gamma``/``beta``) and fuses
per-expert MoE weights (Mixtral's ``block_sparse_moe.experts.N.w1``, Qwen2-MoE's
``mlp.experts.N.gate_proj``) into ``experts.gate_up_proj`` / ``down_proj`` as it loads. Each model
here is written by transformers' own ``save_pretrained`` (the BERT's names then set back to the
legacy ones, as old checkpoints have them), built, and loaded by packer's ``from_pretrained``; its
outputs equal those of transformers' own ``from_pretrained`` of the source, bitwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.built import build_dir, open_build
from tests.component_fixtures import import_loader

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.conversion_mapping")  # transformers 5: the conversion table


pytestmark = pytest.mark.usefixtures("build_env")  # tests/conftest.py: no start-up log, a private bundle cache


def legacy_bert(out: Path) -> Any:
    """A BERT MLM whose LayerNorms are stored as ``gamma``/``beta``, as published BERTs have them."""
    from safetensors.torch import load_file, save_file
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=48, max_position_embeddings=40)).save_pretrained(out)
    sd = load_file(out / "model.safetensors")
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
              for k, v in sd.items()}
    assert sum(".gamma" in k for k in legacy) >= 5
    save_file(legacy, str(out / "model.safetensors"), metadata={"format": "pt"})
    return BertForMaskedLM


def mixtral(out: Path) -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=32)).save_pretrained(out)
    return MixtralForCausalLM


def qwen2_moe(out: Path) -> Any:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                       shared_expert_intermediate_size=24, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                       num_experts_per_tok=2, max_position_embeddings=32)).save_pretrained(out)
    return Qwen2MoeForCausalLM


@pytest.mark.parametrize(("write", "legacy"), [
    (legacy_bert, "LayerNorm.gamma"), (mixtral, "block_sparse_moe.experts.0.w1"),
    (qwen2_moe, "mlp.experts.0.gate_proj"),
])
def test_from_pretrained_follows_transformers_conversion(tmp_path: Path, write: Any, legacy: str) -> None:
    src = tmp_path / "src"
    model_class = write(src)
    out = tmp_path / "out"
    result = build_dir(src, out)
    assert any(legacy in k for k in result.manifest["weights"]["tensors"])  # the build keeps the names as published
    pl = import_loader(out)
    want = model_class.from_pretrained(src).eval()
    got, info = pl.from_pretrained(model_class, device="cpu", output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    want_sd, got_sd = want.state_dict(), got.state_dict()
    assert set(got_sd) == set(want_sd) and all(torch.equal(got_sd[k], v) for k, v in want_sd.items())
    ids = torch.tensor([[1, 5, 9, 33, 2, 17]])
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)
    same = model_class.from_pretrained(pl.model_dir()).eval()  # model_dir(), as before: transformers' own path
    with torch.no_grad():
        assert torch.equal(same(ids).logits, want(ids).logits)


def test_a_quantized_model_that_needs_conversion_is_refused_in_one_line(tmp_path: Path) -> None:
    from packer.runtime.hf_convert import load_converted

    src = tmp_path / "src"
    model_class = mixtral(src)
    build_dir(src, tmp_path / "out")
    model = model_class(transformers.AutoConfig.from_pretrained(src))
    model.config.quantization_config = {"quant_method": "fp8"}
    with pytest.raises(RuntimeError) as e:
        load_converted(open_build(tmp_path / "out"), model, [], device="cpu", verify=False, dtype=None)
    line = str(e.value)
    assert "\n" not in line and "a quantized model" in line
    assert "AutoModel.from_pretrained(packer_loader.model_dir())" in line
