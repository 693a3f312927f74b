"""transformers loads what packer ships for tied embeddings (skipped without transformers).

A tiny OPT model (its input embedding sits under ``model.decoder``) is saved with
torch.save, converted by packer and loaded with ``from_pretrained``; the logits must equal
the original's. With ``tie_word_embeddings: false`` in config.json and the head sharing the
embedding's storage in the checkpoint, the head must still be written: transformers would
otherwise initialise it at random.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from packer.recipe import WeightsConfig
from packer.weights.convert import convert
from tests.weights_validate import aliases_of, validate_output

transformers = pytest.importorskip("transformers")


def _opt(tied: bool) -> torch.nn.Module:
    cfg = transformers.OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                 num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16,
                                 tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(cfg).eval()
    if not tied:  # the same storage in the checkpoint, yet two tensors to transformers
        model.lm_head.weight = model.model.decoder.embed_tokens.weight
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_opt_loads_with_equal_logits(tmp_path: Path, tied: bool) -> None:
    model = _opt(tied)
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    model.config.save_pretrained(src)
    convert(src, out, WeightsConfig())
    shutil.copy(src / "config.json", out / "config.json")
    found = validate_output(out)
    assert "model.decoder.embed_tokens.weight" in found
    if tied:
        assert aliases_of(out) == {"lm_head.weight": "model.decoder.embed_tokens.weight"}
    else:
        assert "lm_head.weight" in found and aliases_of(out) == {}
    loaded = transformers.OPTForCausalLM.from_pretrained(out).eval()
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    ids = torch.tensor([[1, 5, 9, 3, 60]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
