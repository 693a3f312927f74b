"""``from_pretrained`` and ``model_dir`` against transformers' own ``from_pretrained``, bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from packer.runtime.empty import init_empty
from packer.runtime.hf import hf_from_pretrained, hf_model_dir
from packer.runtime.loading import Loader
from packer.runtime.timeline import Timeline
from tests.hf_fixtures import bert, llama, packer_artifacts

pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("build_env")  # tests/conftest.py: no start-up log, a private bundle cache


def loader_for(src: Path, root: Path) -> Loader:
    return Loader(packer_artifacts(src, root), root, timeline=Timeline())


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


IDS = torch.tensor([[3, 17, 42, 5, 88, 9, 1, 60]])


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_llama_logits_bitwise_equal_to_transformers(tmp_path: Path, shard: str | None) -> None:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    llama(tmp_path / "hf", shard=shard)
    ld = loader_for(tmp_path / "hf", tmp_path / "out")
    assert (len(ld.manifest["weights"]["files"]) > 1) == (shard is not None)
    want = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    for cls in (LlamaForCausalLM, AutoModelForCausalLM):
        got = hf_from_pretrained(ld, cls, device="cpu")
        assert not got.training and got.dtype == torch.bfloat16
        assert got.lm_head.weight is got.model.embed_tokens.weight  # tied: one tensor
        rotary, ref = got.model.rotary_emb.inv_freq, want.model.rotary_emb.inv_freq
        assert torch.equal(rotary, ref) and rotary.dtype == ref.dtype
        assert torch.equal(logits(got, IDS), logits(want, IDS))


def test_init_empty_and_load_into_match_transformers(tmp_path: Path) -> None:
    from transformers import AutoConfig, LlamaForCausalLM

    llama(tmp_path / "hf", tied=False)
    ld = loader_for(tmp_path / "hf", tmp_path / "out")
    config = AutoConfig.from_pretrained(ld.bundle_dir())
    with init_empty(dtype=torch.bfloat16):
        model = LlamaForCausalLM(config)
    # flagged as transformers flags loaded tensors: post_init skipped their init on meta
    assert all(p.is_meta and p._is_hf_initialized for p in model.parameters())
    result = ld.load_into(model)
    assert (result.missing, result.unexpected) == ([], [])
    want = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(logits(model.eval(), IDS), logits(want, IDS))


def test_bert_checkpoint_with_position_ids_key(tmp_path: Path) -> None:
    from transformers import BertModel

    bert(tmp_path / "hf")
    ld = loader_for(tmp_path / "hf", tmp_path / "out")
    assert "embeddings.position_ids" in ld.manifest["weights"]["tensors"]
    with init_empty():
        model = BertModel(BertModel.config_class.from_pretrained(ld.bundle_dir()))
    result = ld.load_into(model)  # strict: the key names a non-persistent buffer
    assert (result.missing, result.unexpected) == ([], [])
    assert any(n.startswith("embeddings.position_ids: a non-persistent buffer") for n in result.notes)
    want = BertModel.from_pretrained(tmp_path / "hf")
    got = hf_from_pretrained(ld, BertModel, device="cpu")
    ids = IDS % 64
    assert torch.equal(logits(got, ids), logits(want, ids))
    assert torch.equal(logits(model.eval(), ids), logits(want, ids))


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_model_dir_is_read_back_by_transformers(tmp_path: Path, shard: str | None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llama(tmp_path / "hf", shard=shard)
    ld = loader_for(tmp_path / "hf", tmp_path / "out")
    d = hf_model_dir(ld)
    assert hf_model_dir(ld) == d  # made once
    for f in d.iterdir():
        assert f.is_symlink(), f  # linked, never copied
    weights = sorted(p.name for p in d.glob("*.safetensors"))
    assert weights == sorted(Path(r).name for r in ld.manifest["weights"]["files"])
    assert (d / "model.safetensors.index.json").is_file() == (shard is not None)
    assert (d / "weights" / "model.safetensors").exists() is False
    ids = AutoTokenizer.from_pretrained(d)("w3 w17 w42 w5", return_tensors="pt")["input_ids"]
    assert ids.tolist() == [[5, 19, 44, 7]]
    got = AutoModelForCausalLM.from_pretrained(d)
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(logits(got, ids), logits(want, ids))


def test_from_pretrained_refuses_missing_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForCausalLM

    llama(tmp_path / "hf")
    sd = load_file(tmp_path / "hf" / "model.safetensors")
    del sd["model.norm.weight"]
    save_file(sd, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    ld = loader_for(tmp_path / "hf", tmp_path / "out")
    with pytest.raises(RuntimeError, match=r"LlamaForCausalLM not in the weights: \['model.norm.weight'\]"):
        hf_from_pretrained(ld, LlamaForCausalLM, device="cpu")


def test_emitted_loader_prints_a_model_dir(tmp_path: Path) -> None:
    import subprocess
    import sys

    from transformers import AutoConfig

    from packer.stub import emit_loader

    llama(tmp_path / "hf")
    out = tmp_path / "out"
    emit_loader(out, packer_artifacts(tmp_path / "hf", out))
    env = {"PATH": "/usr/bin:/bin", "PACKER_BUNDLE_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, str(out / "packer_loader.py"), "--model-dir"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    d = Path(r.stdout.strip())
    assert d.parent == tmp_path / "cache"
    assert (d / "model.safetensors").resolve() == out / "weights" / "model.safetensors"
    assert AutoConfig.from_pretrained(d).num_hidden_layers == 2
    (out / "weights" / "model.safetensors").unlink()
    r = subprocess.run([sys.executable, str(out / "packer_loader.py"), "--model-dir", "--root", str(out)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and "model dir failed: weights/model.safetensors: missing" in r.stderr


@pytest.mark.slow
def test_a_cpu_load_by_mapping_compiles_only_the_modules_it_uses(tmp_path: Path) -> None:
    """The stub compiles each runtime module from its checked source at every start: a warm
    start of ``from_pretrained`` on CPU (bundle already extracted) leaves the ring, its engines,
    CUDA graphs, the warm pool, model directories, signatures and the bundle reader unimported."""
    import json
    import subprocess
    import sys

    from packer.stub import emit_loader

    llama(tmp_path / "hf")
    out = tmp_path / "out"
    emit_loader(out, packer_artifacts(tmp_path / "hf", out))
    code = (f"import sys, json; sys.path.insert(0, {str(out)!r}); import transformers; import packer_loader as P; "
            "m = P.from_pretrained(transformers.AutoModelForCausalLM, device='cpu'); "
            "print(json.dumps(sorted(n for n in sys.modules if n.startswith('_packer_runtime_'))))")
    env = {"PATH": "/usr/bin:/bin", "PACKER_BUNDLE_CACHE": str(tmp_path / "cache"), "PACKER_STARTUP_LOG": "off"}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
            for _ in range(2)]  # the first extracts the bundle, the second finds it in the cache
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr
    first, warm = ({n.rpartition(".")[2] for n in json.loads(r.stdout.splitlines()[-1])} for r in runs)
    assert "bundle_reader" in first
    assert {"loader", "loading", "cpu", "hf", "bundle_cache"} <= warm
    unused = {"ring", "engines", "into", "layout", "graphs", "warm", "dirtree", "signature", "tp", "bundle_reader"}
    assert not warm & unused, sorted(warm & unused)
