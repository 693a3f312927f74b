"""The runtime's one way in (packer/runtime/reading.py) and every runtime reader behind it.

Each reader the loader and the vLLM adapter have (``model.sig``, a runtime file, the files the
embedded manifest names, the bundle, the adapter's discovery and its anchor) gets a FIFO, a
link to ``/dev/zero`` and deep JSON where it reads JSON: each is one ``ArtifactMismatchError``
(or the loader's one line, exit 1) naming the absolute path and the reason, never a hang, a
``MemoryError`` or a ``RecursionError``. Every test runs under a timeout: a FIFO opened for
reading without ``O_NONBLOCK`` would block forever (an alarm fails such a test instead).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from packer.adapters import vllm_format as vf
from packer.runtime import reading
from packer.runtime.env import ArtifactMismatchError
from packer.runtime.loading import Loader
from packer.runtime.settings import RuntimeSettings
from packer.runtime.signature import require_signature
from packer.runtime.timeline import Timeline
from packer.stub import RUNTIME_DIR
from tests.loader_fixtures import make_out
from tests.sign_fixtures import make_keypair

DEEP = b"[" * 100_000 + b"]" * 100_000
KINDS = ["fifo", "zero", "deep"]
REASONS = {"fifo": "a FIFO; expected a regular file", "zero": "a character device; expected a regular file",
           "deep": "nested deeper than 64 levels"}


@pytest.fixture(autouse=True)
def no_hang() -> Iterator[None]:
    """Fail a test that blocks (on a FIFO) instead of hanging the suite."""
    def fail(signum: int, frame: object) -> None:
        raise TimeoutError("blocked for 120 s: a FIFO was opened for reading without O_NONBLOCK")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(120)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def plant(path: Path, kind: str) -> Path:
    """Replace ``path`` by a FIFO, a link to /dev/zero or a deep JSON document."""
    if path.is_symlink() or path.exists():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        os.symlink("/dev/zero", path)
    else:
        path.write_bytes(DEEP)
    return path


@pytest.fixture()
def out(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    d = tmp_path / "out"
    return d, make_out(d)


def loader(out: Path, m: dict[str, Any], tmp: Path, **settings: Any) -> Loader:
    return Loader(m, out, timeline=Timeline(), settings=RuntimeSettings(bundle_cache=str(tmp / "cache"), **settings))


@pytest.mark.parametrize("kind", KINDS)
def test_reading_module_refuses_by_type_cap_and_depth(tmp_path: Path, kind: str) -> None:
    p = plant(tmp_path / "doc.json", kind)
    with pytest.raises(ArtifactMismatchError, match=f"^{p}: .*{REASONS[kind]}"):
        reading.read_json(p)
    big = tmp_path / "big.pem"
    big.write_bytes(b"x" * (reading.CAPS["key"] + 1))
    with pytest.raises(ArtifactMismatchError, match=f"^{big}: 65537 bytes, over the cap of 65536 for a key file"):
        reading.read_bytes(big, "key")
    with pytest.raises(ArtifactMismatchError, match="expected a JSON object, got list"):
        reading.loads_json(b"[1]", "x")
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    with pytest.raises(ArtifactMismatchError, match=f"^{loop}: cannot be opened"):
        reading.read_bytes(loop, "json")


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../b", "a//b", "./a", "a\\b", "a\nb", "", 3, "a/."])
def test_names_from_documents_are_checked_before_they_are_joined(tmp_path: Path, name: object) -> None:
    with pytest.raises(ArtifactMismatchError, match="is not a (plain )?relative path"):
        reading.inside(tmp_path, name, "doc.json: files")
    os.symlink("/etc", tmp_path / "out")
    with pytest.raises(ArtifactMismatchError, match="leads outside"):
        reading.inside(tmp_path, "out/passwd", "doc.json: files")
    assert reading.inside(tmp_path, "a/b.json", "doc.json") == tmp_path / "a" / "b.json"


@pytest.mark.parametrize("kind", KINDS)
def test_model_sig_in_the_loader(out: tuple[Path, dict[str, Any]], tmp_path: Path, kind: str) -> None:
    d, m = out
    _, pub = make_keypair(tmp_path / "keys")
    sig = plant(d / "model.sig", kind)
    with pytest.raises(ArtifactMismatchError, match=f"^{sig}: .*{REASONS[kind]}"):
        require_signature(d, str(pub), manifest=m)
    key = plant(tmp_path / "key.pub", kind)
    with pytest.raises(ArtifactMismatchError, match=f"PACKER_REQUIRE_SIGNATURE={key}: cannot read the public key"):
        require_signature(d, str(key), manifest=m)


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_runtime_file(out: tuple[Path, dict[str, Any]], kind: str) -> None:
    d, _ = out
    ring = plant(d / RUNTIME_DIR / "ring.py", kind)
    r = subprocess.run([sys.executable, str(d / "packer_loader.py"), "--selftest", "--device", "cpu"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PACKER_STARTUP_LOG": "off"})
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"packer_loader: {ring}: not a regular file;"), r.stderr


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", ["shard", "index"])
def test_the_files_the_embedded_manifest_names(out: tuple[Path, dict[str, Any]], tmp_path: Path, kind: str,
                                                which: str) -> None:
    d, m = out
    rel = m["weights"]["files"][0] if which == "shard" else m["weights"]["index"]
    if kind == "deep" and which == "shard":  # a safetensors header nested deeply, of the manifest's length
        data = bytearray((d / rel).read_bytes())
        n = int.from_bytes(data[:8], "little")
        data[8: 8 + n] = (b"[" * (n // 2) + b"]" * (n // 2)).ljust(n)
        (d / rel).write_bytes(bytes(data))
        named = d / rel if which == "shard" else rel  # a weight file by its absolute path
        with pytest.raises(ArtifactMismatchError, match=f"^{named}: safetensors header: arrays and objects nested"):
            loader(d, m, tmp_path).load_weights("cpu")
        return
    if kind == "deep":
        return  # the index is checked by size and sha256, never parsed by the loader
    plant(d / rel, kind)
    with pytest.raises(ArtifactMismatchError, match=f"^{d / rel}: {REASONS[kind]}"):
        loader(d, m, tmp_path).load_weights("cpu", verify=True)


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_the_bundle(out: tuple[Path, dict[str, Any]], tmp_path: Path, kind: str) -> None:
    d, m = out
    plant(d / "bundle.tar.zst", kind)
    with pytest.raises(ArtifactMismatchError, match=f"^{d / 'bundle.tar.zst'}: {REASONS[kind]}"):
        loader(d, m, tmp_path).bundle_dir()


@pytest.mark.parametrize("signed", [False, True])
def test_a_shared_bundle_cache_with_a_changed_config_is_refused(out: tuple[Path, dict[str, Any]], tmp_path: Path,
                                                                 signed: bool) -> None:
    d, m = out
    extra = {"require_signature": "unused"} if signed else {}  # the check itself needs no key
    folder = loader(d, m, tmp_path).bundle_dir()
    config = folder / "config.json"
    os.chmod(config, 0o644)
    config.write_bytes(b'{"b":2}' if signed else b'{"b":22}')  # same size: only sha256 tells (signed)
    if not signed:
        with pytest.raises(ArtifactMismatchError, match=f"^{config}: 8 bytes; the manifest pins 7 bytes.*"
                                                        "changed after extraction: remove"):
            loader(d, m, tmp_path, **extra).bundle_dir()
        config.write_bytes(b'{"b":2}')
        assert loader(d, m, tmp_path).bundle_dir() == folder  # sizes only without a signature requirement
        return
    with pytest.raises(ArtifactMismatchError, match=f"^{config}: 7 bytes, sha256 .*changed after extraction"):
        loader(d, m, tmp_path, **extra).bundle_dir()
    config.unlink()
    os.symlink(d / "manifest.json", config)
    with pytest.raises(ArtifactMismatchError, match=f"^{config}: not a regular file"):
        loader(d, m, tmp_path, **extra).bundle_dir()
    config.unlink()
    (folder / "config.json").write_bytes(b'{"a":1}')
    (folder / "chat_template.jinja").write_text("{{ evil }}")
    with pytest.raises(ArtifactMismatchError, match="chat_template.jinja: not a member of this build's bundle"):
        loader(d, m, tmp_path, **extra).bundle_dir()


def test_a_reused_model_dir_with_a_changed_link_is_refused(out: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    from packer.runtime.hf import hf_model_dir

    d, m = out
    made = hf_model_dir(loader(d, m, tmp_path))
    assert hf_model_dir(loader(d, m, tmp_path)) == made
    (made / "config.json").unlink()
    (made / "config.json").write_text('{"evil": 1}')
    with pytest.raises(ArtifactMismatchError, match=f"^{made / 'config.json'}: not the link to .* it was made as"):
        hf_model_dir(loader(d, m, tmp_path))


# --- the vLLM adapter's discovery --------------------------------------------------------------

def test_adapter_discovery_a_weight_link_loop_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PACKER_ARTIFACTS", raising=False)
    link = tmp_path / "model.safetensors"
    os.symlink(link, link)
    with pytest.raises(ArtifactMismatchError, match=f"^{link}: "):
        vf.find_loader(tmp_path)


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_adapter_discovery_a_loader_that_is_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    kind: str) -> None:
    monkeypatch.delenv("PACKER_ARTIFACTS", raising=False)
    stub = plant(tmp_path / "packer_loader.py", kind)
    with pytest.raises(ArtifactMismatchError, match=f"^{stub}: {REASONS[kind]}"):
        vf.find_loader(tmp_path)
    monkeypatch.setenv("PACKER_ARTIFACTS", str(tmp_path))
    with pytest.raises(ArtifactMismatchError, match=f"^{stub}: {REASONS[kind]}"):
        vf.find_loader(tmp_path / "elsewhere")


@pytest.mark.parametrize("kind", KINDS)
def test_adapter_anchor_the_manifest_beside_the_stub(out: tuple[Path, dict[str, Any]], kind: str) -> None:
    d, _ = out
    manifest = plant(d / "manifest.json", kind)
    sys.modules.pop("packer_loader", None)
    with pytest.raises(ArtifactMismatchError, match=f"^{manifest}: .*{REASONS[kind]}"):
        vf.import_loader(d / "packer_loader.py")
    assert "packer_loader" not in sys.modules


def test_an_explicit_packer_artifacts_without_a_build_is_an_error(out: tuple[Path, dict[str, Any]], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    d, _ = out
    model = tmp_path / "model"
    model.mkdir()
    os.symlink(d / "weights" / "model-00001-of-00002.safetensors", model / "model-00001-of-00002.safetensors")
    assert vf.find_loader(model) == d / "packer_loader.py"  # through the weight links
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PACKER_ARTIFACTS", str(empty))
    with pytest.raises(vf.EngineAdapterError, match=f"{empty} holds no build .*PACKER_ARTIFACTS names it"):
        vf.find_loader(model)
    r = subprocess.run([sys.executable, str(d / "packer_loader.py"), "--selftest", "--device", "cpu"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PACKER_ARTIFACTS": str(tmp_path / "nothing"), "PACKER_STARTUP_LOG": "off"})
    assert r.returncode == 1 and f"{tmp_path / 'nothing'}: not a directory, and PACKER_ARTIFACTS" in r.stderr, r.stderr


def test_json_depth_is_checked_before_the_parser(tmp_path: Path) -> None:
    doc = tmp_path / "ok.json"
    doc.write_text(json.dumps({"a": [[[{"b": "[[[[[[[["}]]]}))  # brackets in strings do not count
    assert reading.read_json(doc)["a"][0][0][0]["b"] == "[[[[[[[["
    shutil.copyfile(doc, tmp_path / "copy.json")
    with pytest.raises(ArtifactMismatchError, match="nested deeper than 2 levels"):
        reading.loads_json(doc.read_bytes(), str(doc), max_depth=2)


@pytest.mark.parametrize("rel", ["../x.safetensors", "/etc/passwd", "weights/../../x.safetensors"])
def test_a_manifest_path_outside_the_root_is_refused_before_it_is_joined(out: tuple[Path, dict[str, Any]],
                                                                         tmp_path: Path, rel: str) -> None:
    d, m = out
    first = m["weights"]["files"][0]
    m = {**m, "weights": {**m["weights"], "files": [rel, *m["weights"]["files"][1:]]},
         "files": {**m["files"], rel: m["files"][first]}}
    with pytest.raises(ArtifactMismatchError, match=f"the manifest's files: '{rel}' is not a"):
        loader(d, m, tmp_path).load_weights("cpu")
