"""vLLM's plugin side of the warm state (packer/adapters/vllm_warm.py) and its trust gate
(packer/adapters/gate.py): a state is consulted only where the operator serves a packer build as
one, used only after proof, and every engine variable it changed is put back on a miss.

The first tests need no vLLM (the decision's first step, the gate's parts). The ones marked
``vllm`` share one ``packer warm`` of a small signed Llama for the image's model directory as a
node mounts it (module-scoped: every vLLM start takes a minute or two here), and start vLLM in
compile mode against it, with empty engine caches.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from packer.adapters import gate, vllm_format, vllm_warm
from packer.errors import EngineAdapterError, WarmStateError
from packer.warm.pins import collect, write_state
from packer.warm.requests import DEFAULT_REQUESTS
from tests.built import build_dir
from tests.hf_fixtures import VLLM_LLAMA, llama
from tests.test_vllm_format import vllm_python
from tests.test_warm_state import KEY, _engine_caches

REPO = Path(__file__).resolve().parents[1]
ARGS = ["--load-format", "packer", "--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "4"]
PROMPTS = [[2, 3, 4, 5, 6], [10, 11], [100, 7, 200, 31, 9, 12, 40]]
LINE = "packer: warm state: "
HIT = LINE + "hit ("
MISS = LINE + "miss ("
_ENGINE_VARS = (*gate.CACHE_ENV.values(), "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", vllm_warm.DECIDED)


# --- the decision and the gate, without vLLM ----------------------------------------------------

@pytest.fixture()
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*_ENGINE_VARS, vllm_warm.SWITCH, vllm_warm.CAPTURE, "PACKER_REQUIRE_SIGNATURE"):
        monkeypatch.delenv(name, raising=False)


def _found(_model: Any, _artifacts: Any = None) -> Path:
    raise AssertionError("a plain serve must not even look for a build")


@pytest.mark.parametrize("load_format", ["auto", "safetensors", "", None])
def test_a_plain_serve_never_looks_at_the_model_directory(clean_env: None, load_format: str | None,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    before = dict(os.environ)
    args = types.SimpleNamespace(model="/models", load_format=load_format, model_loader_extra_config=None)
    assert vllm_warm.before_config(args, _found) is None
    assert dict(os.environ) == before and capsys.readouterr().err == ""


def _state(tmp: Path) -> Path:
    state = tmp / "out" / "warm" / "vllm-cpu-x86_64"
    write_state(state, name=state.name, key=KEY, files=collect(_engine_caches(tmp)))
    return state


def test_a_redirect_puts_back_every_variable_it_changed(clean_env: None, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "own"))
    monkeypatch.setenv("PACKER_WARM_DIR", str(tmp_path))
    state = _state(tmp_path)
    before = dict(os.environ)
    redirect = gate.CacheRedirect(state, gate.open_state(state, state.parent.parent))
    redirect.point()
    assert os.environ["VLLM_CACHE_ROOT"] == str(redirect.dir / "state" / "vllm")
    assert (redirect.dir / "state" / "vllm" / "modelinfos" / "llama.json").is_file()
    redirect.restore()
    assert dict(os.environ) == before and not redirect.dir.exists()


def test_a_hit_gives_an_imported_inductor_the_variables_set_after_its_import(monkeypatch: pytest.MonkeyPatch) -> None:
    # the engine core in the caller's process imported Inductor before the state's variables and
    # vLLM's CPU platform set these; the captured graph's key has the values they give
    import torch._inductor.config as inductor

    monkeypatch.setattr(inductor, "cpp_cache_precompile_headers", True)
    monkeypatch.setattr(inductor.cpp, "dynamic_threads", False)
    monkeypatch.setenv("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")
    monkeypatch.setenv("TORCHINDUCTOR_CPP_DYNAMIC_THREADS", "1")
    vllm_warm.inductor_config_from_env()
    assert inductor.cpp_cache_precompile_headers is False and inductor.cpp.dynamic_threads is True
    monkeypatch.delenv("TORCHINDUCTOR_CPP_DYNAMIC_THREADS")  # unset: left as imported
    monkeypatch.setattr(inductor.cpp, "dynamic_threads", False)
    vllm_warm.inductor_config_from_env()
    assert inductor.cpp.dynamic_threads is False


def test_a_state_naming_an_unknown_root_is_refused(tmp_path: Path) -> None:
    state = _state(tmp_path)
    doc = json.loads((state / "manifest.json").read_bytes())
    doc["roots"].append("PATH")
    (state / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(WarmStateError, match=r"roots: \['PATH'\] are not cache roots packer knows"):
        gate.open_state(state, state.parent.parent)


def test_a_warm_state_is_taken_only_beside_a_build_that_pins_its_stub(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "packer_loader.py").write_text("# any file of this name\n")
    with pytest.raises(EngineAdapterError, match="no manifest.json beside it pins it"):
        gate.anchored_build(d / "packer_loader.py")
    (d / "manifest.json").write_text(json.dumps({"files": {"packer_loader.py": {"sha256": "0" * 64}}}))
    with pytest.raises(EngineAdapterError, match="the loader is not the one this build wrote"):
        gate.anchored_build(d / "packer_loader.py")


def test_a_dangling_weight_link_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "gone" / "model.safetensors")
    with pytest.raises(EngineAdapterError) as e:
        vllm_format.find_loader(tmp_path)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(f"--load-format packer: {tmp_path / 'model.safetensors'} is a link to "
                                   f"{tmp_path / 'gone' / 'model.safetensors'}, which does not exist")


# --- with vLLM ----------------------------------------------------------------------------------

def engine_env(tmp: Path, caches: Path, **more: str) -> dict[str, str]:
    """The serving process's environment: the build's bundle cache, and empty engine caches of its own."""
    return {**os.environ, "PACKER_BUNDLE_CACHE": str(tmp / "bundle"), "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_CACHE_ROOT": str(caches / "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton"),
            "PYTHONPATH": str(REPO), **more}


@pytest.fixture(scope="module")
def warmed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One ``packer warm`` (signed, with its image) of a small signed Llama build, keyed for the
    image's model directory as a node mounts it (``models``, unpacked from the warm image: the
    build's files and the state under ``warm/``), shared by the vLLM tests of this module."""
    from packer.warm_step import warm_output
    from tests.sign_fixtures import image_model_dir, make_keypair

    pytest.importorskip("model_signing")
    py = vllm_python()
    tmp = tmp_path_factory.mktemp("warmed")
    key, pub = make_keypair(tmp / "keys")
    llama(tmp / "hf", **VLLM_LLAMA)
    out = tmp / "out"
    build_dir(tmp / "hf", out, sign={"key": str(key)})
    models = image_model_dir(out, tmp / "models")
    saved = dict(os.environ)
    caches = Path(tempfile.mkdtemp(prefix="caches-", dir=tmp))
    os.environ.update({k: v for k, v in engine_env(tmp, caches).items() if k not in ("VLLM_CACHE_ROOT",
                       "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")})
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # packer warm captures with vLLM's own layout all the same
    try:
        summary = warm_output(out, engine="vllm", engine_args=ARGS, python=str(py), timeout=900, sign_key=key,
                              model_dir=models)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    shutil.rmtree(models)
    image_model_dir(out, models, ref=summary["image"]["tag"])  # the warm image, at the path it was keyed for
    yield {"tmp": tmp, "out": out, "summary": summary, "model_dir": models, "pub": pub}


# vLLM's engine core in the serving process: 20 s less a start on two cores. The starts that use
# no warm state (refused, missed, or not asked for) run so; the starts that take a state run with
# vLLM's default process layout, as a pod has, but one (the logprobs test) in process as well.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def serve(tmp: Path, model_dir: Path, max_len: int = 64, load_format: str = "packer",
          prompts: list[list[int]] = PROMPTS, sampling: dict[str, Any] | None = None,
          **env: str) -> tuple[list[list[int]], str, Path]:
    """Greedy token ids from a fresh vLLM process in compile mode, its whole output, its cache folders."""
    caches = Path(tempfile.mkdtemp(prefix="caches-", dir=tmp))
    args = [str(vllm_python()), str(REPO / "tests" / "vllm_warm_generate.py"), str(model_dir), str(max_len),
            json.dumps(prompts), load_format, json.dumps(sampling or {})]
    r = subprocess.run(args, capture_output=True, text=True, env=engine_env(tmp, caches, **env), timeout=900,
                       check=False)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    lines = [x for x in r.stdout.splitlines() if x.startswith('{"ids": ')]
    assert len(lines) == 1, log[-4000:]
    return json.loads(lines[0])["ids"], log, caches


def _own_compile_cache(caches: Path) -> list[Path]:
    return sorted((caches / "vllm").glob("torch_compile_cache/*"))


@pytest.mark.vllm
def test_packer_warm_captures_a_pinned_keyed_state(warmed: dict[str, Any]) -> None:
    from packer.warm.pins import load_state

    out, summary = warmed["out"], warmed["summary"]
    state = out / "warm" / summary["name"]
    doc = load_state(state)
    files = sorted(doc["files"])
    assert summary["name"] == f"vllm-cpu-{os.uname().machine}" and len(summary["token_ids"]) == 4
    assert any(f.startswith("vllm/modelinfos/") for f in files), files
    assert any(f.startswith("vllm/torch_compile_cache/torch_aot_compile/") and f.endswith("/rank_0_0/model")
               for f in files), files
    assert not any(f.endswith(".lock") for f in files)
    key = doc["key"]
    assert key["model_path"] == str(warmed["model_dir"]) and key["engine_version"].startswith("0.32")
    assert key["engine_args"]["max_model_len"] == 64 and key["config"]["all"]
    assert "VLLM_USE_AOT_COMPILE" in key["env"] or key["env"]
    assert key["state_env"] == {"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0", "TRITON_CACHE_AUTOTUNING": "1"}
    assert key["roots"]["vllm"].startswith("vllm 0.32") and key["roots"]["inductor"].startswith("torch ")
    assert key["requests"] == [dict(r) for r in DEFAULT_REQUESTS] and summary["requests"] == len(DEFAULT_REQUESTS)
    assert summary["signed"] and (state / "state.sig").is_file()
    assert summary["image"]["tag"] == f"m:1-warm-{summary['name']}"
    assert (warmed["model_dir"] / "warm" / summary["name"] / "state.sig").is_file()
    r = subprocess.run([sys.executable, "-m", "packer", "verify", str(out), "--json", "--public-key",
                        str(warmed["pub"])], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["warm_states"] == [summary["name"]]


@pytest.mark.vllm
def test_the_signed_warm_image_starts_under_the_signature_requirement(warmed: dict[str, Any]) -> None:
    tmp, model_dir = warmed["tmp"], warmed["model_dir"]
    # served = signed: the image's model directory with the build's model.sig and the state's state.sig
    got, log, _ = serve(tmp, model_dir, PACKER_REQUIRE_SIGNATURE=str(warmed["pub"]))
    assert log.count(LINE) == 1 and HIT in log, log[-3000:]
    assert "Directly load AOT compilation from path" in log, log[-3000:]
    assert "Compiling model again" not in log and "finalize_loading" not in log
    cold, log, _ = serve(tmp, model_dir, PACKER_WARM="off", **IN_PROCESS)
    assert LINE not in log and "Directly load AOT compilation" not in log, log[-3000:]
    assert got == cold and all(len(ids) == 8 for ids in got)
    # an unsigned state in the served directory: the whole directory is refused before vLLM reads it
    served = tmp / "served-unsigned"
    shutil.copytree(model_dir, served, symlinks=True)
    (served / "warm" / warmed["summary"]["name"] / "state.sig").unlink()
    args = [str(vllm_python()), str(REPO / "tests" / "vllm_warm_generate.py"), str(served), "64", json.dumps(PROMPTS)]
    env = engine_env(tmp, Path(tempfile.mkdtemp(dir=tmp)), PACKER_REQUIRE_SIGNATURE=str(warmed["pub"]))
    r = subprocess.run(args, capture_output=True, text=True, timeout=900, check=False, env=env)
    assert r.returncode != 0 and "state.sig: missing; the state is unsigned" in r.stderr, r.stderr[-3000:]


@pytest.mark.vllm
def test_a_plain_vllm_serve_reads_the_model_directory_as_data(warmed: dict[str, Any]) -> None:
    # the image's model directory holds a loader, a manifest and a warm state keyed for exactly
    # this path: without --load-format packer (or PACKER_WARM) none of it is looked at
    got, log, caches = serve(warmed["tmp"], warmed["model_dir"], load_format="safetensors", **IN_PROCESS)
    assert LINE not in log and "Directly load AOT compilation" not in log, log[-3000:]
    assert _own_compile_cache(caches), "the engine compiled into its own cache"
    assert all(len(ids) == 8 for ids in got)


@pytest.mark.vllm
def test_a_tampered_state_is_refused(warmed: dict[str, Any]) -> None:
    tmp = warmed["tmp"]
    state = tmp / "tampered"
    shutil.copytree(warmed["out"] / "warm" / warmed["summary"]["name"], state)
    model = next(state.rglob("rank_0_0/model"))
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x01
    model.write_bytes(bytes(data))
    got, log, _ = serve(tmp, warmed["model_dir"], PACKER_WARM=str(state), **IN_PROCESS)
    assert log.count(LINE) == 1, log[-3000:]
    assert f"{MISS}refused: {model}: sha256" in log, log[-3000:]
    assert "Directly load AOT compilation" not in log
    assert all(len(ids) == 8 for ids in got)


@pytest.mark.vllm
def test_a_miss_after_the_configuration_puts_the_engine_caches_back(warmed: dict[str, Any]) -> None:
    # the key's first half matches (versions, device, path); vLLM's configuration hash does not:
    # the engine must compile into its own cache, not into the private copy of the state
    got, log, caches = serve(warmed["tmp"], warmed["model_dir"], max_len=48, **IN_PROCESS)
    assert log.count(LINE) == 1, log[-3000:]
    assert f"{MISS}engine argument max_model_len: 48, warmed with 64)" in log, log[-3000:]
    assert _own_compile_cache(caches), "the engine compiled into the state's copy, not its own cache"
    assert all(len(ids) == 8 for ids in got)


@pytest.mark.vllm
def test_an_unsigned_state_is_refused_where_a_signature_is_required(warmed: dict[str, Any]) -> None:
    tmp = warmed["tmp"]
    state = tmp / "unsigned" / "out" / "warm" / warmed["summary"]["name"]
    shutil.copytree(warmed["out"] / "warm" / warmed["summary"]["name"], state)
    (state / "state.sig").unlink()
    got, log, _ = serve(tmp, warmed["model_dir"], PACKER_WARM=str(state),
                        PACKER_REQUIRE_SIGNATURE=str(warmed["pub"]), **IN_PROCESS)
    lines = [x for x in log.splitlines() if x.startswith(LINE)]
    assert lines == [f"{MISS}refused: {state / 'state.sig'}: missing; the state is unsigned (sign it with packer "
                     "warm --sign-key, the key that signed the build))"], log[-3000:]
    assert all(len(ids) == 8 for ids in got)


def compiler_wrappers(tmp: Path) -> tuple[Path, Path]:
    """A folder to put first on PATH whose C and C++ compilers log each command line, then run the
    real one: ``(folder, log)``. Inductor finds its compiler on PATH (``g++``), and its compile
    workers inherit the environment, so every compile a start runs is a line in the log. The real
    compiler runs under the name it was called by: ``g++ -v`` prints it (``COLLECT_GCC``), and
    Inductor keys its ISA probes on that output, so a wrapper that showed its own path would make
    a hit compile the probe it already has."""
    folder, log = tmp / "compilers", tmp / "compilers.log"
    folder.mkdir()
    for name in ("g++", "gcc", "c++", "cc", "clang", "clang++"):
        real = shutil.which(name)
        if real:
            (folder / name).write_text(f'#!/bin/bash\necho "{name} $*" >> {log}\n'
                                       f'PATH="${{PATH//{folder}:/}}" exec -a {name} {real} "$@"\n')
            (folder / name).chmod(0o755)
    return folder, log


def compiles(log: Path) -> list[str]:
    """The compiler runs in ``log`` that compile or link (``-c``/``-o``): not the version probes
    (``g++ --version``, ``-v``) Inductor runs to key its cache, which a hit runs too."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [x for x in lines if {"-c", "-o"} & set(x.split())]


@pytest.fixture()
def short_tmpdir() -> Iterator[Any]:
    """``new(name)``: a new, empty TMPDIR with a short path (vLLM binds ZeroMQ sockets in it, and a
    socket path holds at most 107 bytes: pytest's own folders are too deep); removed afterwards."""
    made: list[str] = []

    def new(name: str) -> Path:
        made.append(tempfile.mkdtemp(prefix=f"pk-{name}-", dir="/tmp"))
        return Path(made[-1])

    yield new
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.vllm
def test_a_hit_compiles_nothing_at_the_first_logprobs_request(warmed: dict[str, Any], tmp_path: Path,
                                                              short_tmpdir: Any) -> None:
    # a fresh pod: empty engine caches (serve), a new TMPDIR, and a log of every compiler run;
    # the first request asks for logprobs, which vLLM's sampler answers with a @torch.compile kernel
    # (batched_count_greater_than) that packer warm's request mix compiled into the state
    folder, log = compiler_wrappers(tmp_path)
    fresh = {"PATH": f"{folder}:{os.environ['PATH']}"}
    one = [PROMPTS[0]]
    tmpdir = short_tmpdir("hit")
    got, out, _ = serve(warmed["tmp"], warmed["model_dir"], prompts=one, sampling={"logprobs": 5},
                        TMPDIR=str(tmpdir), **fresh)
    assert out.count(LINE) == 1 and HIT in out and "Directly load AOT compilation" in out, out[-3000:]
    assert compiles(log) == [], compiles(log)[:5]
    answer = json.loads(next(x for x in out.splitlines() if x.startswith('{"ids": ')))
    assert answer["logprobs"][0] >= 5, answer  # the logprobs path ran
    # the engine core in this process (one process instead of three): Inductor was imported
    # before the state's variables were set, and the hit still loads the captured graph
    tmpdir = short_tmpdir("inproc")
    inproc, out, _ = serve(warmed["tmp"], warmed["model_dir"], prompts=one, sampling={"logprobs": 5},
                           TMPDIR=str(tmpdir), **fresh, **IN_PROCESS)
    assert out.count(LINE) == 1 and HIT in out and "Directly load AOT compilation" in out, out[-3000:]
    assert compiles(log) == [], compiles(log)[:5]
    assert inproc == got
    # the wrapper sees compiles where there are some: the same request, the state switched off
    tmpdir = short_tmpdir("cold")
    cold, out, _ = serve(warmed["tmp"], warmed["model_dir"], prompts=one, sampling={"logprobs": 5},
                         TMPDIR=str(tmpdir), PACKER_WARM="off", **fresh, **IN_PROCESS)
    assert LINE not in out and compiles(log), out[-3000:]
    assert got == cold and len(got[0]) == 8
