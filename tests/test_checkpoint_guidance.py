"""Guidance in one run: a checkpoint with many plain-data globals converts after following one message."""

from __future__ import annotations

import argparse
import shlex
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from packer.checkpoint.reader import read_checkpoint
from packer.errors import DisallowedGlobalError
from packer.recipe import WeightsConfig
from packer.weights.convert import convert

N_CLASSES = 11


def _trainer_module() -> types.ModuleType:
    """A user's training package with plain-data classes, importable while the fixture is written."""
    mod = types.ModuleType("mytrainer_cfg")
    for i in range(N_CLASSES):
        cls = type(f"Cfg{i}", (), {"__module__": "mytrainer_cfg"})
        setattr(mod, cls.__name__, cls)
    sys.modules[mod.__name__] = mod
    return mod


def _objects(mod: types.ModuleType) -> list[object]:
    out = []
    for i in range(N_CLASSES):
        obj = getattr(mod, f"Cfg{i}")()
        obj.value = i  # type: ignore[attr-defined]
        out.append(obj)
    return out


def flags(message: str) -> list[str]:
    """The ``--allow-global`` patterns (and ``--key``) a message tells the user to paste."""
    words = shlex.split(message.split("with: ", 1)[1].split(" (recipe", 1)[0])
    return words


def test_every_disallowed_global_in_one_message_then_converts(tmp_path: Path) -> None:
    mod = _trainer_module()
    sd = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    objs = _objects(mod)
    torch.save({"state_dict": sd, "hparams": {"cfgs": objs, "again": objs[:3]},
                "device": torch.device("cpu"), "args": argparse.Namespace(lr=0.1)}, tmp_path / "ckpt.pt")
    with pytest.raises(DisallowedGlobalError) as e:
        read_checkpoint(tmp_path / "ckpt.pt", key="state_dict")
    msg = str(e.value)
    words = flags(msg)
    patterns = words[1::2]
    assert words[0::2] == ["--allow-global"] * N_CLASSES
    assert patterns == sorted(f"mytrainer_cfg.Cfg{i}" for i in range(N_CLASSES))  # all, each once
    assert "torch.device" not in msg  # torch's weights-only loader admits it: a placeholder by default
    cfg = WeightsConfig(key="state_dict", allow_globals=tuple(patterns))
    out = convert(tmp_path / "ckpt.pt", tmp_path / "out", cfg)
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == {"w", "b"} and all(torch.equal(got[k], sd[k]) for k in sd)
    assert out.notes  # the placeholders beside the key are named


def test_module_objects_beside_a_state_dict_get_the_key_and_the_flags(tmp_path: Path) -> None:
    sd = {"w": torch.ones(2, 2)}
    torch.save({"state_dict": sd, "hparams": {"act": torch.nn.ReLU(), "out": torch.nn.Tanh()}}, tmp_path / "c.pt")
    with pytest.raises(DisallowedGlobalError) as e:
        read_checkpoint(tmp_path / "c.pt")
    msg = str(e.value)
    assert "beside the state dict" in msg and "whole pickle" not in msg
    words = flags(msg)
    assert words[:2] == ["--key", "state_dict"]
    allow = tuple(words[3::2])
    assert "torch.nn.modules.activation.ReLU" in allow and "torch.nn.modules.activation.Tanh" in allow
    convert(tmp_path / "c.pt", tmp_path / "out", WeightsConfig(key="state_dict", allow_globals=allow))
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["w"], sd["w"])


def test_a_pickled_module_is_told_to_save_its_state_dict(tmp_path: Path) -> None:
    torch.save(torch.nn.Linear(2, 2), tmp_path / "m.pt")
    with pytest.raises(DisallowedGlobalError, match=r"a pickled model object, not a state dict: in the model's "
                       r"own code, `torch\.save\(model\.state_dict\(\)\)`"):
        read_checkpoint(tmp_path / "m.pt")
