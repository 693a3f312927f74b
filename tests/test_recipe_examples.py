"""The shipped example recipes do what their comments promise on models like the ones they name.

``recipes/hf-model.toml`` is the realistic example a new user copies: its ``[weights]`` and
``[bundle]`` tables must build a GPT-2 published as one pickle file (no shard index) into a
directory transformers loads with every weight in place.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

from packer.building import build
from packer.recipe import recipe_from_dict
from tests.built import save_pickle
from tests.component_fixtures import import_loader
from tests.hf_fixtures import word_tokenizer

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("build_env")  # tests/conftest.py: no start-up log, a private bundle cache


def test_hf_model_recipe_builds_a_single_file_gpt2_that_transformers_loads(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    src = tmp_path / "gpt2"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16))
    model.config.save_pretrained(src)
    save_pickle(model.state_dict(), src)  # one pytorch_model.bin, names "transformer.h.0..."
    word_tokenizer(src, 64)

    raw = tomllib.loads((REPO / "recipes" / "hf-model.toml").read_text())
    raw["source"] = str(src)
    raw["image"] = {k: v for k, v in raw["image"].items() if k not in ("base", "base_name")}  # no layout here
    out = tmp_path / "out"
    build(recipe_from_dict(raw), out, sandbox=False)

    got, info = GPT2LMHeadModel.from_pretrained(import_loader(out).model_dir(), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    want = model.to(torch.bfloat16).state_dict()  # the recipe casts to bfloat16
    assert all(torch.equal(got.state_dict()[k], v) for k, v in want.items())
