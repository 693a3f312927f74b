"""``packer verify oci://HOST/REPO@sha256:...``: a pushed build proven chunk by chunk in its
registry (the Debian ``docker-registry``), through the same view the loader streams from, with
nothing of the weights written to disk."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from packer.building import build
from packer.oci.push import push
from packer.recipe import recipe_from_dict, with_sign_key
from tests.built import open_build
from tests.hf_fixtures import llama
from tests.registry_fixtures import blob_file, docker_registry
from tests.sign_fixtures import make_keypair

WEIGHTS = "weights/model.safetensors"
CHUNK = 32 * 1024
pytestmark = pytest.mark.skipif(shutil.which("skopeo") is None, reason="tool: skopeo is not installed")


@pytest.fixture(scope="module")
def pushed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path, dict[str, str]]]:
    """(registry address, its storage, the signing key's public half, {name: digest-pinned ref})."""
    tmp = tmp_path_factory.mktemp("verify-ref")
    llama(tmp / "hf", hidden=64, intermediate=128, layers=2)
    key, pub = make_keypair(tmp / "keys")
    recipe = recipe_from_dict({"name": "m", "version": "1", "source": str(tmp / "hf"),
                               "weights": {"chunk_size": "32KiB"}})
    build(recipe, tmp / "plain", sandbox=False)
    build(with_sign_key(recipe, key), tmp / "signed", sandbox=False)
    with docker_registry(tmp / "registry") as address:
        refs = {}
        for name in ("plain", "signed"):
            where = f"{address}/models/{name}:1"
            refs[name] = f"oci://{address}/models/{name}@{push(tmp / name, where, tls_verify=False)[where]}"
        yield address, tmp / "registry" / "registry-data", pub, refs


def _verify(ref: str, address: str, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "PACKER_REGISTRY_INSECURE": address, "TMPDIR": str(tmp / "tmp"), "HOME": str(tmp)}
    return subprocess.run([sys.executable, "-m", "packer", "verify", ref, *args], capture_output=True, text=True,
                          env=env, check=False, timeout=300)


def test_a_pushed_build_is_proven_in_the_registry(pushed: tuple[str, Path, Path, dict[str, str]],
                                                  tmp_path: Path) -> None:
    address, _, pub, refs = pushed
    r = _verify(refs["plain"], address, tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"of {refs['plain']} proven against its manifest" in r.stdout + r.stderr, r.stdout
    assert not list((tmp_path / "tmp").iterdir())  # the small files' private copy is gone; no weight byte
    signed = _verify(refs["signed"], address, tmp_path, "--public-key", str(pub), "--json")
    assert signed.returncode == 0, signed.stderr
    summary = json.loads(signed.stdout)
    assert summary["signed"] and summary["signature_verified"] and summary["chunks"] > 1, summary
    other, _ = make_keypair(tmp_path / "other")
    wrong = _verify(refs["signed"], address, tmp_path, "--public-key", str(other.with_suffix(".pub")))
    assert wrong.returncode == 1 and "model.sig" in wrong.stderr, wrong.stderr
    unsigned = _verify(refs["plain"], address, tmp_path, "--public-key", str(pub))
    assert unsigned.returncode == 1 and "not signed" in unsigned.stderr, unsigned.stderr


def test_a_flipped_byte_in_the_registry_names_its_chunk(pushed: tuple[str, Path, Path, dict[str, str]],
                                                        tmp_path: Path) -> None:
    _, data, _, refs = pushed
    out = Path(str(data)).parents[1] / "signed"
    entry = json.loads((out / "manifest.json").read_bytes())["files"][WEIGHTS]
    shutil.copytree(data, tmp_path / "registry" / "registry-data")
    blob = blob_file(tmp_path / "registry" / "registry-data", "sha256:" + entry["blob"].rpartition("/")[2])
    raw = bytearray(blob.read_bytes())
    at = entry["size"] // 2
    raw[entry["offset"] + at] ^= 0x01
    blob.write_bytes(raw)
    with docker_registry(tmp_path / "registry") as address:
        ref = refs["signed"].replace(refs["signed"].split("/")[2], address, 1)
        r = _verify(ref, address, tmp_path)
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    fc = open_build(out).chunk_table()[WEIGHTS]  # chunks cut at the tensors and the ranks' splits
    chunk = fc.holding(at)
    a, b = fc.bounds(chunk)
    assert b - a <= CHUNK and f"{WEIGHTS}: chunk {chunk} (bytes [{a}, {b})" in lines[0], r.stderr
    assert "the registry's copy is corrupt or not this build's" in lines[0], r.stderr
    assert not list((tmp_path / "tmp").iterdir())
