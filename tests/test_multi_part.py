"""Models of several parts, as their libraries write them, built and loaded back from ``model_dir()``.

A lone diffusers model (``UNet2DConditionModel.save_pretrained``: ``config.json`` with
``_class_name``) is a diffusers component, its weights ``diffusion_pytorch_model.safetensors``;
every PEFT adapter folder (``PeftModel.save_pretrained`` of several adapters) is a component.
Outputs are compared bitwise with the source directory loaded by the same library.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from packer.components import detect_layout
from tests.built import build_dir
from tests.component_fixtures import import_loader

pytestmark = pytest.mark.usefixtures("build_env")  # tests/conftest.py: no start-up log, a private bundle cache


def files_of(d: Path) -> set[str]:
    return {p.relative_to(d).as_posix() for p in d.rglob("*") if not p.is_dir()}


def fresh(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in eval mode with every parameter in a fresh allocation.

    diffusers maps the safetensors file and keeps its parameters as views of it; torch's CPU
    convolutions round differently with the weights' address alignment (the source's tensors
    sit at 8-byte file offsets, packer's at 64-byte ones), so both sides are compared with the
    same, allocator-aligned memory. The weights themselves are compared bitwise first.
    """
    for p in model.parameters():
        p.data = p.data.clone()
    return model.eval()


def test_a_lone_diffusers_model_is_a_diffusers_component(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
                                attention_head_dim=2, norm_num_groups=4).eval()
    src = tmp_path / "unet"
    unet.save_pretrained(src)
    assert detect_layout(src).kind == "diffusers"
    plan = build_dir(src, tmp_path / "plan", dry_run=True)
    assert "source layout: diffusers; components: model (., diffusers)" in plan.notes
    out = tmp_path / "out"
    build_dir(src, out)
    md = import_loader(out).model_dir()
    assert {"config.json", "diffusion_pytorch_model.safetensors"} <= files_of(md)
    latents, t, text = torch.randn(1, 4, 8, 8), torch.tensor([10]), torch.randn(1, 3, 16)
    want_model, got_model = UNet2DConditionModel.from_pretrained(src), UNet2DConditionModel.from_pretrained(md)
    want_sd, got_sd = want_model.state_dict(), got_model.state_dict()
    assert set(got_sd) == set(want_sd) and all(torch.equal(got_sd[k], v) for k, v in want_sd.items())
    with torch.no_grad():
        want = fresh(want_model)(latents, t, text).sample
        got = fresh(got_model)(latents, t, text).sample
    assert torch.equal(got, want)


def test_every_peft_adapter_folder_is_a_component(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    base, src = tmp_path / "base", tmp_path / "adapters"
    LlamaForCausalLM(cfg).save_pretrained(base)
    model = get_peft_model(LlamaForCausalLM.from_pretrained(base),
                           LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    model.add_adapter("second", LoraConfig(r=2, target_modules=["v_proj"], init_lora_weights=False))
    model.save_pretrained(src)
    assert (src / "second" / "adapter_config.json").is_file()
    plan = build_dir(src, tmp_path / "plan", dry_run=True)
    assert "source layout: peft; components: adapter (., peft), second (second, peft)" in plan.notes
    assert plan.manifest["weights"].get("left_out", []) == []
    out = tmp_path / "out"
    build_dir(src, out)
    md = import_loader(out).model_dir()
    assert {"adapter_config.json", "adapter_model.safetensors", "second/adapter_config.json",
            "second/adapter_model.safetensors"} <= files_of(md)
    ids = torch.tensor([[1, 5, 9, 33, 2]])

    def logits(where: Path) -> dict[str, torch.Tensor]:
        peft_model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), where).eval()
        peft_model.load_adapter(where / "second", adapter_name="second")
        out = {}
        with torch.no_grad():
            for name in ("default", "second"):
                peft_model.set_adapter(name)
                out[name] = peft_model(ids).logits
        return out

    want, got = logits(src), logits(md)
    assert not torch.equal(want["default"], want["second"])
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_sentence_transformers_router_routes_are_components(tmp_path: Path) -> None:
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Pooling, Router, StaticEmbedding, Transformer
    from tokenizers import Tokenizer
    from transformers import BertConfig, BertModel

    from tests.hf_fixtures import word_tokenizer

    base = tmp_path / "bert"
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         intermediate_size=48, max_position_embeddings=40)).save_pretrained(base)
    word_tokenizer(base, 64)
    static = StaticEmbedding(Tokenizer.from_file(str(base / "tokenizer.json")), embedding_dim=8)
    router = Router.for_query_document(query_modules=[static],
                                       document_modules=[Transformer(str(base)), Pooling(32), Dense(32, 8)])
    src = tmp_path / "st"
    SentenceTransformer(modules=[router], device="cpu").save(str(src))
    plan = build_dir(src, tmp_path / "plan", dry_run=True)
    assert ("source layout: sentence-transformers; components: query_0_StaticEmbedding (query_0_StaticEmbedding, "
            "transformers), document_0_Transformer (document_0_Transformer, transformers), document_2_Dense "
            "(document_2_Dense, transformers)") in plan.notes
    out = tmp_path / "out"
    build_dir(src, out)
    md = import_loader(out).model_dir()
    assert {"router_config.json", "query_0_StaticEmbedding/model.safetensors", "query_0_StaticEmbedding/tokenizer.json",
            "document_0_Transformer/model.safetensors", "document_1_Pooling/config.json",
            "document_2_Dense/model.safetensors"} <= files_of(md)
    want, got = SentenceTransformer(str(src), device="cpu"), SentenceTransformer(str(md), device="cpu")
    texts = ["w1 w2 w3", "w4 w5"]
    assert torch.equal(got.encode_query(texts, convert_to_tensor=True),
                       want.encode_query(texts, convert_to_tensor=True))
    assert torch.equal(got.encode_document(texts, convert_to_tensor=True),
                       want.encode_document(texts, convert_to_tensor=True))


def test_weight_variants_are_kept_under_their_own_names(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    full = {"w": torch.randn(4, 4), "b": torch.randn(4)}
    int8 = {"w": torch.randint(-128, 127, (4, 4), dtype=torch.int8), "scale": torch.rand(4)}
    save_file(full, src / "model.safetensors")
    save_file(int8, src / "model.int8.safetensors")
    left = build_dir(src, tmp_path / "left", dry_run=True, weights={"leave_out": ["model.int8.safetensors"]})
    assert left.manifest["weights"]["left_out"] == ["model.int8.safetensors"]
    plain = build_dir(src, tmp_path / "plain", dry_run=True)  # a sibling safetensors file is carried by default
    assert plain.manifest["weights"].get("left_out", []) == []
    assert ("carried under their own names, as a library may load them beside the weights: model.int8.safetensors "
            "(weights.leave_out = [...] leaves one out)") in plain.notes
    assert plain.manifest["weights"]["tree"] == [
        ["model.int8.safetensors", "weights/variants/model.int8/model.safetensors"],
        ["model.safetensors", "weights/model.safetensors"]]
    chosen = build_dir(src, tmp_path / "chosen", dry_run=True, weights={"files": ["model.int8.safetensors"]})
    assert chosen.manifest["weights"]["left_out"] == ["model.safetensors"]  # the model's own name: never a variant
    plan = build_dir(src, tmp_path / "plan", dry_run=True, weights={"variants": ["model.int8.safetensors"]})
    assert ("source layout: model; components: model (., transformers), model.int8 (., transformers, "
            "as model.int8.safetensors)") in plan.notes
    assert plan.manifest["weights"].get("left_out", []) == []
    out = tmp_path / "out"
    build_dir(src, out, weights={"variants": ["model.int8.safetensors"]})
    pl = import_loader(out)
    md = pl.model_dir()
    assert {"model.safetensors", "model.int8.safetensors"} <= files_of(md)
    for name, want in (("model.safetensors", full), ("model.int8.safetensors", int8)):
        got = load_file(md / name)
        assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
    assert set(pl.load_weights("cpu")) == set(full)  # the root model is still the default
    assert set(pl.load_weights("cpu", component="model.int8")) == set(int8)
    from click.testing import CliRunner

    from packer.cli import main

    verified = CliRunner().invoke(main, ["verify", str(out)])
    assert verified.exit_code == 0, verified.output
    from packer.errors import WeightsError

    for bad, reason in (("../x.safetensors", "not a relative file name"), ("config.json", "not a checkpoint file")):
        with pytest.raises(WeightsError, match=reason):
            build_dir(src, tmp_path / "bad", dry_run=True, weights={"variants": [bad]})
    with pytest.raises(WeightsError, match="weights.leave_out: 'model.fp8.safetensors' is not a safetensors file "
                                           "beside a component's weights"):
        build_dir(src, tmp_path / "bad", dry_run=True, weights={"leave_out": ["model.fp8.safetensors"]})


def test_sibling_safetensors_of_a_pipeline_component_are_carried(tmp_path: Path) -> None:
    """A diffusers pipeline published with fp16 files beside each component's weights: both load
    from ``model_dir()`` (the default and ``variant="fp16"``), each file once."""
    pytest.importorskip("diffusers")
    from diffusers import StableDiffusionPipeline

    from tests.component_fixtures import diffusers_pipeline

    pipe = diffusers_pipeline(tmp_path / "as-pickles")
    src = tmp_path / "sd"
    pipe.save_pretrained(src)
    pipe.to(torch.float16).save_pretrained(src, variant="fp16")
    out = tmp_path / "out"
    result = build_dir(src, out)
    assert result.manifest["weights"].get("left_out", []) == []
    assert len([f for f in result.manifest["files"] if f.endswith(".safetensors")]) == 6  # three components, twice
    md = import_loader(out).model_dir()
    assert {"unet/diffusion_pytorch_model.safetensors", "unet/diffusion_pytorch_model.fp16.safetensors",
            "text_encoder/model.safetensors", "text_encoder/model.fp16.safetensors"} <= files_of(md)
    unets = []
    for variant in (None, "fp16"):
        want = StableDiffusionPipeline.from_pretrained(src, variant=variant)
        got = StableDiffusionPipeline.from_pretrained(md, variant=variant)
        for name in ("unet", "vae", "text_encoder"):
            want_sd, got_sd = getattr(want, name).state_dict(), getattr(got, name).state_dict()
            assert set(got_sd) == set(want_sd) and all(torch.equal(got_sd[k], v) for k, v in want_sd.items())
        unets.append(got.unet.conv_in.weight)
    assert not torch.equal(*unets) and torch.equal(unets[1], unets[0].half().float())  # fp16 read: its own file
