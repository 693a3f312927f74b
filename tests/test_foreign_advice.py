"""The advice for transformers' TensorFlow and Flax checkpoints, followed with the real libraries.

Marked ``foreign`` (deselected by ``make test``; ``pytest -m foreign`` runs them, ``.ci/run``
does): TensorFlow and Flax live in their own virtual environment (``$PACKER_FOREIGN_VENV``, made
by ``.ci/foreign-venv`` from the packages the advice names). There the real library writes a tiny
model; ``packer build`` refuses it in one line naming the file; the test runs exactly the
advice's two commands in that venv; the build of the result succeeds, and the model loaded
back from ``model_dir()`` by transformers here gives the original framework's outputs.

Not bitwise against TensorFlow or Flax: their matmul, GELU and layer-norm kernels round in another
order than torch's, so float32 outputs differ by a few ulps (measured on the last hidden state,
whose values reach 3.4: at most 7.2e-7 for TensorFlow, 3.6e-7 for Flax; the logits 6e-8); 1e-6
absolute is the bound. What packer does is
checked bitwise: the model from ``model_dir()`` has exactly the weights of the one transformers
loads from the advice's own output directory. (Not their outputs: torch's CPU matmul rounds
differently for a weight at another address modulo 64, and packer aligns tensors to 64 bytes
where transformers' file does not: the pooler's output moves by an ulp.)
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from packer.cli import main
from tests.component_fixtures import import_loader

pytestmark = pytest.mark.foreign

VENV = Path(os.environ.get("PACKER_FOREIGN_VENV", Path.home() / ".cache/packer/foreign-tf-flax"))
IDS = [[2, 7, 11, 40, 3, 9]]
TOLERANCE = 1e-6  # float32, absolute; see the module docstring

# Run in the foreign venv: a tiny BERT with a classification head (so that the advice's class,
# read from config.json, matters), saved by the framework's own save_pretrained; its outputs.
WRITE = f"""
import sys
import numpy as np
from transformers import BertConfig

kind, out, want = sys.argv[1:]
config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=16, num_labels=3)
ids = np.array({IDS}, dtype=np.int32)
if kind == "tf":
    import tensorflow as tf
    from transformers import TFBertForSequenceClassification
    tf.random.set_seed(0)
    model = TFBertForSequenceClassification(config)
    result = model(ids, output_hidden_states=True, training=False)
    logits, hidden = result.logits.numpy(), result.hidden_states[-1].numpy()
else:
    from transformers import FlaxBertForSequenceClassification
    model = FlaxBertForSequenceClassification(config, seed=0)
    result = model(ids, output_hidden_states=True, train=False)
    logits, hidden = np.asarray(result.logits), np.asarray(result.hidden_states[-1])
model.save_pretrained(out)
np.savez(want, logits=logits, hidden=hidden)
"""

CASES = [("tf", "tf_model.h5", "a TensorFlow (Keras) checkpoint of transformers"),
         ("flax", "flax_model.msgpack", "a Flax checkpoint of transformers")]


def venv_python() -> Path:
    python = VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no TensorFlow/Flax venv at {VENV}: `bash .ci/foreign-venv` makes it")
    return python


def in_venv(command: list[str], tmp: Path) -> None:
    """Run ``command`` with the foreign venv first on PATH and pip unable to download anything."""
    env = {**os.environ, "PATH": f"{VENV / 'bin'}:{os.environ['PATH']}", "PIP_NO_INDEX": "1",
           "TF_CPP_MIN_LOG_LEVEL": "2", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("PYTHONPATH", None)  # nothing of this checkout's packer in there
    r = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, f"{command}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def build(src: Path, out: Path) -> tuple[int, str]:
    recipe = src.parent / "recipe.toml"
    recipe.write_text(f'name = "m"\nversion = "1"\nsource = "{src.name}"\n')
    result = CliRunner().invoke(main, ["build", "--no-sandbox", str(recipe), "-o", str(out)])
    return result.exit_code, result.output


@pytest.mark.parametrize(("kind", "name", "what"), CASES)
def test_the_advice_followed_builds_a_model_with_the_frameworks_outputs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, name: str, what: str) -> None:
    python = venv_python()
    monkeypatch.setenv("PACKER_BUNDLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PACKER_STARTUP_LOG", "off")
    src = tmp_path / "src"
    in_venv([str(python), "-c", WRITE, kind, str(src), str(tmp_path / "want.npz")], tmp_path)
    assert name in os.listdir(src)

    code, output = build(src, tmp_path / "refused")
    lines = output.strip().splitlines()
    assert code == 1 and len(lines) == 1, output
    assert lines[0].startswith(f"error: {src / name}: {what}, which packer does not convert"), output
    commands = re.findall(r"`([^`]+)`", lines[0])
    assert [c.split()[:2] for c in commands] == [["pip", "install"], ["python", "-c"]], commands
    for command in commands:  # exactly as printed; pip finds everything installed (it may not download)
        in_venv(["bash", "-c", command], tmp_path)

    code, output = build(src, tmp_path / "out")
    assert code == 0, output
    assert f"left out: {name}: {what}, which packer does not convert" in output

    from transformers import BertForSequenceClassification

    want = np.load(tmp_path / "want.npz")
    ids = torch.tensor(IDS)
    built = BertForSequenceClassification.from_pretrained(import_loader(tmp_path / "out").model_dir()).eval()
    direct = BertForSequenceClassification.from_pretrained(src).eval()  # the advice's output, without packer
    with torch.no_grad():
        got = built(ids, output_hidden_states=True)
    assert built.state_dict().keys() == direct.state_dict().keys()
    assert all(torch.equal(v, direct.state_dict()[k]) for k, v in built.state_dict().items())
    for mine, theirs in ((got.logits, want["logits"]), (got.hidden_states[-1], want["hidden"])):
        assert mine.dtype == torch.float32 and theirs.dtype == np.float32
        np.testing.assert_allclose(mine.numpy(), theirs, rtol=0, atol=TOLERANCE)
