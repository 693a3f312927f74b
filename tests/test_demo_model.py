"""``packer demo-model DIR`` (packer/demo.py's write_demo_model): the tutorial's offline source.

A model directory as users have one (a torch.save zip pickle, config.json, a tokenizer that
transformers and vLLM load), written without the hub; `packer build DIR` builds it, and the
``vllm`` test serves that build as docs/tutorial.md does: signed, the signature required,
``--load-format packer``, bound to 127.0.0.1, asked a text prompt through the tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from packer.cli import main
from packer.demo import write_demo

DEMO_FILES = ["config.json", "generation_config.json", "pytorch_model.bin", "special_tokens_map.json",
              "tokenizer.json", "tokenizer_config.json"]


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.iterdir()}


def demo_model(where: Path) -> Path:
    result = CliRunner().invoke(main, ["demo-model", str(where)])
    assert result.exit_code == 0, result.output
    assert f"into {where}" in result.output
    return where


def test_writes_the_demo_source_as_a_model_directory(tmp_path: Path) -> None:
    d = demo_model(tmp_path / "my-model")
    assert sorted(p.name for p in d.iterdir()) == DEMO_FILES  # no temporary folder left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-model"]
    ref = tmp_path / "ref"
    ref.mkdir()
    assert _digests(d) == _digests(write_demo(ref))  # the very bytes `packer build` with no recipe converts
    torch = pytest.importorskip("torch")
    sd = torch.load(d / "pytorch_model.bin", weights_only=True, mmap=True)  # oracle only: torch reads it
    assert sd["model.embed_tokens.weight"].shape == (8192, 512)


def test_the_tokenizer_is_one_transformers_loads(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(demo_model(tmp_path / "m"))
    ids = tok("baba deko")["input_ids"]
    assert len(ids) == 2 and 0 not in ids  # known words, not <unk>
    assert tok.decode(ids, skip_special_tokens=True) == "baba deko"


def test_packer_build_of_the_directory(tmp_path: Path) -> None:
    d = demo_model(tmp_path / "m")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", str(d), "-o", str(out), "--no-sandbox", "-q"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_bytes())
    assert "weights/model.safetensors" in manifest["files"]
    assert CliRunner().invoke(main, ["verify", str(out), "-q"]).exit_code == 0


def test_an_existing_directory_is_refused_and_kept(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "mine.txt").write_text("keep")
    result = CliRunner().invoke(main, ["demo-model", str(d)])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: demo-model: {d} already exists; name a new directory (it is created)"
    assert [p.name for p in d.iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_an_empty_directory_is_filled(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    assert sorted(p.name for p in demo_model(tmp_path / "m").iterdir()) == DEMO_FILES


def test_a_missing_parent_is_named(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["demo-model", str(tmp_path / "a" / "b")])
    assert result.exit_code == 2
    assert f"error: demo-model: {tmp_path / 'a'} does not exist; create it first" in result.output
    assert not (tmp_path / "a").exists()


# --- the tutorial's vLLM step on this build ------------------------------------------------------

@pytest.mark.vllm
def test_vllm_serves_the_signed_demo_build_as_the_tutorial_does(tmp_path: Path) -> None:
    from tests.sign_fixtures import make_keypair
    from tests.test_vllm_format import env, serve_once, vllm_python

    py = vllm_python()
    d = demo_model(tmp_path / "my-model")
    key, pub = make_keypair(tmp_path)
    out = tmp_path / "out"
    built = CliRunner().invoke(main, ["build", str(d), "-o", str(out), "--sign-key", str(key), "-q"])
    assert built.exit_code == 0, built.output
    run_env = {**env(tmp_path), "PACKER_REQUIRE_SIGNATURE": str(pub), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    r = subprocess.run([sys.executable, str(out / "packer_loader.py"), "--model-dir"], capture_output=True,
                       text=True, env=run_env, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    model_dir = r.stdout.strip()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the tutorial's command (its dtype: the config's bfloat16), less the compile a test need not wait for
    args = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--load-format", "packer",
            "--served-model-name", "demo", "--host", "127.0.0.1", "--port", str(port),
            "--enforce-eager", "--max-model-len", "64", "--max-num-seqs", "2"]
    body, text = serve_once(args, run_env, tmp_path / "server.log", port, "demo", "baba deko")
    assert body["usage"]["completion_tokens"] == 4, text[-3000:]
    assert isinstance(body["choices"][0]["text"], str)  # decoded by the demo's tokenizer
    assert f"of {out} loaded through packer_loader.py on cpu" in text
    assert "[startup] verify chunks:" in text  # the required signature forces every chunk's proof
