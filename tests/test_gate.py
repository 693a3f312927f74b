"""Only verified code runs: the stub and its runtime from checked bytes, never a bytecode file or
a module beside them (packer/adapters/gate.py, packer/stub/template.py).

Each attack is real first (Python's own import runs the planted file, a canary proves it), then
refused or ignored by the path under test; canaries write a file, which must not appear.
"""

from __future__ import annotations

import importlib.util
import marshal
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from packer.runtime.env import ArtifactMismatchError
from packer.runtime.hf import hf_model_dir
from packer.runtime.loading import Loader
from packer.runtime.settings import RuntimeSettings
from packer.runtime.timeline import Timeline
from packer.stub import RUNTIME_DIR
from packer.util.formats import LOADER_NAME
from tests.loader_fixtures import make_out
from tests.sign_fixtures import make_keypair

REPO = Path(__file__).resolve().parents[1]


def env(tmp: Path, **more: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PACKER_STARTUP_LOG": "off",
            "PACKER_BUNDLE_CACHE": str(tmp / "cache"), **more}


def canary_pyc(source: Path, canary: Path) -> Path:
    """A bytecode file Python's import accepts for ``source`` (its mtime and size) that writes ``canary``."""
    code = compile(f"open({str(canary)!r}, 'w').write('ran')\n", str(source), "exec")
    st = source.stat()
    pyc = Path(importlib.util.cache_from_source(str(source)))
    pyc.parent.mkdir(exist_ok=True)
    head = importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little") + int(st.st_mtime).to_bytes(4, "little")
    pyc.write_bytes(head + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little") + marshal.dumps(code))
    return pyc


@pytest.fixture()
def out(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    d = tmp_path / "out"
    return d, make_out(d)


def run(code: str, tmp: Path, **more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp, timeout=180,
                          env=env(tmp, **more))


def test_the_adapter_never_runs_a_bytecode_file_of_the_stub(out: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    d, _ = out
    canary = tmp_path / "canary"
    canary_pyc(d / LOADER_NAME, canary)
    adapter = ("from packer.adapters import vllm_format as vf; "
               f"m = vf.import_loader(vf.find_loader({str(d)!r})); print(len(m.load_weights('cpu')))")
    r = run(adapter, tmp_path)
    assert r.returncode == 0 and int(r.stdout) > 5, r.stderr
    assert not canary.exists()
    r = run(f"import sys; sys.path.insert(0, {str(d)!r}); import packer_loader", tmp_path)  # the attack is real
    assert canary.read_text() == "ran", r.stderr


def test_the_runtime_never_runs_a_bytecode_file_of_its_own(out: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    d, _ = out
    canary = tmp_path / "canary"
    for name in ("loader.py", "loading.py", "reading.py"):
        canary_pyc(d / RUNTIME_DIR / name, canary)
    r = run(f"import sys; sys.path.insert(0, {str(d)!r}); import packer_loader as P; print(len(P.load_weights('cpu')))",
            tmp_path)
    assert r.returncode == 0 and int(r.stdout) > 5, r.stderr
    assert not canary.exists()


@pytest.mark.slow
@pytest.mark.parametrize("shadow", ["zstandard", "torch", "hashlib", "stat", "pathlib", "json", "argparse"])
def test_the_stub_as_a_script_imports_nothing_from_its_folder(out: tuple[Path, dict[str, Any]], tmp_path: Path,
                                                              shadow: str) -> None:
    d, _ = out
    canary = tmp_path / "canary"
    (d / f"{shadow}.py").write_text(f"open({str(canary)!r}, 'w').write('ran')\nraise SystemExit(3)\n")
    r = subprocess.run([sys.executable, str(d / LOADER_NAME), "--selftest", "--device", "cpu", "--verify"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=180, env=env(tmp_path))
    assert r.returncode == 0 and "self-test passed" in r.stderr, r.stderr
    assert not canary.exists()


def test_import_as_the_readme_shows_leaves_out_verifiable(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cli = [sys.executable, "-m", "packer"]
    r = subprocess.run([*cli, "build", "-q", "-o", str(out)], capture_output=True, text=True, timeout=300,
                       env=env(tmp_path))
    assert r.returncode == 0, r.stderr
    r = run(f"import sys; sys.path.insert(0, {str(out)!r}); import packer_loader; print(packer_loader.__cached__)",
            tmp_path)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).parent == out / "__pycache__"  # Python wrote it; the stub removed it
    assert not (out / "__pycache__").exists()
    r = subprocess.run([*cli, "verify", str(out)], capture_output=True, text=True, timeout=300, env=env(tmp_path))
    assert r.returncode == 0, r.stderr
    pyc = canary_pyc(out / LOADER_NAME, tmp_path / "canary")  # a planted one is an extra file to verify
    r = subprocess.run([*cli, "verify", str(out)], capture_output=True, text=True, timeout=300, env=env(tmp_path))
    assert r.returncode == 1 and pyc.relative_to(out).as_posix() in r.stderr, r.stderr


# --- under PACKER_REQUIRE_SIGNATURE ------------------------------------------------------------

@pytest.fixture()
def signed(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A signed build, its public key, and the model directory its loader lays out."""
    from packer.sign.keys import load_signing_key
    from packer.sign.model_sig import write_model_signature

    out = tmp_path / "out"
    manifest = make_out(out)
    key, pub = make_keypair(tmp_path / "keys")
    write_model_signature(out, manifest, load_signing_key(key), name="tiny")
    ld = Loader(manifest, out, timeline=Timeline(), settings=RuntimeSettings(bundle_cache=str(tmp_path / "cache")))
    return out, pub, hf_model_dir(ld)


def test_signed_the_adapter_runs_no_code_of_the_build(signed: tuple[Path, Path, Path], tmp_path: Path) -> None:
    out, pub, d = signed
    canary = tmp_path / "canary"
    stub = out / LOADER_NAME
    stub.write_text(stub.read_text() + f"\nopen({str(canary)!r}, 'w').write('ran')\n")
    (out / RUNTIME_DIR / "loader.py").write_text(f"open({str(canary)!r}, 'w').write('ran')\n")
    code = ("import sys; from packer.adapters import vllm_format as vf; "
            f"p = vf.check_model_dir({str(d)!r}); m = vf.import_loader(p); t = m.load_weights('cpu'); "
            "m.proven_done(); print(len(t), type(m._build).__module__)")  # every name the load format calls
    r = run(code, tmp_path, PACKER_REQUIRE_SIGNATURE=str(pub))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [r.stdout.split()[0], "packer.runtime.loader"] and int(r.stdout.split()[0]) > 5
    assert not canary.exists()


def test_signed_the_served_model_dir_is_the_signed_one(signed: tuple[Path, Path, Path], tmp_path: Path) -> None:
    from packer.adapters.gate import check_served

    out, pub, d = signed
    stub = out / LOADER_NAME
    assert "config.json" in check_served(d, stub, str(pub))
    image = tmp_path / "image"  # an image's model directory: plain files, the loader's own beside them
    shutil.copytree(d, image, symlinks=False)
    for name in (LOADER_NAME, "manifest.json", "bundle.tar.zst"):
        if (out / name).exists():
            shutil.copyfile(out / name, image / name)
    shutil.copytree(out / RUNTIME_DIR, image / RUNTIME_DIR)
    assert check_served(image, stub, str(pub)) == check_served(d, stub, str(pub))
    (image / "chat_template.jinja").write_text("{{ 'not signed' }}")
    with pytest.raises(ArtifactMismatchError, match=f"^{image / 'chat_template.jinja'}: not covered by the build's "
                                                    "signature"):
        check_served(image, stub, str(pub))
    (image / "chat_template.jinja").unlink()
    (image / "config.json").write_bytes(b'{"a":2}')  # same size: the sha256 tells
    with pytest.raises(ArtifactMismatchError, match=f"^{image / 'config.json'}: sha256 .*the signature says"):
        check_served(image, stub, str(pub))
    (image / "config.json").unlink()
    os.mkfifo(image / "config.json")
    with pytest.raises(ArtifactMismatchError, match=f"^{image / 'config.json'}: not a regular file"):
        check_served(image, stub, str(pub))
    from packer.errors import EngineAdapterError

    with pytest.raises(EngineAdapterError, match="under PACKER_REQUIRE_SIGNATURE the tokenizer is the signed"):
        check_served(d, stub, str(pub), tokenizer=str(tmp_path))
    sig = out / "model.sig"
    sig.write_bytes(sig.read_bytes().replace(b'"sig":"', b'"sig":"AA', 1))
    with pytest.raises(ArtifactMismatchError, match="model.sig: "):
        check_served(d, stub, str(pub))
