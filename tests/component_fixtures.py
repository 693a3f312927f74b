"""Tiny models as their libraries publish them (diffusers, sentence-transformers, PEFT), as pickles.

Each library writes safetensors today; the fixtures turn every weight file into the torch
pickle older releases wrote (``diffusion_pytorch_model.bin``, ``pytorch_model.bin``,
``adapter_model.bin``), which is what packer has to convert.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors.torch import load_file

from tests.built import save_pickle
from tests.hf_fixtures import word_tokenizer


def as_pickles(root: Path) -> list[str]:
    """Replace every ``*.safetensors`` under ``root`` by the pickle of the same stem; return their paths."""
    done = []
    for f in sorted(root.rglob("*.safetensors")):
        name = "pytorch_model.bin" if f.stem == "model" else f"{f.stem}.bin"
        save_pickle(load_file(f), f.parent, name)
        f.unlink()
        done.append((f.parent / name).relative_to(root).as_posix())
    return done


def _clip_tokenizer(tmp: Path) -> Any:
    from transformers import CLIPTokenizer

    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, **{f"{c}</w>": i + 2 for i, c in enumerate(letters)},
             **{c: i + 28 for i, c in enumerate(letters[:12])}}
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "vocab.json").write_text(json.dumps(vocab))
    (tmp / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(tmp / "vocab.json"), str(tmp / "merges.txt"), model_max_length=16)


def diffusers_pipeline(out: Path) -> Any:
    """A tiny StableDiffusionPipeline (unet, vae, text encoder, tokenizer, scheduler) saved as pickles."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
                                attention_head_dim=2, norm_num_groups=4)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), latent_channels=4,
                        norm_num_groups=4, sample_size=16, layers_per_block=1)
    text = CLIPTextModel(CLIPTextConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, max_position_embeddings=16, projection_dim=16))
    tokenizer = _clip_tokenizer(out.parent / "vocab")
    pipe = StableDiffusionPipeline(unet=unet, vae=vae, text_encoder=text, tokenizer=tokenizer,
                                   scheduler=DDIMScheduler(clip_sample=False), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(out)
    as_pickles(out)
    return pipe


def sentence_transformer(out: Path) -> Any:
    """A SentenceTransformer (BERT, mean pooling, a Dense 32 -> 8 with its own weights) saved as pickles."""
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertModel

    base = out.parent / "st-base"
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         intermediate_size=48, max_position_embeddings=40)).save_pretrained(base)
    word_tokenizer(base, 64)
    st = SentenceTransformer(modules=[models.Transformer(str(base)), models.Pooling(32), models.Dense(32, 8)],
                             device="cpu")
    st.save(str(out))
    as_pickles(out)
    return st


def lora_adapter(base: Path, out: Path) -> Any:
    """A LoRA adapter (non-zero B, so it changes the logits) on a tiny Llama saved in ``base``."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(base)
    model = get_peft_model(LlamaForCausalLM.from_pretrained(base),
                           LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(out)
    as_pickles(out)
    return model


def import_loader(out: Path) -> ModuleType:
    """The emitted ``packer_loader.py`` of a build, imported as a module of its own."""
    name = f"packer_loader_{abs(hash(str(out)))}"
    spec = importlib.util.spec_from_file_location(name, out / "packer_loader.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
