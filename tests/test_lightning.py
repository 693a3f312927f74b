"""Lightning checkpoints written by a real Lightning Trainer (CPU, two steps, a Hugging Face model
inside a LightningModule): inspect and the refusal give the recipe in one step, the recipe builds a
model transformers loads bitwise, and the optimizer's state is never offered as weights."""

from __future__ import annotations

import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.test_training_state import packer, tiny_llama

L = pytest.importorskip("lightning")

RECIPE = """name = "m"
version = "1"
source = "{src}"
{weights}"""
# the how-to's recipe (docs/how-to/from-a-training-run.md, "Lightning .ckpt")
WEIGHTS = '[weights]\nkey = "state_dict"\nstrip_prefixes = ["model."]\n'


class Causal(L.LightningModule):  # type: ignore[misc, name-defined]
    """As people write one: the Hugging Face model under ``self.model``, optionally a weighted loss."""

    def __init__(self, weighted_loss: bool = False) -> None:
        super().__init__()
        self.model = tiny_llama()
        if weighted_loss:  # a second attribute with a tensor: the model's must be told apart
            self.loss_fn = torch.nn.CrossEntropyLoss(weight=torch.ones(64))

    def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(input_ids=batch, labels=batch).loss
        return loss

    def configure_optimizers(self) -> object:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}


def fit(root: Path, module: torch.nn.Module) -> Path:
    """Two training steps on CPU; the .ckpt Lightning's ModelCheckpoint wrote."""
    torch.manual_seed(1)
    data = torch.utils.data.DataLoader(torch.randint(0, 64, (8, 8)), batch_size=4)
    with warnings.catch_warnings():  # few workers, no logger, ...
        warnings.simplefilter("ignore")
        L.Trainer(accelerator="cpu", max_steps=2, default_root_dir=str(root), logger=False,
                  enable_progress_bar=False, enable_model_summary=False).fit(module, data)
    (ckpt,) = (root / "checkpoints").glob("*.ckpt")
    return ckpt


def flags_in(message: str) -> list[str]:
    """The convert flags a hint gives, as a shell would split them."""
    return shlex.split(message.split("convert with ", 1)[1].split(" (recipe: ", 1)[0])


@pytest.mark.slow
def test_lightning_checkpoint_recipe_in_one_step_builds_bitwise(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    module = Causal()
    ckpt = fit(tmp_path / "run", module)
    # inspect: the recipe first; optimizer and scheduler state summed up, never listed as tensors
    r = packer("inspect", str(ckpt))
    assert r.returncode == 0, r.stderr
    hint = r.stdout.splitlines()[1]
    assert "a Lightning checkpoint" in hint and "convert with --key state_dict --strip-prefix model." in hint, hint
    assert "(training state) optimizer_states: " in r.stdout
    assert not [line for line in r.stdout.splitlines() if line.lstrip().startswith("optimizer_states.")]
    # the refusal without a key: the same recipe in one line, no optimizer key on offer
    r = packer("convert", str(ckpt), "-o", str(tmp_path / "never"))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--key state_dict --strip-prefix model." in r.stderr and "choose a key" not in r.stderr
    assert "optimizer_states are training state, not model weights" in r.stderr.replace("callbacks, ", "")
    assert flags_in(r.stderr) == ["--key", "state_dict", "--strip-prefix", "model."]
    assert not (tmp_path / "never").exists()
    # a build of the folder without the recipe: refused alike
    src = tmp_path / "src"
    src.mkdir()
    (src / "last.ckpt").write_bytes(ckpt.read_bytes())
    module.model.config.save_pretrained(src)
    (tmp_path / "bare.toml").write_text(RECIPE.format(src=src, weights=""))
    r = packer("build", str(tmp_path / "bare.toml"), "-o", str(tmp_path / "bare"))
    assert r.returncode == 1 and "Lightning checkpoint" in r.stderr and "--strip-prefix model." in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "bare").exists()
    # the how-to's recipe: transformers loads the build's model directory bitwise
    (tmp_path / "r.toml").write_text(RECIPE.format(src=src, weights=WEIGHTS))
    r = packer("build", str(tmp_path / "r.toml"), "-o", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    env = {"PATH": "/usr/bin:/bin", "PACKER_BUNDLE_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, str(tmp_path / "out" / "packer_loader.py"), "--model-dir"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    model_dir = Path(r.stdout.strip())
    want = module.model.state_dict()
    assert sorted(load_file(str(model_dir / "model.safetensors"))) == sorted(want)  # the names, not a lenient load
    got = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert sorted(got) == sorted(want)
    assert all(got[k].view(torch.uint8).equal(v.contiguous().view(torch.uint8)) for k, v in want.items())
    assert not any(k.startswith(("exp_avg", "state.")) for k in got)


@pytest.mark.slow
def test_a_second_attribute_is_told_apart_and_the_flags_run_as_printed(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    module = Causal(weighted_loss=True)
    ckpt = fit(tmp_path / "run", module)
    r = packer("convert", str(ckpt), "-o", str(tmp_path / "never"))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "under several attributes (model. (12), loss_fn. (1))" in r.stderr, r.stderr
    flags = flags_in(r.stderr)
    assert flags == ["--key", "state_dict", "--include", "model.*", "--strip-prefix", "model."]
    r = packer("convert", str(ckpt), "-o", str(tmp_path / "out"), *flags)
    assert r.returncode == 0, r.stderr
    assert "left out by weights.include/exclude: loss_fn.weight" in r.stdout
    fresh = tiny_llama()
    fresh.load_state_dict(load_file(str(tmp_path / "out" / "model.safetensors")), strict=True)
    assert all(fresh.state_dict()[k].equal(v) for k, v in module.model.state_dict().items())
