"""``from_pretrained`` follows transformers' loading rules on checkpoints as published.

Each fixture is a pickle checkpoint with a ``config.json``, built with ``packer build``; the
packer model's outputs must be bitwise equal to transformers' own ``from_pretrained`` of the
original directory.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from packer.runtime.hf import hf_from_pretrained
from tests.built import build_dir, open_build, save_pickle

pytest.importorskip("transformers")

IDS = torch.tensor([[3, 17, 42, 5, 30, 9, 1, 60]])


pytestmark = pytest.mark.usefixtures("build_env")  # tests/conftest.py: no start-up log, a private bundle cache


def outputs(model: Any) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=IDS)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def save(model: Any, out: Path, extra: dict[str, torch.Tensor] | None = None) -> Path:
    model.config.save_pretrained(out)
    save_pickle({**model.state_dict(), **(extra or {})}, out)
    return out


def bert_pretraining(out: Path) -> Path:
    """BertForPreTraining: ``bert.`` names, a pooler and two heads (``cls.*``)."""
    from transformers import BertConfig, BertForPreTraining

    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=48, max_position_embeddings=40)
    torch.manual_seed(0)
    return save(BertForPreTraining(cfg), out)


def gpt2_base_with_masked_bias(out: Path) -> Path:
    """A GPT2Model as transformers 4.5 saved it: ``attn.bias`` and ``attn.masked_bias`` buffers stored."""
    from transformers import GPT2Config, GPT2Model

    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16)
    torch.manual_seed(0)
    model = GPT2Model(cfg)
    old = {}
    for i in range(cfg.n_layer):
        old[f"h.{i}.attn.bias"] = torch.tril(torch.ones(16, 16, dtype=torch.uint8)).view(1, 1, 16, 16)
        old[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    return save(model, out, old)


def albert_pretraining(out: Path) -> Path:
    """AlbertForPreTraining: ``albert.`` names with a pooler and the sentence-order head."""
    from transformers import AlbertConfig, AlbertForPreTraining

    cfg = AlbertConfig(vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=48, max_position_embeddings=40)
    torch.manual_seed(0)
    return save(AlbertForPreTraining(cfg), out)


CASES = [  # (fixture, class name loaded, expected unexpected-key prefixes)
    (bert_pretraining, "BertModel", ("cls.",)),  # task checkpoint into the base model: prefix stripped
    (bert_pretraining, "AutoModel", ("cls.",)),
    (bert_pretraining, "BertForMaskedLM", ("bert.pooler.", "cls.seq_relationship.")),
    (gpt2_base_with_masked_bias, "GPT2LMHeadModel", ("h.0.attn.masked_bias", "h.1.attn.masked_bias")),
    (gpt2_base_with_masked_bias, "GPT2Model", ("h.0.attn.masked_bias", "h.1.attn.masked_bias")),
    (albert_pretraining, "AlbertForMaskedLM", ("albert.pooler.", "sop_classifier.")),
    (albert_pretraining, "AlbertModel", ("predictions.", "sop_classifier.")),
]


@pytest.mark.parametrize(("make", "cls_name", "extra"), CASES, ids=[f"{m.__name__}-{c}" for m, c, _ in CASES])
def test_from_pretrained_bitwise_equal_to_transformers(tmp_path: Path, make: Any, cls_name: str,
                                                       extra: tuple[str, ...],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    import transformers

    cls = getattr(transformers, cls_name)
    src = make(tmp_path / "src")
    build_dir(src, tmp_path / "out")
    ld = open_build(tmp_path / "out")
    want = cls.from_pretrained(src).eval()
    with caplog.at_level(logging.WARNING, logger="packer_loader"):
        got, info = hf_from_pretrained(ld, cls, device="cpu", output_loading_info=True)
    assert info["missing_keys"] == []
    assert info["unexpected_keys"] and all(k.startswith(extra) for k in info["unexpected_keys"])
    assert all(any(k.startswith(e) for k in info["unexpected_keys"]) for e in extra)
    assert "were not used" in caplog.text and info["unexpected_keys"][0] in caplog.text
    assert not any(p.device.type == "meta" for p in got.parameters())
    assert torch.equal(outputs(got), outputs(want))
    with pytest.raises(RuntimeError, match="unexpected key"):
        hf_from_pretrained(ld, cls, device="cpu", strict=True)


def test_base_checkpoint_into_a_task_model_names_the_missing_head(tmp_path: Path) -> None:
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                     intermediate_size=48, max_position_embeddings=40)
    src = save(BertModel(cfg), tmp_path / "src")
    build_dir(src, tmp_path / "out")
    with pytest.raises(RuntimeError, match=r"2 parameter\(s\) of BertForSequenceClassification not in the weights: "
                                           r"\['classifier.weight', 'classifier.bias'\]"):
        hf_from_pretrained(open_build(tmp_path / "out"), BertForSequenceClassification, device="cpu")
