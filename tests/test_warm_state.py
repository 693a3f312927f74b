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
from packer.verifying import verify
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


def without_vllm(tmp: Path, body: str = "raise ModuleNotFoundError(\"No module named 'vllm'\", name='vllm')") -> Path:
    """An interpreter that cannot import vllm: this one, with a ``vllm`` on its path that is not there
    (``body``: what that ``vllm`` runs instead)."""
    hide = tmp / "no-vllm" / "vllm"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text(body + "\n")
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


def test_a_vllm_that_fails_is_not_called_absent(tmp_path: Path) -> None:
    """The probe's exit status tells an interpreter without vllm from a vLLM whose start fails:
    the words "No module named 'vllm'" in what it printed prove nothing."""
    from packer.warm_step import _device_kind

    python = without_vllm(tmp_path, "import sys\nprint(\"plugin skipped: No module named 'vllm'\", file=sys.stderr)\n"
                                    "raise RuntimeError('no platform detected')")
    kind, why = _device_kind(str(python), timeout=60)
    assert (kind, why) == (None, f"{python} could not start vLLM: RuntimeError: no platform detected")


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


# --- packer warm with a stand-in engine: proof first, only inside OUT, all or nothing -------------

ENGINE = """
import json, os, sys
from pathlib import Path

if os.environ.get("STAND_IN_FAIL"):
    sys.exit("RuntimeError: the stand-in engine failed")
if os.environ.get("STAND_IN_SLEEP"):
    import time

    Path(os.environ["STAND_IN_SLEEP"]).write_text("started")
    time.sleep(120)
root = Path(os.environ["VLLM_CACHE_ROOT"]) / "modelinfos"
root.mkdir(parents=True, exist_ok=True)
(root / "llama.json").write_text(os.environ.get("STAND_IN_CACHE", "1"))
Path(os.environ["PACKER_WARM_CAPTURE"]).write_text(json.dumps({**KEY, "model_path": sys.argv[1]}))
print(json.dumps({"ids": [1, 2]}))
"""


def stand_in_engine(tmp: Path) -> tuple[Path, Path]:
    """An engine interpreter that plays vLLM's warm run (cache files, the key for the path it was
    given, token ids) and logs every command it runs: ``(python, log)``; anything else runs as this python."""
    engine, log = tmp / "stand_in_engine.py", tmp / "engine.log"
    engine.write_text(f"KEY = {KEY!r}\n" + ENGINE)
    python = tmp / "python-stand-in"
    python.write_text(f'#!/bin/sh\necho "$*" >> {log}\n'
                      f'if [ "$1" = "-m" ] && [ "$2" = "packer.adapters.vllm_warm_run" ]; '
                      f'then shift 2; exec {sys.executable} {engine} "$@"; fi\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python, log


@pytest.fixture(scope="module")
def a_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("warm-build")
    llama(tmp / "hf", **VLLM_LLAMA)
    build_dir(tmp / "hf", tmp / "out")
    return tmp / "out"


def fresh(a_build: Path, tmp: Path) -> Path:
    """A copy of the module's build (hard links kept, as the build made them)."""
    subprocess.run(["cp", "-a", str(a_build), str(tmp / "out")], check=True)
    return tmp / "out"


def packer_warm(tmp: Path, out: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    python, _ = stand_in_engine(tmp)
    return subprocess.run([sys.executable, "-m", "packer", "warm", str(out), "--python", str(python), *args],
                          capture_output=True, text=True, timeout=300, check=False, cwd=tmp,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PACKER_BUNDLE_CACHE": str(tmp / "bundle"),
                               **env})


def snapshot(out: Path) -> dict[str, Any]:
    """Every path under ``out`` with what it is: a file's bytes, a link's target, a directory."""
    seen: dict[str, Any] = {}
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out).as_posix()
        if path.is_symlink():
            seen[rel] = ("link", os.readlink(path))
        else:
            seen[rel] = ("dir", None) if path.is_dir() else ("file", path.read_bytes())
    return seen


def one_line(r: subprocess.CompletedProcess[str], code: int = 1) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1, (r.returncode, r.stderr)
    return lines[0]


def test_packer_warm_keys_the_state_for_the_path_the_server_is_given(a_build: Path, tmp_path: Path) -> None:
    out = fresh(a_build, tmp_path)
    model = tmp_path / "served"
    model.mkdir()
    r = packer_warm(tmp_path, out, "--model-dir", str(model), "--json", "--", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["model_path"] == str(model) == load_state(out / "warm" / "vllm-cpu-x86_64")["key"]["model_path"]
    assert f"keyed for the model path {model} (serve exactly that path)" in r.stderr
    assert verify(out)["warm_states"] == ["vllm-cpu-x86_64"]


def test_packer_warm_says_each_step_as_it_starts(a_build: Path, tmp_path: Path) -> None:
    """The engine's run takes minutes: a line before each step, so the command never looks hung."""
    out = fresh(a_build, tmp_path)
    r = packer_warm(tmp_path, out, "--", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    steps = [line for line in r.stdout.splitlines() if line.startswith("warm: ")]
    assert steps[0] == f"warm: verifying {out} against its manifest"
    assert steps[1].startswith("warm: running vllm once with ") and "(minutes; at most 1800 s)" in steps[1]
    assert steps[2].startswith("warm: pinning the ")
    assert steps[2].endswith(" files of vllm-cpu-x86_64, making its image")
    assert r.stdout.splitlines()[-1].startswith("warm state vllm-cpu-x86_64: ")
    quiet = packer_warm(tmp_path, out, "-q", "--", "--dtype", "float32")
    assert quiet.returncode == 0 and quiet.stdout == "", quiet.stderr


def test_packer_warm_refuses_a_model_dir_that_does_not_exist(a_build: Path, tmp_path: Path) -> None:
    """A server given DIR would miss a state keyed for ``DIR/model-<hash>``: refused, nothing run."""
    out = fresh(a_build, tmp_path)
    before = snapshot(out)
    r = packer_warm(tmp_path, out, "--model-dir", str(tmp_path / "nope"), "--", "--dtype", "float32")
    line = one_line(r, 2)
    assert line.startswith(f"error: --model-dir {tmp_path / 'nope'}: no such directory;") and "pass an existing" in line
    assert not (tmp_path / "engine.log").exists() and not (tmp_path / "nope").exists()
    assert snapshot(out) == before


@pytest.mark.parametrize("flags", [["--model", "/other"], ["--model=/other"], ["/other", "--dtype", "float32"],
                                   ["--dtype", "float32", "--config", "other.yaml"]])
def test_packer_warm_refuses_engine_flags_that_name_another_model(a_build: Path, tmp_path: Path,
                                                                  flags: list[str]) -> None:
    out = fresh(a_build, tmp_path)
    before = snapshot(out)
    line = one_line(packer_warm(tmp_path, out, "--", *flags), 2)
    assert line.startswith("error: packer warm -- ") and ("may not name the model" in line or "positional" in line)
    assert not (tmp_path / "engine.log").exists() and snapshot(out) == before


def _planted_pyc(out: Path, marker: Path) -> None:
    """A bytecode file Python's import system would take for the stub (its source's mtime and size)."""
    import importlib.util
    from importlib._bootstrap_external import _code_to_timestamp_pyc  # type: ignore[attr-defined]

    stub = out / "packer_loader.py"
    st = stub.stat()
    code = compile(f"open({str(marker)!r}, 'w').close()\n", str(stub), "exec")
    pyc = Path(importlib.util.cache_from_source(str(stub)))
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(bytes(_code_to_timestamp_pyc(code, int(st.st_mtime), st.st_size)))


@pytest.mark.parametrize("tamper", ["stub", "pyc"])
def test_packer_warm_refuses_a_build_that_does_not_verify(a_build: Path, tmp_path: Path, tamper: str) -> None:
    """Nothing of OUT runs and nothing is signed before OUT is proven: a changed stub, a planted pyc."""
    out = fresh(a_build, tmp_path)
    marker = tmp_path / "ran"
    if tamper == "stub":
        with (out / "packer_loader.py").open("a") as f:
            f.write(f"\nopen({str(marker)!r}, 'w').close()\n")
        said = "packer_loader.py: "
    else:
        _planted_pyc(out, marker)
        said = "__pycache__/packer_loader."
    before = snapshot(out)
    line = one_line(packer_warm(tmp_path, out, "--", "--dtype", "float32"))
    assert said in line, line
    assert not marker.exists() and not (tmp_path / "engine.log").exists()
    assert snapshot(out) == before and not (out / "warm").exists()


@pytest.mark.parametrize("link", ["warm", "warm/vllm-cpu-x86_64"])
def test_packer_warm_never_writes_through_a_link(a_build: Path, tmp_path: Path, link: str) -> None:
    out = fresh(a_build, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / link).parent.mkdir(exist_ok=True)
    (out / link).symlink_to(elsewhere)
    line = one_line(packer_warm(tmp_path, out, "--", "--dtype", "float32"))
    assert line.startswith(f"error: packer warm {out}: not warmed, the build does not match its manifest: "
                           f"{out / link}: "), line
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "engine.log").exists()


def test_write_state_refuses_a_link_on_its_way(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "warm").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(WarmStateError, match=r"out/warm: is a symbolic link, not a directory"):
        write_state(tmp_path / "out" / "warm" / "s", name="s", key=KEY, files=collect(_engine_caches(tmp_path)))
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_warming_again_replaces_the_state_and_its_image(a_build: Path, tmp_path: Path) -> None:
    out = fresh(a_build, tmp_path)
    first = packer_warm(tmp_path, out, "--json", "--", "--dtype", "float32", STAND_IN_CACHE="1")
    assert first.returncode == 0, first.stderr
    again = packer_warm(tmp_path, out, "--json", "--", "--dtype", "float32", STAND_IN_CACHE="2")
    assert again.returncode == 0, again.stderr
    old, new = json.loads(first.stdout)["image"], json.loads(again.stdout)["image"]
    assert old["layer_digest"] != new["layer_digest"]
    blobs = out / "image" / "blobs" / "sha256"
    assert not (blobs / old["layer_digest"].removeprefix("sha256:")).exists()
    assert not (blobs / old["manifest_digest"].removeprefix("sha256:")).exists()
    assert verify(out)["warm_states"] == ["vllm-cpu-x86_64"]
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no staging left


@pytest.mark.parametrize("when", ["engine", "publish"])
def test_a_failed_warm_leaves_out_exactly_as_it_was(a_build: Path, tmp_path: Path, when: str) -> None:
    out = fresh(a_build, tmp_path)
    served = tmp_path / "served"  # one model path: the probe below makes the very same layer
    served.mkdir()
    flags = ["--model-dir", str(served), "--json", "--", "--dtype", "float32"]
    assert packer_warm(tmp_path, out, *flags, STAND_IN_CACHE="1").returncode == 0
    env = {"STAND_IN_CACHE": "2"}
    if when == "engine":
        env["STAND_IN_FAIL"] = "1"
    else:  # the new layer's blob name taken by a directory (verify skips empty ones): the image cannot take it
        (tmp_path / "probe").mkdir()
        r = packer_warm(tmp_path / "probe", fresh(a_build, tmp_path / "probe"), *flags, STAND_IN_CACHE="2")
        layer = json.loads(r.stdout)["image"]["layer_digest"].removeprefix("sha256:")
        (out / "image" / "blobs" / "sha256" / layer).mkdir()
    verify(out)
    before = snapshot(out)
    r = packer_warm(tmp_path, out, *flags, **env)
    one_line(r)
    assert snapshot(out) == before
    verify(out)


@pytest.mark.parametrize("what", ["file", "manifest", "signature", "files-dir"])
def test_verify_refuses_a_link_in_a_warm_state(a_build: Path, tmp_path: Path, what: str) -> None:
    """A link to the very bytes pinned, outside OUT, proves nothing: refused like the build's own files."""
    out = fresh(a_build, tmp_path)
    state = out / "warm" / "vllm-cpu-x86_64"
    write_state(state, name=state.name, key=KEY, files=collect(_engine_caches(tmp_path)),
                signer=(lambda st: b"{}") if what == "signature" else None)
    target = {"file": state / "files" / "vllm" / "modelinfos" / "llama.json", "manifest": state / "manifest.json",
              "signature": state / "state.sig", "files-dir": state / "files"}[what]
    outside = tmp_path / "outside"
    shutil.move(target, outside)
    target.symlink_to(outside)
    with pytest.raises(VerifyError, match=f"{target}: is a symbolic link, not a"):
        verify(out)
    with pytest.raises(WarmStateError, match="is a symbolic link"):
        check_state(state)


def test_an_interrupted_warm_leaves_out_exactly_as_it_was(a_build: Path, tmp_path: Path) -> None:
    import signal
    import time

    out = fresh(a_build, tmp_path)
    assert packer_warm(tmp_path, out, "--", "--dtype", "float32", STAND_IN_CACHE="1").returncode == 0
    before = snapshot(out)
    python, _ = stand_in_engine(tmp_path)
    started = tmp_path / "started"
    p = subprocess.Popen([sys.executable, "-m", "packer", "warm", str(out), "--python", str(python), "--",
                          "--dtype", "float32"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(REPO), "PACKER_BUNDLE_CACHE": str(tmp_path / "bundle"),
                              "STAND_IN_CACHE": "2", "STAND_IN_SLEEP": str(started)})
    deadline = time.monotonic() + 120
    while not started.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)  # a cancelled job: unwinds like Ctrl-C
    p.communicate(timeout=60)
    assert p.returncode != 0 and snapshot(out) == before
    verify(out)


def test_renames_are_undone_in_reverse_and_never_replace_a_path(tmp_path: Path) -> None:
    from packer.warm.swap import Renames

    (tmp_path / "a").write_text("new")
    (tmp_path / "index").write_text("old index")
    (tmp_path / "next").write_text("new index")
    (tmp_path / "taken").write_text("someone's")
    journal = Renames()
    journal.mkdir(tmp_path / "d")
    journal.move(tmp_path / "a", tmp_path / "d" / "a")
    journal.replace(tmp_path / "next", tmp_path / "index", tmp_path / "kept")
    assert (tmp_path / "index").read_text() == "new index" and (tmp_path / "kept").read_text() == "old index"
    with pytest.raises(WarmStateError, match="taken: appeared while packer warm was publishing"):
        journal.move(tmp_path / "d" / "a", tmp_path / "taken")
    journal.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "index", "taken"]
    assert (tmp_path / "a").read_text() == "new" and (tmp_path / "index").read_text() == "old index"
