"""Refusals that say what the input is and lead somewhere: each advice followed works.

A pickled model object (``torch.save(model)``, the ultralytics ``{"model": <module>, ...}``)
is told to save its state dict, with no ``--allow-global`` flags (placeholders would keep the
weights out); following it builds. A tensor subclass names itself and two ways out, each
followed here. A conversion of zero tensors fails. Other frameworks' files are named as what
they are, and a GGUF file beside the weights is in the left-out note.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from packer.cli import main
from packer.util.formats import FLAX_PACKAGES, TF_PACKAGES
from tests.built import build_dir
from tests.component_fixtures import import_loader

NET = '''
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2))
'''


pytestmark = pytest.mark.usefixtures("build_env")  # tests/conftest.py: no start-up log, a private bundle cache


@pytest.fixture
def net_module(tmp_path: Path) -> Iterator[Any]:
    """A user's model class in a module of its own (``usernet.Net``), importable while the test runs."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "usernet.py").write_text(NET)
    sys.path.insert(0, str(tmp_path / "code"))
    try:
        yield importlib.import_module("usernet")
    finally:
        sys.path.remove(str(tmp_path / "code"))
        sys.modules.pop("usernet", None)


def convert(src: Path, out: Path, *extra: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["convert", "--no-sandbox", str(src), "-o", str(out), *extra])
    return result.exit_code, result.output


def one_line(output: str) -> str:
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    return lines[0]


MODULE_ADVICE = "a pickled model object, not a state dict: in the model's own code, `torch.save(model.state_dict())`"


def _tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def test_a_pickled_transformers_model_is_told_to_save_its_state_dict(tmp_path: Path) -> None:
    model = _tiny_llama().eval()
    src = tmp_path / "whole"
    src.mkdir()
    torch.save(model, src / "pytorch_model.bin")
    code, output = convert(src, tmp_path / "refused")
    line = one_line(output)
    assert code == 1 and MODULE_ADVICE in line and "LlamaForCausalLM" in line and "--allow-global" not in line
    # the advice, followed: the state dict (and the config, as save_pretrained keeps it) builds and loads
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    torch.save(model.state_dict(), fixed / "pytorch_model.bin")
    model.config.save_pretrained(fixed)
    build_dir(fixed, tmp_path / "out")
    from transformers import LlamaForCausalLM

    md = import_loader(tmp_path / "out").model_dir()
    ids = torch.tensor([[1, 5, 9, 33]])
    with torch.no_grad():
        assert torch.equal(LlamaForCausalLM.from_pretrained(md).eval()(ids).logits, model(ids).logits)


def test_the_ultralytics_shape_is_told_the_same_even_with_its_classes_allowed(tmp_path: Path, net_module: Any) -> None:
    net = net_module.Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    src = tmp_path / "runs"
    src.mkdir()
    torch.save({"model": net, "epoch": 3, "optimizer": opt.state_dict(), "best_fitness": 0.5}, src / "best.pt")
    for extra in ((), ("--allow-global", "usernet.*", "--allow-global", "torch.nn.modules.*")):
        code, output = convert(src, tmp_path / "refused", *extra)
        line = one_line(output)
        assert code == 1 and MODULE_ADVICE in line and "usernet.Net under key 'model'" in line
        assert "--allow-global" not in line and not (tmp_path / "refused").exists()
    fixed = tmp_path / "fixed.pt"
    torch.save(net.state_dict(), fixed)  # the advice, in the model's own code
    code, output = convert(fixed, tmp_path / "out")
    assert code == 0, output
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == set(net.state_dict())
    assert all(torch.equal(got[k], v) for k, v in net.state_dict().items())


def test_a_torchao_subclass_names_itself_and_both_ways_out_work(tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    from safetensors.torch import save_file
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict, unflatten_tensor_state_dict
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    q = torch.nn.Sequential(torch.nn.Linear(32, 16))
    quantize_(q, Int8WeightOnlyConfig())
    src = tmp_path / "pickled"
    src.mkdir()
    torch.save(q.state_dict(), src / "pytorch_model.bin")
    code, output = convert(src, tmp_path / "refused")
    line = one_line(output)
    assert code == 1 and "tensor subclass torchao.quantization.Int8Tensor" in line and "--allow-global" not in line
    assert "flatten_tensor_state_dict()" in line and "dequantize()" in line
    # way out 1: torchao's flattened safetensors form; packer keeps its metadata, torchao reads it back
    tensors, meta = flatten_tensor_state_dict(q.state_dict())
    (tmp_path / "flat").mkdir()
    save_file(tensors, tmp_path / "flat" / "model.safetensors", metadata=meta)
    assert convert(tmp_path / "flat", tmp_path / "out1")[0] == 0
    from safetensors import safe_open

    with safe_open(tmp_path / "out1" / "model.safetensors", "pt") as f:
        names = list(f.keys())  # noqa: SIM118 (safe_open is no mapping)
        back, left = unflatten_tensor_state_dict({k: f.get_tensor(k) for k in names}, f.metadata())
    assert not left and torch.equal(back["0.weight"].dequantize(), q.state_dict()["0.weight"].dequantize())
    # way out 2: plain tensors
    plain = tmp_path / "plain.pt"
    torch.save({k: v.dequantize() for k, v in q.state_dict().items()}, plain)
    assert convert(plain, tmp_path / "out2")[0] == 0
    assert torch.equal(load_file(tmp_path / "out2" / "model.safetensors")["0.weight"],
                       q.state_dict()["0.weight"].dequantize())


@pytest.mark.parametrize("state", [{}, {"epoch": 3, "lr": 0.1}])
def test_zero_tensors_is_a_failure_without_advice(tmp_path: Path, state: dict[str, Any]) -> None:
    torch.save(state, tmp_path / "ckpt.pt")
    code, output = convert(tmp_path / "ckpt.pt", tmp_path / "out")
    line = one_line(output)
    assert code == 1 and "no tensors to write" in line and not (tmp_path / "out").exists()
    assert "weights." not in line and "--" not in line  # nothing to follow: there is nothing to build


def _ctranslate2_bin(spec: str) -> bytes:
    """The head of a CTranslate2 model.bin: binary version, spec name (u16 length with NUL), revision, count."""
    name = spec.encode() + b"\0"
    return struct.pack("<I", 6) + struct.pack("<H", len(name)) + name + struct.pack("<II", 3, 0)


@pytest.mark.parametrize(("name", "content", "reason"), [
    ("tf_model.h5", b"\x89HDF\r\n\x1a\n" + bytes(64), "a TensorFlow (Keras) checkpoint of transformers"),
    ("tf_model-00001-of-00002.h5", b"\x89HDF\r\n\x1a\n" + bytes(64), "a TensorFlow (Keras) checkpoint of transformers"),
    ("weights.h5", b"\x89HDF\r\n\x1a\n" + bytes(64), "a Keras model"),
    ("model.keras", b"PK\x03\x04" + bytes(64), "a Keras model"),
    ("flax_model.msgpack", b"\x82\xa6params" + bytes(16), "a Flax checkpoint of transformers"),
    ("model.gguf", b"GGUF\x03\x00\x00\x00" + bytes(32), "a GGUF file (llama.cpp's format"),
    ("model.onnx", b"\x08\x07\x12\x07pytorch" + bytes(16), "an ONNX graph"),
    ("model.bin", _ctranslate2_bin("TransformerDecoderModelSpec"),
     "a CTranslate2 model (model.bin of a TransformerDecoderModelSpec)"),
])
def test_other_frameworks_files_are_named(tmp_path: Path, name: str, content: bytes, reason: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / name).write_bytes(content)
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, output = convert(src, tmp_path / "out")
    line = one_line(output)
    assert code == 1 and f"{src / name}: {reason}" in line and "packer does not convert" in line


@pytest.mark.parametrize(("name", "what"), [
    ("model-q4_k_m.gguf", "a GGUF file (llama.cpp's format, often re-quantized)"),
    # the advice followed: the PyTorch weights beside it (tests/test_foreign_advice.py writes them)
    ("tf_model.h5", "a TensorFlow (Keras) checkpoint of transformers"),
])
def test_a_foreign_file_beside_the_weights_is_named_left_out(tmp_path: Path, name: str, what: str) -> None:
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.ones(2)}, src / "model.safetensors")
    (src / name).write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(32))
    result = build_dir(src, tmp_path / "out", dry_run=True)
    assert result.manifest["weights"]["left_out"] == [name]
    assert f"left out: {name}: {what}, which packer does not convert" in result.notes


def test_a_layout_without_weights_advises_only_what_builds(tmp_path: Path) -> None:
    from packer.errors import WeightsError

    src = tmp_path / "src"
    (src / "1_Pooling").mkdir(parents=True)
    (src / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "1_Pooling",
                                                   "type": "sentence_transformers.models.Pooling"}]))
    with pytest.raises(WeightsError, match="no component holds a checkpoint; nor does the root: there are no "
                                           "weights here to build"):
        build_dir(src, tmp_path / "a", dry_run=True)
    torch.save({"w": torch.ones(2)}, src / "weights.pt")
    with pytest.raises(WeightsError, match=r'set weights.layout = "model" to convert the root alone'):
        build_dir(src, tmp_path / "b", dry_run=True)
    followed = build_dir(src, tmp_path / "c", dry_run=True, weights={"layout": "model"})  # the advice, followed
    assert list(followed.manifest["weights"]["tensors"]) == ["w"]


def test_a_module_beside_top_level_tensors_keeps_the_placeholder_advice(tmp_path: Path) -> None:
    """A module object next to the tensors is an entry beside the state dict: its flags, followed, convert."""
    torch.save({"w": torch.arange(4.0), "act": torch.nn.ReLU()}, tmp_path / "ckpt.pt")
    code, output = convert(tmp_path / "ckpt.pt", tmp_path / "refused")
    line = one_line(output)
    assert code == 1 and "--allow-global torch.nn.modules.activation.ReLU" in line and MODULE_ADVICE not in line
    code, output = convert(tmp_path / "ckpt.pt", tmp_path / "out", "--allow-global", "torch.nn.modules.activation.ReLU")
    assert code == 0, output
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["w"], torch.arange(4.0))


@pytest.mark.parametrize(("name", "flag", "packages"), [
    ("tf_model.h5", "from_tf", TF_PACKAGES), ("flax_model.msgpack", "from_flax", FLAX_PACKAGES),
])
def test_transformers_tf_and_flax_advice_names_the_commands_for_this_directory(
        tmp_path: Path, name: str, flag: str, packages: tuple[str, ...]) -> None:
    """Two commands in backticks, the second converting this very directory (shell-quoted); the
    real libraries follow them in tests/test_foreign_advice.py (``pytest -m foreign``)."""
    src = tmp_path / "it's a model dir"
    src.mkdir()
    (src / name).write_bytes(bytes(64))
    code, output = convert(src, tmp_path / "out")
    line = one_line(output)
    assert code == 1 and line.startswith(f"error: {src / name}: ") and "transformers 4.50" in line
    pip, python = re.findall(r"`([^`]+)`", line)
    assert shlex.split(pip) == ["pip", "install", *packages] and "transformers<4.51" in packages
    argv = shlex.split(python)
    assert argv[:2] == ["python", "-c"] and argv[3:] == [str(src)] and f"{flag}=True" in argv[2]
    assert "save_pretrained(d)" in argv[2]  # beside the source: its tokenizer and other files stay with it


def bash_argv(command: str, cwd: Path) -> list[bytes]:
    """The arguments real bash makes of ``command`` as printed (its first word replaced)."""
    rest = command.split(" ", 1)[1]
    r = subprocess.run(["bash", "-c", f"printf '%s\\0' {rest}"], cwd=cwd, capture_output=True, check=True)
    return r.stdout.split(b"\0")[:-1]


HOSTILE_DIR = "m\nx\ty 'q' $HOME \\z"


@pytest.mark.parametrize("name", ["tf_model.h5", "flax_model.msgpack"])
def test_advice_names_a_hostile_directory_exactly_as_bash_reads_it(tmp_path: Path, name: str) -> None:
    """A newline, a tab, a quote, ``$`` and a backslash in the directory: the printed command,
    pasted into bash, names that directory and not the decoy beside it, whose name is what the
    escaped text would read as inside single quotes."""
    from packer.util.show import show

    src = tmp_path / HOSTILE_DIR
    decoy = tmp_path / show(HOSTILE_DIR)  # "m\\nx\\ty ...": a real backslash-n
    for d in (src, decoy):
        d.mkdir()
        (d / name).write_bytes(bytes(64))
    code, output = convert(src, tmp_path / "out")
    line = one_line(output)
    assert code == 1
    pip, python = re.findall(r"`([^`]+)`", line)
    argv = bash_argv(python, tmp_path)
    assert argv[0] == b"-c" and argv[2:] == [os.fsencode(src)], argv
    assert os.fsencode(decoy) not in argv


def test_profile_names_a_hostile_directory_exactly_as_bash_reads_it(tmp_path: Path) -> None:
    out = tmp_path / HOSTILE_DIR
    out.mkdir()
    result = CliRunner().invoke(main, ["profile", str(out)])
    line = one_line(result.output)
    assert result.exit_code == 1
    (command,) = re.findall(r"`([^`]+)`", line)
    assert bash_argv(command, tmp_path) == [b"build", b"-o", os.fsencode(out)]
