"""Models published only as a variant (``save_pretrained(variant="fp16")``) keep the variant's names.

transformers and diffusers put the variant before the last suffix (``model.fp16.safetensors``,
``model.safetensors.index.fp16.json``, ``unet/diffusion_pytorch_model.fp16.safetensors``) and look
only for those names when ``from_pretrained(..., variant="fp16")`` is called; the model directory
must have them, from one copy of the bytes. Outputs are compared bitwise with the source.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from packer.util.formats import variant_of, with_variant
from tests.built import build_dir
from tests.component_fixtures import diffusers_pipeline, import_loader

pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("build_env")  # tests/conftest.py: no start-up log, a private bundle cache


def files_of(d: Path) -> set[str]:
    return {p.relative_to(d).as_posix() for p in d.rglob("*") if not p.is_dir()}


def weight_files(manifest: dict[str, Any]) -> list[str]:
    return sorted(f for f in manifest["files"] if f.startswith("weights/") and f.endswith(".safetensors"))


def test_variant_names_read_as_the_libraries_write_them() -> None:
    stems = ("model", "pytorch_model")
    assert variant_of("model.fp16.safetensors", stems) == "fp16"
    assert variant_of("model.fp16-00001-of-00002.safetensors", stems) == "fp16"
    assert variant_of("model.safetensors.index.fp16.json", stems) == "fp16"
    assert variant_of("pytorch_model.non_ema.bin", stems) == "non_ema"
    assert variant_of("diffusion_pytorch_model-00001-of-00002.fp16.safetensors",
                      ("diffusion_pytorch_model",)) == "fp16"  # diffusers' older shard names
    for plain in ("model.safetensors", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                  "pytorch_model.bin", "other.fp16.safetensors"):
        assert variant_of(plain, stems) is None, plain
    assert with_variant("model.safetensors.index.json", "fp16") == "model.safetensors.index.fp16.json"
    assert with_variant("diffusion_pytorch_model.safetensors", "fp16") == "diffusion_pytorch_model.fp16.safetensors"


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_a_model_saved_only_as_a_variant_loads_with_variant(tmp_path: Path, shard: str | None) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    src = tmp_path / "src"
    LlamaForCausalLM(cfg).save_pretrained(src, variant="fp16", **({"max_shard_size": shard} if shard else {}))
    index = "model.safetensors.index.fp16.json"
    assert (src / index).is_file() == bool(shard)
    out = tmp_path / "out"
    result = build_dir(src, out, weights={"max_shard_size": shard or "5GB"})  # packer shards on its own
    assert result.manifest["weights"].get("left_out", []) == []
    assert result.manifest["weights"]["variant"] == "fp16"
    md = import_loader(out).model_dir()
    names = files_of(md)
    assert "model.safetensors" not in names and "model.safetensors.index.json" not in names
    if shard:  # packer's own shards, named by the index under the variant's name; the source's index is not carried
        assert index in names and weight_files(result.manifest) == sorted(result.manifest["weights"]["files"])
        assert b"model.fp16-0000" not in (md / index).read_bytes()
    else:  # one file, one copy
        assert "model.fp16.safetensors" in names and weight_files(result.manifest) == ["weights/model.safetensors"]
    ids = torch.tensor([[1, 5, 9, 33, 2]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(src, variant="fp16")(ids).logits
        got = AutoModelForCausalLM.from_pretrained(md, variant="fp16")(ids).logits
    assert torch.equal(got, want)


def test_a_diffusers_pipeline_saved_as_a_variant_loads_with_variant(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    from diffusers import StableDiffusionPipeline

    pipe = diffusers_pipeline(tmp_path / "as-pickles")
    src = tmp_path / "sd"
    pipe.save_pretrained(src, variant="fp16")
    assert (src / "unet" / "diffusion_pytorch_model.fp16.safetensors").is_file()
    out = tmp_path / "out"
    result = build_dir(src, out)
    assert result.manifest["weights"].get("left_out", []) == []
    assert len(weight_files(result.manifest)) == 3  # one file per component: one copy of the bytes
    md = import_loader(out).model_dir()
    assert {"unet/diffusion_pytorch_model.fp16.safetensors", "vae/diffusion_pytorch_model.fp16.safetensors",
            "text_encoder/model.fp16.safetensors"} <= files_of(md)
    assert not any(n.endswith("pytorch_model.safetensors") or n.endswith("/model.safetensors") for n in files_of(md))

    def image(where: Path) -> Any:
        p = StableDiffusionPipeline.from_pretrained(where, variant="fp16")
        return p("abc", num_inference_steps=2, height=16, width=16, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images

    assert (image(md) == image(src)).all()


def test_a_sharded_variant_beside_the_weights_is_carried_as_one_file(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    src = tmp_path / "src"
    model.save_pretrained(src)
    model.to(torch.float16).save_pretrained(src, variant="fp16", max_shard_size="20KB")
    assert (src / "model.safetensors.index.fp16.json").is_file()
    out = tmp_path / "out"
    result = build_dir(src, out)
    assert result.manifest["weights"].get("left_out", []) == []
    md = import_loader(out).model_dir()
    assert {"model.safetensors", "model.fp16.safetensors"} <= files_of(md)
    ids = torch.tensor([[1, 5, 9, 33, 2]])
    for variant in (None, "fp16"):
        with torch.no_grad():
            want = AutoModelForCausalLM.from_pretrained(src, variant=variant)(ids).logits
            got = AutoModelForCausalLM.from_pretrained(md, variant=variant)(ids).logits
        assert torch.equal(got, want)
    left = build_dir(src, tmp_path / "left", dry_run=True,
                     weights={"leave_out": ["model.safetensors.index.fp16.json"]})
    assert "model.safetensors.index.fp16.json" not in str(left.manifest["weights"].get("tree", []))
