"""The engine's warm state: the key (packer/warm/key.py), the pins (packer/warm/pins.py) and
``packer warm`` (packer/warm/capture.py) where no engine is installed.

No vLLM here: how a key names what differs, how a state is pinned, checked, copied and refused,
and that ``packer verify`` checks a state beside a build. The real vLLM runs in
tests/test_vllm_warm.py (the plugin side, packer/adapters/vllm_warm.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from packer.errors import VerifyError, WarmStateError
from packer.verify import verify
from packer.warm.key import BEFORE_CONFIG, difference, explain_config, plain, state_name
from packer.warm.pins import check_state, collect, load_state, verified_copy, verify_states, write_state
from tests.built import build_dir
from tests.hf_fixtures import VLLM_LLAMA, llama

REPO = Path(__file__).resolve().parents[1]
KEY = {"engine": "vllm", "engine_version": "0.32.0", "torch": "2.13.0+cpu", "python": "3.11.7",
       "device": {"kind": "cpu", "arch": "x86_64", "isa": "avx512+avx2"}, "model_path": "/models",
       "env": {"VLLM_USE_AOT_COMPILE": True, "VLLM_PP_LAYER_PARTITION": None},
       "engine_args": {"dtype": "float32", "max_model_len": 64},
       "config": {"all": "85203a3a27", "model_config": "3546", "scheduler_config": "0c97"}}


# --- the key ------------------------------------------------------------------------------------

def test_an_equal_key_has_no_difference() -> None:
    assert difference(KEY, json.loads(json.dumps(KEY))) is None
    assert explain_config(KEY, dict(KEY)) is None


@pytest.mark.parametrize(("change", "said"), [
    ({"engine_version": "0.33.0"}, "engine version: '0.33.0', warmed with '0.32.0'"),
    ({"device": {"kind": "cpu", "arch": "x86_64", "isa": "avx2"}},
     "device isa: 'avx2', warmed with 'avx512+avx2'"),
    ({"model_path": "/srv/model"}, "model path: '/srv/model', warmed with '/models'"),
    ({"env": {"VLLM_USE_AOT_COMPILE": True, "VLLM_PP_LAYER_PARTITION": "4,4"}},
     "environment VLLM_PP_LAYER_PARTITION: '4,4', warmed with None"),
    ({"env": {"VLLM_USE_AOT_COMPILE": True}}, "environment VLLM_PP_LAYER_PARTITION: not set, warmed with None"),
])
def test_the_first_differing_part_is_named(change: dict[str, Any], said: str) -> None:
    why = difference(KEY, {**KEY, **change}, BEFORE_CONFIG)
    assert why is not None and why.startswith(said), why


def test_a_config_difference_is_explained_by_the_engine_argument_that_changed() -> None:
    now = {**KEY, "engine_args": {"dtype": "float32", "max_model_len": 128},
           "config": {**KEY["config"], "all": "ffff", "model_config": "9999"}}
    assert explain_config(KEY, now) == "engine argument max_model_len: 128, warmed with 64"
    more = {**now, "engine_args": {**now["engine_args"], "enable_lora": False}}  # set on one side only: named last
    assert explain_config(KEY, more) == "engine argument max_model_len: 128, warmed with 64"
    same_args = {**KEY, "config": {**KEY["config"], "all": "ffff", "scheduler_config": "1111"}}
    assert explain_config(KEY, same_args) == "engine configuration hash all: 'ffff', warmed with '85203a3a27'"
    # an argument outside vLLM's hash alone is no miss: the configuration hash decides
    assert explain_config(KEY, {**KEY, "engine_args": {**KEY["engine_args"], "disable_log_stats": True}}) is None


def test_state_names_are_plain_directory_names() -> None:
    assert state_name(KEY) == "vllm-cpu-x86_64"
    assert state_name({**KEY, "device": {"kind": "cuda", "arch": "sm90"}}) == "vllm-cuda-sm90"
    for bad in ({"kind": "cpu", "arch": "../x"}, {"kind": "cpu"}, {"kind": "cpu", "arch": "a b"}):
        with pytest.raises(ValueError, match="plain directory name"):
            state_name({**KEY, "device": bad})


def test_plain_values_are_json_and_compare_as_the_values_do() -> None:
    class Mode:
        def __str__(self) -> str:
            return "Mode.COMPILE"

    assert plain({"b": (1, 2), "a": {3, 1}, "m": Mode(), "n": None}) == {"a": [1, 3], "b": [1, 2],
                                                                         "m": "Mode.COMPILE", "n": None}
    assert json.loads(json.dumps(plain({"x": [1.5, True]}))) == {"x": [1.5, True]}


# --- the pins -----------------------------------------------------------------------------------

def _engine_caches(tmp: Path) -> dict[str, Path]:
    root = tmp / "caches"
    aot = root / "vllm" / "torch_compile_cache" / "torch_aot_compile" / "28fc" / "rank_0_0"
    aot.mkdir(parents=True)
    (aot / "model").write_bytes(bytes(range(256)) * 40)
    (aot.parent / "inductor_cache" / "ab").mkdir(parents=True)
    (aot.parent / "inductor_cache" / "ab" / "cab.py").write_text("# generated\n")
    (aot.parent / "inductor_cache" / "locks").mkdir()
    (aot.parent / "inductor_cache" / "locks" / "cab.lock").write_text("")  # not shipped
    (root / "vllm" / "modelinfos").mkdir()
    (root / "vllm" / "modelinfos" / "llama.json").write_text('{"hash": "1"}')
    (root / "vllm" / "model.123.tmp").write_text("half")  # not shipped
    return {"vllm": root / "vllm", "inductor": root / "inductor"}


def _state(tmp: Path) -> Path:
    state = tmp / "out" / "warm" / "vllm-cpu-x86_64"
    write_state(state, name="vllm-cpu-x86_64", key=KEY, files=collect(_engine_caches(tmp)))
    return state


def test_a_state_pins_every_cache_file_under_fixed_relative_paths(tmp_path: Path) -> None:
    state = _state(tmp_path)
    doc = load_state(state)
    assert sorted(doc["files"]) == ["vllm/modelinfos/llama.json", "vllm/torch_compile_cache/torch_aot_compile/28fc/"
                                    "inductor_cache/ab/cab.py", "vllm/torch_compile_cache/torch_aot_compile/28fc/"
                                    "rank_0_0/model"]
    assert doc["roots"] == ["vllm"] and doc["key"] == KEY
    assert check_state(state)[1] == 10240 + 12 + 13
    again = _state(tmp_path / "again")  # the same caches give the same bytes
    assert (again / "manifest.json").read_bytes() == (state / "manifest.json").read_bytes()


def test_verified_copy_holds_exactly_the_pinned_bytes(tmp_path: Path) -> None:
    state = _state(tmp_path)
    doc, n = verified_copy(state, tmp_path / "copy")
    assert n == 10265 and (tmp_path / "copy" / "vllm" / "modelinfos" / "llama.json").read_text() == '{"hash": "1"}'
    assert oct((tmp_path / "copy").stat().st_mode & 0o777) == "0o700"


@pytest.mark.parametrize("tamper", ["flip", "grow", "remove", "unpinned", "stray"])
def test_a_changed_missing_or_unpinned_file_refuses_the_state(tmp_path: Path, tamper: str) -> None:
    state = _state(tmp_path)
    model = state / "files" / "vllm" / "torch_compile_cache" / "torch_aot_compile" / "28fc" / "rank_0_0" / "model"
    if tamper == "flip":
        data = bytearray(model.read_bytes())
        data[100] ^= 1
        model.write_bytes(bytes(data))
        said = f"{model}: sha256 .* differs from the pin"
    elif tamper == "grow":
        model.write_bytes(model.read_bytes() + b"x")
        said = f"{model}: size differs from the pin's 10240 bytes"
    elif tamper == "remove":
        model.unlink()
        said = f"{model}: pinned but unreadable"
    elif tamper == "unpinned":
        (model.parent / "extra.py").write_text("import os\n")
        said = "extra.py: not pinned by"
    else:
        (state / "run.sh").write_text("")
        said = "run.sh: not part of a warm state"
    for check in (lambda: check_state(state), lambda: verified_copy(state, tmp_path / "copy")):
        with pytest.raises(WarmStateError, match=said):
            check()
    assert not (tmp_path / "copy").exists()


@pytest.mark.parametrize("rel", ["../../etc/passwd", "/etc/passwd", "other/x", "vllm"])
def test_a_manifest_path_outside_the_roots_is_refused(tmp_path: Path, rel: str) -> None:
    state = _state(tmp_path)
    doc = json.loads((state / "manifest.json").read_bytes())
    doc["files"][rel] = {"size": 0, "sha256": "0" * 64}
    (state / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(WarmStateError, match="not a relative file name|not under one of the roots"):
        load_state(state)


def test_a_malformed_manifest_names_the_place(tmp_path: Path) -> None:
    state = _state(tmp_path)
    doc = json.loads((state / "manifest.json").read_bytes())
    doc["files"]["vllm/modelinfos/llama.json"]["sha256"] = "xyz"
    (state / "manifest.json").write_text(json.dumps(doc))
    said = r'manifest.json: files\["vllm/modelinfos/llama.json"\].sha256: expected a sha256 .* got the string \'xyz\''
    with pytest.raises(WarmStateError, match=said):
        load_state(state)


def without_vllm(tmp: Path) -> Path:
    """An interpreter that cannot import vllm: this one, with a ``vllm`` on its path that is not there."""
    hide = tmp / "no-vllm" / "vllm"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'vllm\'", name="vllm")\n')
    python = tmp / "python-without-vllm"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={hide.parent}:$PYTHONPATH exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python


def test_packer_warm_without_the_engine_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    llama(tmp_path / "hf", **VLLM_LLAMA)
    build_dir(tmp_path / "hf", tmp_path / "out")
    python = without_vllm(tmp_path)
    r = subprocess.run([sys.executable, "-m", "packer", "warm", str(tmp_path / "out"), "--python", str(python),
                        "--", "--dtype", "float32"], capture_output=True, text=True, timeout=300, check=False,
                       env={**os.environ, "PYTHONPATH": str(REPO), "PACKER_BUNDLE_CACHE": str(tmp_path / "bundle")})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0] == (f"error: {python} cannot import vllm: run packer warm with --python pointing at "
                        "the engine's interpreter (the one vLLM is installed in), or pip install vllm there")


def test_a_warm_table_where_the_engine_is_not_installed_is_a_note(tmp_path: Path) -> None:
    llama(tmp_path / "hf", **VLLM_LLAMA)
    python = without_vllm(tmp_path)
    out = tmp_path / "out"
    result = build_dir(tmp_path / "hf", out, warm={"engine": "vllm", "python": str(python), "device": "cpu"})
    assert result.notes[-1] == (f"[warm] skipped: vLLM is not installed in {python} (warm.python names its "
                                f"interpreter); run packer warm {out} on the machine that has it")
    assert result.warm is None and not (out / "warm").exists()
    assert "warm" in [s["stage"] for s in result.timer.as_json()]


def test_packer_verify_checks_a_warm_state_beside_the_build(tmp_path: Path) -> None:
    llama(tmp_path / "hf", **VLLM_LLAMA)
    out = tmp_path / "out"
    build_dir(tmp_path / "hf", out)
    before = verify(out)
    state = out / "warm" / "vllm-cpu-x86_64"
    write_state(state, name=state.name, key=KEY, files=collect(_engine_caches(tmp_path)))
    summary = verify(out)
    assert summary["warm_states"] == ["vllm-cpu-x86_64"] and summary["files"] == before["files"] + 4
    assert verify_states(out)[1] == 10265
    info = state / "files" / "vllm" / "modelinfos" / "llama.json"
    info.write_text('{"hash": "2"}')
    with pytest.raises(VerifyError, match="llama.json: sha256 .* differs from the pin"):
        verify(out)
    shutil.rmtree(state)
    (out / "warm" / "stray.bin").write_bytes(b"")
    with pytest.raises(VerifyError, match="stray.bin: not listed in the manifest"):
        verify(out)
