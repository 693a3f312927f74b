"""Every file a library's ``save_pretrained`` writes is carried by the build or named in a note.

A file left out in silence breaks the model where it is read: transformers' named chat templates
(``additional_chat_templates/tool_use.jinja``) left out made ``apply_chat_template(chat_template=
"tool_use")`` from ``model_dir()`` return the literal string ``'tool_use'``. The walk below runs
the libraries' own ``save_pretrained`` for a range of classes and fails on any file the build
neither carries (bundle member, converted weights) nor names in a note with the key that carries it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.built import build_dir
from tests.component_fixtures import _clip_tokenizer, diffusers_pipeline, import_loader, sentence_transformer
from tests.hf_fixtures import word_tokenizer

pytest.importorskip("transformers")

TEMPLATES = {"default": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}",
             "tool_use": "TOOLS {{ tools | length }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"}


pytestmark = pytest.mark.usefixtures("build_env")  # tests/conftest.py: no start-up log, a private bundle cache


def chat_model(out: Path) -> None:
    """A Llama with a generation config, a tokenizer with named chat templates, an image processor."""
    from transformers import AutoTokenizer, CLIPImageProcessorPil, GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.5, max_new_tokens=7)
    model.save_pretrained(out)
    word_tokenizer(out, 64)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = dict(TEMPLATES)
    tok.save_pretrained(out)
    CLIPImageProcessorPil(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8}).save_pretrained(out)
    assert (out / "additional_chat_templates" / "tool_use.jinja").is_file()


def processor(out: Path) -> None:
    """A CLIPProcessor (tokenizer, image processor, chat template) and a Whisper feature extractor."""
    from transformers import CLIPImageProcessorPil, CLIPModel, CLIPProcessor, WhisperFeatureExtractor
    from transformers.models.clip import CLIPConfig

    CLIPModel(CLIPConfig(text_config={"vocab_size": 40, "hidden_size": 16, "intermediate_size": 32,
                                      "num_hidden_layers": 1, "num_attention_heads": 2,
                                      "max_position_embeddings": 16},
                         vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                        "num_attention_heads": 2, "image_size": 8, "patch_size": 4},
                         projection_dim=8)).save_pretrained(out)
    images = CLIPImageProcessorPil(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8})
    CLIPProcessor(image_processor=images, tokenizer=_clip_tokenizer(out.parent / "vocab"),
                  chat_template=TEMPLATES["default"]).save_pretrained(out)
    WhisperFeatureExtractor(feature_size=8).save_pretrained(out / "audio")  # a folder no layout names


def pipeline(out: Path) -> None:
    pytest.importorskip("diffusers")
    diffusers_pipeline(out.parent / "as-pickles").save_pretrained(out)


def sentence_transformers(out: Path) -> None:
    pytest.importorskip("sentence_transformers")
    sentence_transformer(out)


@pytest.mark.parametrize("write", [chat_model, processor, pipeline, sentence_transformers])
def test_every_file_save_pretrained_writes_is_carried_or_noted(tmp_path: Path, write: Callable[[Path], None]) -> None:
    src = tmp_path / "src"
    write(src)
    plan = build_dir(src, tmp_path / "plan", dry_run=True)
    carried = {m["name"] for m in plan.manifest["bundle"]["members"]}
    carried |= {i["path"] for i in plan.manifest["weights"]["inputs"]}
    notes = "\n".join(plan.notes)
    silent = []
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src).as_posix()
        if p.is_file() and rel not in carried and rel not in notes and \
                not any(f"{'/'.join(rel.split('/')[:i])}/" in notes for i in range(1, rel.count("/") + 1)):
            silent.append(rel)
    assert silent == [], f"left out without a note: {silent}"
    if write is processor:
        assert 'bundle.include = ["audio/**"] carries them' in notes


def test_named_chat_templates_render_the_same_from_model_dir(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    src = tmp_path / "src"
    chat_model(src)
    out = tmp_path / "out"
    build_dir(src, out)
    md = import_loader(out).model_dir()
    assert (md / "additional_chat_templates" / "tool_use.jinja").read_bytes() == \
        (src / "additional_chat_templates" / "tool_use.jinja").read_bytes()
    messages = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]
    want, got = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(md)
    for name in ("default", "tool_use"):
        rendered = got.apply_chat_template(messages, chat_template=name, tools=tools, tokenize=False)
        assert rendered == want.apply_chat_template(messages, chat_template=name, tools=tools, tokenize=False)
        assert rendered != name
    rendered = got.apply_chat_template(messages, chat_template="tool_use", tools=tools, tokenize=False)
    assert rendered == "TOOLS 1[w1 w2][w3]"
    assert got.apply_chat_template(messages, chat_template="tool_use", tools=tools) == \
        want.apply_chat_template(messages, chat_template="tool_use", tools=tools)
