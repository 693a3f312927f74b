"""Sources as sets of components, built and laid out again for their own libraries.

Each fixture is a tiny model its library made and saved (as pickles); after ``packer build``
it is loaded back from ``model_dir()`` by that library and through packer's loader, and the
outputs must be bitwise equal to the original directory loaded by the same library.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from packer.components import detect_layout
from packer.errors import VerifyError, WeightsError
from packer.safetensors_header import read_header_file
from tests.built import build_dir, weight_location
from tests.component_fixtures import diffusers_pipeline, import_loader, lora_adapter, sentence_transformer

pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("build_env")  # tests/conftest.py: no start-up log, a private bundle cache


def selftest(out: Path) -> str:
    r = subprocess.run([sys.executable, str(out / "packer_loader.py"), "--selftest", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stderr


def files_of(d: Path) -> set[str]:
    return {p.relative_to(d).as_posix() for p in d.rglob("*") if not p.is_dir()}


@pytest.mark.slow
def test_diffusers_pipeline(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    src = tmp_path / "sd"
    diffusers_pipeline(src)
    plan = build_dir(src, tmp_path / "plan", dry_run=True)
    assert "source layout: diffusers; components: text_encoder (text_encoder, transformers), " \
           "unet (unet, diffusers), vae (vae, diffusers)" in plan.notes
    assert set(plan.manifest["weights"]["components"]) == {"text_encoder", "unet", "vae"}
    out = tmp_path / "out"
    result = build_dir(src, out)
    assert result.summary()["left_out"] == []
    assert {"weights/unet/model.safetensors", "weights/vae/model.safetensors",
            "weights/text_encoder/model.safetensors"} <= set(result.manifest["files"])
    pl = import_loader(out)
    md = pl.model_dir()
    assert {"model_index.json", "scheduler/scheduler_config.json", "tokenizer/tokenizer_config.json",
            "unet/config.json", "unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
            "text_encoder/config.json", "text_encoder/model.safetensors"} <= files_of(md)
    want = StableDiffusionPipeline.from_pretrained(src)
    got = StableDiffusionPipeline.from_pretrained(md)

    def image(pipe: Any) -> Any:
        return pipe("abc", num_inference_steps=2, height=16, width=16, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images

    assert (image(got) == image(want)).all()
    latents, t = torch.randn(1, 4, 8, 8), torch.tensor([10])
    ids = want.tokenizer("abc", return_tensors="pt").input_ids
    with torch.no_grad():
        text = want.text_encoder(ids).last_hidden_state
        unet = pl.from_pretrained(UNet2DConditionModel, device="cpu", component="unet")
        # CPU conv kernels (oneDNN) round differently on pointers below 64-byte alignment
        assert all(v.data_ptr() % 64 == 0 for v in unet.state_dict().values())
        path, offset, size = weight_location(out, "weights/unet/model.safetensors")  # in its layer blob
        header, start = read_header_file(path, error=VerifyError, offset=offset, size=size)
        spans = [v["data_offsets"] for n, v in header.items() if n != "__metadata__"]
        assert start % 64 == 0 and all(b % 64 == 0 for b, e in spans if (e - b) % 64 == 0)
        assert torch.equal(unet(latents, t, text).sample, want.unet(latents, t, text).sample)
        vae = pl.from_pretrained(AutoencoderKL, device="cpu", component="vae")
        assert torch.equal(vae.decode(latents).sample, want.vae.decode(latents).sample)
        encoder = pl.from_pretrained(CLIPTextModel, device="cpu", component="text_encoder")
        assert torch.equal(encoder(ids).last_hidden_state, text)
    assert set(pl.load_weights("cpu", component="vae")) == set(want.vae.state_dict())
    with pytest.raises(ValueError, match="components text_encoder, unet, vae and no root model"):
        pl.load_weights("cpu")
    assert "in 3 components" in selftest(out)


def test_sentence_transformers_with_a_dense_module(tmp_path: Path) -> None:
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer
    from transformers import BertModel

    src = tmp_path / "st"
    sentence_transformer(src)
    out = tmp_path / "out"
    result = build_dir(src, out)
    assert set(result.manifest["weights"]["components"]) == {"model", "2_Dense"}
    assert "weights/2_Dense/model.safetensors" in result.manifest["files"]
    pl = import_loader(out)
    md = pl.model_dir()
    assert {"modules.json", "model.safetensors", "1_Pooling/config.json", "2_Dense/config.json",
            "2_Dense/model.safetensors"} <= files_of(md)
    sentences = ["w1 w2 w3", "w4 w5"]
    want = SentenceTransformer(str(src), device="cpu").encode(sentences, convert_to_tensor=True)
    got = SentenceTransformer(str(md), device="cpu").encode(sentences, convert_to_tensor=True)
    assert torch.equal(got, want)
    st = SentenceTransformer(str(src), device="cpu")  # through packer's loader: every weight replaced
    with torch.no_grad():
        for p in st.parameters():
            p.zero_()
    st[0].model = pl.from_pretrained(BertModel, device="cpu")  # the root component by default (auto_model)
    result = pl.load_into(st[2], component="2_Dense")
    assert (result.missing, result.unexpected) == ([], [])
    assert torch.equal(st.encode(sentences, convert_to_tensor=True), want)
    assert "in 2 components" in selftest(out)


def test_peft_lora_adapter(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
    from transformers import LlamaForCausalLM

    base, src = tmp_path / "base", tmp_path / "adapter"
    lora_adapter(base, src)
    assert detect_layout(src).kind == "peft"
    out = tmp_path / "out"
    build_dir(src, out)
    pl = import_loader(out)
    md = pl.model_dir()
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files_of(md)
    ids = torch.tensor([[1, 5, 9, 33, 2]])
    with torch.no_grad():
        want = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), src).eval()(ids).logits
        got = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), md).eval()(ids).logits
        assert torch.equal(got, want)
        cfg = LoraConfig.from_pretrained(str(pl.bundle_dir()))
        model = get_peft_model(LlamaForCausalLM.from_pretrained(base), cfg)
        load = set_peft_model_state_dict(model, pl.load_weights("cpu", component="adapter"))
        assert not load.unexpected_keys
        assert torch.equal(model.eval()(ids).logits, want)
    selftest(out)


def test_left_out_checkpoints_are_named(tmp_path: Path) -> None:
    from tests.built import save_pickle

    src = tmp_path / "src"
    save_pickle({"w": torch.ones(2)}, src)
    save_pickle({"w": torch.zeros(2)}, src / "checkpoint-500")
    result = build_dir(src, tmp_path / "out", dry_run=True)
    assert result.manifest["weights"]["left_out"] == ["checkpoint-500/pytorch_model.bin"]
    assert any("leaves out: checkpoint-500/pytorch_model.bin" in n for n in result.notes)


def test_recipe_overrides_the_layout(tmp_path: Path) -> None:
    pytest.importorskip("sentence_transformers")
    src = tmp_path / "st"
    sentence_transformer(src)
    only = build_dir(src, tmp_path / "a", dry_run=True, weights={"components": ["2_Dense"]})
    assert set(only.manifest["weights"]["components"]) == {"2_Dense"}
    assert only.summary()["left_out"] == ["pytorch_model.bin"]
    plain = build_dir(src, tmp_path / "b", dry_run=True, weights={"layout": "model"})
    assert "components" not in plain.manifest["weights"]
    assert plain.manifest["weights"]["left_out"] == ["2_Dense/pytorch_model.bin"]
    with pytest.raises(WeightsError, match="weights.components names 'nope'"):
        build_dir(src, tmp_path / "c", dry_run=True, weights={"components": ["nope"]})


def test_component_names_from_the_input_are_checked(tmp_path: Path) -> None:
    src = tmp_path / "bad"
    src.mkdir()
    (src / "model_index.json").write_text('{"../up": ["diffusers", "UNet2DConditionModel"]}')
    with pytest.raises(WeightsError, match="is not a plain folder name"):
        detect_layout(src)


def test_checkpoint_choice_follows_the_libraries(tmp_path: Path) -> None:
    from packer.components import checkpoint_of

    for name in ("pytorch_model.bin", "training_args.bin", "diffusion_pytorch_model.fp16.safetensors"):
        (tmp_path / name).write_bytes(b"")
    assert checkpoint_of(tmp_path, "model") == ("pytorch_model.bin",)
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert checkpoint_of(tmp_path, "model") == ("model.safetensors",)  # safetensors first, as transformers
    assert checkpoint_of(tmp_path, "diffusion_pytorch_model") == ()  # a variant alone is not the default file
