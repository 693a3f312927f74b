"""Plain-data objects beside the weights travel as inert placeholders; tensors stay bit-exact.

Fixtures are written by the real pickler (torch.save). Lightning's ``AttributeDict`` and a
user's config class are stand-ins defined under their real module names while pickling;
the reader never imports them, and the tests check that nothing was imported or called.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import pathlib
import pickle
import subprocess
import sys
import types
import zipfile
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from packer.checkpoint import inspect_checkpoint, read_checkpoint
from packer.checkpoint.pickle_vm import policy_for, run_pickle
from packer.checkpoint.placeholders import Placeholder
from packer.errors import DisallowedGlobalError, PayloadError, UnsafeInputError
from packer.recipe import WeightsConfig
from packer.weights.convert import convert
from tests.ckpt_factory import tensor_bytes
from tests.weights_validate import validate_output


@contextlib.contextmanager
def stand_in(module: str, name: str, base: type = object) -> Iterator[type]:
    """A class named ``module.name`` that pickle can find, gone again afterwards."""
    parts = module.split(".")
    added = [".".join(parts[: i + 1]) for i in range(len(parts)) if ".".join(parts[: i + 1]) not in sys.modules]
    for m in added:
        sys.modules[m] = types.ModuleType(m)
    cls = type(name, (base,), {"__module__": module, "__qualname__": name})
    setattr(sys.modules[module], name, cls)
    try:
        yield cls
    finally:
        for m in added:
            del sys.modules[m]


def state_dict() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"layer.weight": torch.randn(3, 4, generator=g), "layer.bias": torch.randn(3, generator=g),
            "norm._extra_state": np.float64(0.25)}


def metadata() -> dict[str, Any]:
    return {
        "best_metric": np.float64(0.913), "epoch": np.int64(7), "table": np.arange(6.0).reshape(2, 3),
        "dtype": np.dtype("float16"), "args": argparse.Namespace(lr=0.1, name="run"),
        "saved_at": datetime.datetime(2024, 5, 1, 12, 30, tzinfo=datetime.UTC),
        "day": datetime.date(2024, 5, 1), "elapsed": datetime.timedelta(seconds=90),
        "root": pathlib.PurePosixPath("/data/run"), "path": pathlib.Path("/tmp/x"),
        "groups": defaultdict(list, {"a": [1]}), "counts": Counter("abca"), "recent": deque([1, 2], maxlen=4),
        "ordered": OrderedDict(a=1), "z": complex(1, 2), "window": slice(1, 5, 2),
        "tags": {"x", "y"}, "frozen": frozenset({1}),
    }


def lightning_checkpoint(path: Path, *, legacy: bool = False, protocol: int = 2) -> dict[str, Any]:
    sd = state_dict()
    with stand_in("lightning.fabric.utilities.data", "AttributeDict", dict) as attribute_dict:
        hparams = attribute_dict(lr=0.1, layers=[4, 3], optimizer="adam")
        ckpt = {"state_dict": sd, "hyper_parameters": hparams, "epoch": 3, **metadata()}
        torch.save(ckpt, path, pickle_protocol=protocol, _use_new_zipfile_serialization=not legacy)
    return sd


def tensors_of(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize(("legacy", "protocol"), [(False, 2), (False, 4), (True, 2)],
                         ids=["zip-p2", "zip-p4", "legacy"])
def test_training_checkpoint_with_plain_data_converts_bit_exact(tmp_path: Path, legacy: bool, protocol: int) -> None:
    src = tmp_path / "last.ckpt"
    saved = tensors_of(lightning_checkpoint(src, legacy=legacy, protocol=protocol))
    modules = set(sys.modules)
    contents = read_checkpoint(src, key="state_dict")
    assert set(sys.modules) == modules  # nothing imported
    assert [r.name for r in contents.tensors] == list(saved)
    assert contents.skipped == ("norm._extra_state",)
    note = " ".join(contents.notes)
    for shown in ("hyper_parameters (lightning.fabric.utilities.data.AttributeDict)", "args (argparse.Namespace)",
                  "best_metric (numpy._core.multiarray.scalar)", "state_dict.norm._extra_state"):
        assert shown in note
    out = tmp_path / "out"
    result = convert(src, out, WeightsConfig(key="state_dict"))
    assert any("inert placeholders" in n for n in result.notes)
    found = validate_output(out)
    assert set(found) == set(saved)
    for name, t in saved.items():
        assert found[name]["bytes"] == tensor_bytes(t)


def test_inspect_lists_placeholders_with_their_paths(tmp_path: Path) -> None:
    src = tmp_path / "last.ckpt"
    lightning_checkpoint(src)
    report = inspect_checkpoint(src)
    shown = {p["name"]: p["type"] for p in report["placeholders"]}  # type: ignore[index, union-attr]
    assert shown["hyper_parameters"] == "lightning.fabric.utilities.data.AttributeDict"
    assert shown["state_dict.norm._extra_state"] == "numpy._core.multiarray.scalar"
    assert shown["table"] == "numpy._core.multiarray._reconstruct"
    assert shown["saved_at"] == "datetime.datetime"
    assert shown["recent"] == "collections.deque"
    assert shown["window"] == "builtins.slice"
    tensors = {t["name"] for t in report["tensors"]}  # type: ignore[index, union-attr]
    assert tensors == {"state_dict.layer.weight", "state_dict.layer.bias"}


def test_cli_convert_and_inspect_exit_0_with_notes(tmp_path: Path) -> None:
    src = tmp_path / "last.ckpt"
    lightning_checkpoint(src)
    run = subprocess.run([sys.executable, "-m", "packer", "convert", str(src), "-o", str(tmp_path / "o"),
                          "--key", "state_dict", "--json"], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    notes = json.loads(run.stdout)["notes"]
    assert any("hyper_parameters (lightning.fabric.utilities.data.AttributeDict)" in n for n in notes)
    run = subprocess.run([sys.executable, "-m", "packer", "inspect", str(src)], capture_output=True, text=True,
                         check=False)
    assert run.returncode == 0, run.stderr
    assert "(placeholder) args  argparse.Namespace" in run.stderr + run.stdout


def test_a_placeholder_is_listed_once(tmp_path: Path) -> None:
    """A top-level placeholder is one line of inspect and one note of convert, not also a
    "non-tensor entry" beside it (a new user read it as two things)."""
    src = tmp_path / "last.ckpt"
    lightning_checkpoint(src)
    run = subprocess.run([sys.executable, "-m", "packer", "inspect", str(src)], capture_output=True, text=True,
                         check=False)
    assert run.returncode == 0, run.stderr
    lines = (run.stdout + run.stderr).splitlines()
    assert [ln for ln in lines if ln.split()[-2:] == ["args", "argparse.Namespace"]] == \
        ["  (placeholder) args  argparse.Namespace"]
    assert not [ln for ln in lines if ln.strip() == "(not a tensor) args"]
    run = subprocess.run([sys.executable, "-m", "packer", "convert", str(src), "-o", str(tmp_path / "o"),
                          "--key", "state_dict", "--json"], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    notes = json.loads(run.stdout)["notes"]
    named = [n for n in notes if "_extra_state" in n]
    assert len(named) == 1 and "placeholders" in named[0], notes


def user_config_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    sd = tensors_of(state_dict())
    with stand_in("mytrainer.config", "TrainConfig") as cfg_cls:
        cfg = cfg_cls()
        cfg.lr = 0.5
        torch.save({"state_dict": sd, "config": cfg}, path)
    return sd


def test_user_class_is_refused_with_the_way_to_allow_it(tmp_path: Path) -> None:
    src = tmp_path / "c.pt"
    user_config_checkpoint(src)
    with pytest.raises(UnsafeInputError) as e:
        read_checkpoint(src, key="state_dict")
    message = str(e.value)
    assert "global mytrainer.config.TrainConfig is not allowed" in message
    assert "--allow-global mytrainer.config.TrainConfig" in message and "weights.allow_globals" in message
    run = subprocess.run([sys.executable, "-m", "packer", "convert", str(src), "-o", str(tmp_path / "o"),
                          "--key", "state_dict"], capture_output=True, text=True, check=False)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "--allow-global mytrainer.config.TrainConfig" in run.stderr


@pytest.mark.parametrize("pattern", ["mytrainer.config.TrainConfig", "mytrainer.*"])
def test_allow_global_reads_a_user_class_as_a_placeholder(tmp_path: Path, pattern: str) -> None:
    src = tmp_path / "c.pt"
    saved = user_config_checkpoint(src)
    contents = read_checkpoint(src, key="state_dict", allow_globals=[pattern])
    assert {r.name for r in contents.tensors} == set(saved)
    assert any("config (mytrainer.config.TrainConfig)" in n for n in contents.notes)
    run = subprocess.run([sys.executable, "-m", "packer", "convert", str(src), "-o", str(tmp_path / "o"),
                          "--key", "state_dict", "--allow-global", pattern], capture_output=True, text=True,
                         check=False)
    assert run.returncode == 0, run.stderr
    found = validate_output(tmp_path / "o")
    assert {n: f["bytes"] for n, f in found.items()} == {n: tensor_bytes(t) for n, t in saved.items()}


def test_allow_global_in_recipe_and_build_flag(tmp_path: Path) -> None:
    from packer.errors import RecipeError
    from packer.recipe import recipe_from_dict, with_allowed_globals

    rec = recipe_from_dict({"name": "n", "version": "1", "source": "x",
                            "weights": {"allow_globals": ["mytrainer.config.*"]}})
    assert rec.weights.allow_globals == ("mytrainer.config.*",)
    assert with_allowed_globals(rec, ["a.B"]).weights.allow_globals == ("mytrainer.config.*", "a.B")
    with pytest.raises(RecipeError, match="weights.allow_globals: expected 'module.Name' patterns"):
        recipe_from_dict({"name": "n", "version": "1", "source": "x", "weights": {"allow_globals": ["nodot"]}})
    (tmp_path / "m.pt").write_bytes(b"")
    run = subprocess.run([sys.executable, "-m", "packer", "convert", str(tmp_path / "m.pt"), "-o", str(tmp_path / "o"),
                          "--allow-global", "nodot"], capture_output=True, text=True, check=False)
    assert run.returncode == 1 and "--allow-global: expected 'module.Name' patterns" in run.stderr


def test_tensor_with_python_attributes_is_kept_and_attributes_reported(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    w, p = torch.randn(2, 3, generator=g), torch.nn.Parameter(torch.randn(4, generator=g))
    w.note = "calibrated"  # type: ignore[attr-defined]
    p.scale = 2.0  # type: ignore[attr-defined]
    src = tmp_path / "attrs.pt"
    torch.save({"w": w, "p": p, "plain": torch.ones(2)}, src)
    assert b"_rebuild_from_type_v2" in src.read_bytes()
    oracle = torch.load(src, weights_only=True)
    contents = read_checkpoint(src)
    assert {r.name for r in contents.tensors} == {"w", "p", "plain"}
    assert any("w (note)" in n and "p (scale)" in n for n in contents.notes)
    out = tmp_path / "out"
    convert(src, out, WeightsConfig())
    found = validate_output(out)
    for name in ("w", "p", "plain"):
        assert found[name]["bytes"] == tensor_bytes(oracle[name].detach())
    dropped = {t["name"]: t.get("dropped_attributes") for t in inspect_checkpoint(src)["tensors"]}  # type: ignore[index, union-attr]
    assert dropped == {"w": ["note"], "p": ["scale"], "plain": None}


def test_an_allowed_global_is_never_called(tmp_path: Path) -> None:
    # Even a dangerous name, once the user allows it, is only a placeholder: never called.
    canary = tmp_path / "canary"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[object, ...]]:
            import os

            return os.system, (f"touch {canary}",)

    data = pickle.dumps({"w": Evil(), "ns": argparse.Namespace(x=Evil())}, protocol=2)
    modules = set(sys.modules)
    value, _ = run_pickle(data, where="x: data.pkl", policy=policy_for(["posix.system", "nt.system"]))
    assert isinstance(value, dict) and isinstance(value["w"], Placeholder)
    assert value["w"].type.qualname.endswith(".system")
    assert not canary.exists()
    assert set(sys.modules) == modules


class _Touch:
    """Pickles as ``os.system("touch <canary>")``: what an attacker's __reduce__ returns."""

    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        import os

        return os.system, (f"touch {self.canary}",)


def test_cli_allowing_a_dangerous_global_still_runs_nothing(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    w = torch.arange(6.0)
    torch.save({"w": w, "hook": _Touch(canary)}, tmp_path / "evil.pt")
    refused = subprocess.run([sys.executable, "-m", "packer", "convert", str(tmp_path / "evil.pt"), "-o",
                              str(tmp_path / "o1")], capture_output=True, text=True, check=False)
    assert refused.returncode == 1 and "global posix.system is not allowed" in refused.stderr
    run = subprocess.run([sys.executable, "-m", "packer", "convert", str(tmp_path / "evil.pt"), "-o",
                          str(tmp_path / "o2"), "--allow-global", "posix.*", "--json"],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    assert not canary.exists()
    assert any("hook (posix.system)" in n for n in json.loads(run.stdout)["notes"])
    assert validate_output(tmp_path / "o2")["w"]["bytes"] == tensor_bytes(w)


@pytest.mark.parametrize("protocol", range(6))
def test_plain_data_reads_at_every_protocol(protocol: int) -> None:
    obj = {"ns": argparse.Namespace(a=1), "when": datetime.datetime(2020, 1, 1), "counts": Counter("ab"),
           "recent": deque([1]), "path": pathlib.PurePosixPath("/a"), "x": np.float32(1),
           "arr": np.arange(3)}
    value, _ = run_pickle(pickle.dumps(obj, protocol=protocol), where="x: data.pkl")
    assert isinstance(value, dict) and set(value) == set(obj)
    assert all(type(v).__name__.startswith("Placeholder") for v in value.values())


@pytest.mark.parametrize("payload", ["posix.system", "subprocess.Popen", "builtins.eval", "runpy._run_code"])
def test_a_dangerous_global_is_named_dangerous_and_no_flag_is_offered(tmp_path: Path, payload: str) -> None:
    module, name = payload.rsplit(".", 1)
    data = b"\x80\x02}q\x00X\x01\x00\x00\x00wq\x01c" + f"{module}\n{name}\n".encode() + b"q\x02s."
    with zipfile.ZipFile(tmp_path / "evil.pt", "w") as zf:
        zf.writestr("evil/data.pkl", data)
        zf.writestr("evil/version", "3\n")
    proc = subprocess.run([sys.executable, "-m", "packer", "convert", str(tmp_path / "evil.pt"), "-o",
                           str(tmp_path / "o")], capture_output=True, text=True, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert f"{payload} runs commands or code when called" in lines[0]
    assert "--allow-global" not in lines[0] and "docs/troubleshooting.md#checkpoints" in lines[0]
    assert not (tmp_path / "o").exists()


def _one_global(module: str, name: str) -> bytes:
    return b"\x80\x02}q\x00X\x01\x00\x00\x00wq\x01c" + f"{module}\n{name}\n".encode() + b"q\x02s."


@pytest.mark.parametrize("policy", ["plain", "placeholders"])
def test_a_payload_is_its_own_kind_of_refusal(tmp_path: Path, policy: str) -> None:
    """Callers tell a payload from a global that may be allowed by its class, never by its text:
    as the main pickle, and as the first pickle of a legacy file (which gets no re-save advice)."""
    from packer.checkpoint.legacy import load_legacy

    pol = policy_for(("x.*",) if policy == "placeholders" else ())
    with pytest.raises(PayloadError):
        run_pickle(_one_global("posix", "system"), where="x: data.pkl", policy=pol)
    with pytest.raises(DisallowedGlobalError) as e:
        run_pickle(_one_global("mylib", "Config"), where="x: data.pkl", policy=pol)
    assert not isinstance(e.value, PayloadError)
    data = b"\x80\x02cposix\nsystem\nq\x00."  # a legacy file whose magic-number pickle is a payload
    with pytest.raises(PayloadError) as p:
        load_legacy(io.BytesIO(data), tmp_path / "evil.bin", len(data))
    assert "pickle.dump" not in str(p.value) and "runs commands or code when called" in str(p.value)
