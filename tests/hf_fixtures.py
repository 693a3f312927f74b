"""Small transformers models saved the Hugging Face way, and packer artifacts made from them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from tests.loader_fixtures import describe, make_bundle

BUNDLED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def word_tokenizer(out: Path, vocab: int) -> None:
    """A WordLevel tokenizer of ``vocab`` entries, written by transformers (no network)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i + 2 for i in range(vocab - 2)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(out)


def llama(out: Path, *, shard: str | None = None, tied: bool = True, hidden: int = 32, heads: int = 4,
          kv_heads: int = 2, intermediate: int = 64, layers: int = 2, vocab: int = 96) -> Any:
    """A Llama in bf16 (rotary buffers, tied embeddings by default) saved to ``out``.

    The default is 2 layers of width 32; vLLM's CPU attention needs a head size of 32 or more
    (``hidden // heads``), see :data:`VLLM_LLAMA`.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=64, tie_word_embeddings=tied, dtype="bfloat16")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    word_tokenizer(out, vocab)
    return model


# a Llama vLLM's CPU backend runs (head size 64), and splits two ways (two key/value heads)
VLLM_LLAMA = {"hidden": 128, "heads": 2, "kv_heads": 2, "intermediate": 256, "layers": 2, "vocab": 256}


def bert(out: Path) -> Any:
    """A BERT with an old-style checkpoint: its ``embeddings.position_ids`` key is stored."""
    from safetensors.torch import load_file, save_file
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=48, max_position_embeddings=40)
    torch.manual_seed(0)
    BertModel(cfg).save_pretrained(out)
    sd = load_file(out / "model.safetensors")
    sd["embeddings.position_ids"] = torch.arange(40).expand(1, -1).contiguous()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    word_tokenizer(out, 64)
    return cfg


def packer_artifacts(src: Path, root: Path) -> dict[str, Any]:
    """The manifest of an artifact root holding ``src``'s weights and a bundle of its files."""
    (root / "weights").mkdir(parents=True)
    rels = []
    for f in sorted(src.glob("*.safetensors")):
        shutil.copyfile(f, root / "weights" / f.name)
        rels.append(f"weights/{f.name}")
    index = None
    if (src / "model.safetensors.index.json").is_file():
        index = "weights/model.safetensors.index.json"
        shutil.copyfile(src / "model.safetensors.index.json", root / index)
    m = describe(root, rels, index=index)
    members = {n: (src / n).read_bytes() for n in BUNDLED if (src / n).is_file()}
    m["bundle"] = make_bundle(root / "bundle.tar.zst", members)
    m["files"]["bundle.tar.zst"] = {k: m["bundle"][k] for k in ("size", "sha256")}
    return m


def write_manifest(root: Path, m: dict[str, Any]) -> None:
    (root / "manifest.test.json").write_text(json.dumps(m))
