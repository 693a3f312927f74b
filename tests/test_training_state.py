"""Training state named for what it is: a Trainer checkpoint-N/ and accelerate's save_state folder,
written by the real libraries; the model builds and loads bitwise, the rest is never offered as weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from packer.checkpoint.training import further_model, training_state
from tests.built import build_dir


def packer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "packer", *args], capture_output=True, text=True, check=False)


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def one_line_refusal(path: Path, tmp: Path, *words: str) -> None:
    for cmd in (("convert", str(path), "-o", str(tmp / "never")), ("inspect", str(path))):
        r = packer(*cmd)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "holds no model weights" in r.stderr and all(w in r.stderr for w in words), r.stderr
        assert "--allow-global" not in r.stderr and "--key" not in r.stderr
    assert not (tmp / "never").exists()


def test_names() -> None:
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "rng_state_3.pth", "training_args.bin",
                 "trainer_state.json", "optimizer.bin", "optimizer_1.bin", "scheduler.bin", "random_states_0.pkl",
                 "scaler.pt"):
        assert training_state(name), name
    for name in ("pytorch_model.bin", "model.safetensors", "model_1.safetensors", "last.ckpt", "optimizer.json"):
        assert training_state(name) is None, name
    for name in ("model_1.safetensors", "model_12.safetensors", "pytorch_model_1.bin"):
        assert further_model(name), name
    for name in ("model.safetensors", "model_0.safetensors", "model.fp16.safetensors",
                 "model-00001-of-00002.safetensors"):
        assert further_model(name) is None, name


@pytest.mark.slow
def test_trainer_checkpoint_builds_the_model_and_names_training_state(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    model = tiny_llama()
    ids = torch.randint(0, 64, (8, 8))
    args = TrainingArguments(str(tmp_path / "run"), max_steps=2, save_steps=2, per_device_train_batch_size=4,
                             report_to=[], use_cpu=True)
    Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids]).train()
    ckpt = tmp_path / "run" / "checkpoint-2"
    result = build_dir(ckpt, tmp_path / "out")
    notes = "\n".join(result.notes)
    assert "left out as training state" in notes and "optimizer.pt" in notes and "training_args.bin" in notes
    assert "name them in weights.files" not in notes
    env = {"PATH": "/usr/bin:/bin", "PACKER_BUNDLE_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, str(tmp_path / "out" / "packer_loader.py"), "--model-dir"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    got = AutoModelForCausalLM.from_pretrained(Path(r.stdout.strip())).state_dict()
    want = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
    assert all(got[k].view(torch.uint8).equal(v.view(torch.uint8)) for k, v in want.items())
    one_line_refusal(ckpt / "optimizer.pt", tmp_path, "optimizer state")
    one_line_refusal(ckpt / "rng_state.pth", tmp_path, "random-number generator state")
    one_line_refusal(ckpt / "scheduler.pt", tmp_path, "scheduler state")
    one_line_refusal(ckpt / "training_args.bin", tmp_path, "TrainingArguments")
    # renamed, the same file is still said to be one object, not weights, before any flag
    (tmp_path / "args.bin").write_bytes((ckpt / "training_args.bin").read_bytes())
    r = packer("convert", str(tmp_path / "args.bin"), "-o", str(tmp_path / "never"))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    head = r.stderr.split("--allow-global")[0]
    assert "holds one transformers.training_args.TrainingArguments object, not a dict of tensors" in head


@pytest.mark.slow
def test_accelerate_save_state(tmp_path: Path) -> None:
    accelerate = pytest.importorskip("accelerate")
    from safetensors.torch import load_file

    acc = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    model, opt, sched = acc.prepare(model, opt, sched)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    acc.save_state(str(tmp_path / "state"))
    names = sorted(p.name for p in (tmp_path / "state").iterdir())
    assert "optimizer.bin" in names and "random_states_0.pkl" in names, names
    r = packer("convert", str(tmp_path / "state"), "-o", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(got[k].equal(v) for k, v in model.state_dict().items())
    one_line_refusal(tmp_path / "state" / "optimizer.bin", tmp_path, "optimizer state")
    one_line_refusal(tmp_path / "state" / "random_states_0.pkl", tmp_path, "random-number generator state")


@pytest.mark.slow
def test_accelerate_second_model_is_a_further_model_not_a_variant(tmp_path: Path) -> None:
    accelerate = pytest.importorskip("accelerate")
    from safetensors.torch import load

    from tests.built import weight_bytes

    acc = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)
    opts = [torch.optim.AdamW(m.parameters()) for m in (first, second)]
    first, second, *opts = acc.prepare(first, second, *opts)
    second(first(torch.randn(2, 4))).sum().backward()
    for opt in opts:
        opt.step()
    acc.save_state(str(tmp_path / "state"))
    assert (tmp_path / "state" / "model_1.safetensors").is_file()
    result = build_dir(tmp_path / "state", tmp_path / "out")
    notes = "\n".join(result.notes)
    assert "components: model (., transformers)" in notes and notes.count("variant") == notes.count("not a variant")
    assert "carried under their own names" not in notes, notes
    assert ("left out: model_1.safetensors: a further model (accelerate's save_state names the models it prepared "
            "model, model_1, model_2...), not a variant of the first: build it on its own with weights.files = "
            '["model_1.safetensors"]') in notes, notes
    got = load(weight_bytes(tmp_path / "out"))
    assert sorted(got) == ["bias", "weight"] and all(got[k].equal(v) for k, v in first.state_dict().items())
    # the note's recipe builds the other
    build_dir(tmp_path / "state", tmp_path / "out1", weights={"files": ["model_1.safetensors"]})
    got = load(weight_bytes(tmp_path / "out1"))
    assert all(got[k].equal(v) for k, v in second.state_dict().items())


def test_ema_counter_left_out_by_name_and_strict_load(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ema = torch.optim.swa_utils.AveragedModel(model)
    ema.update_parameters(model)
    torch.save(ema.state_dict(), tmp_path / "ema.pt")
    r = packer("convert", str(tmp_path / "ema.pt"), "-o", str(tmp_path / "out"), "--exclude", "n_averaged",
               "--strip-prefix", "module.")
    assert r.returncode == 0, r.stderr
    assert "left out by weights.include/exclude: n_averaged" in r.stdout
    fresh = torch.nn.Linear(4, 3)
    fresh.load_state_dict(load_file(str(tmp_path / "out" / "model.safetensors")), strict=True)
    assert fresh.weight.equal(ema.module.weight)
    r = packer("convert", str(tmp_path / "ema.pt"), "-o", str(tmp_path / "none"), "--include", "online_model.*")
    assert r.returncode == 1 and "weights.include: 'online_model.*' matches no tensor" in r.stderr
