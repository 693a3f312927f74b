"""OUT holds each weight byte once: the weight layer blob is the weight file's only copy.

The blob is a tar whose member data starts at a page offset; the manifest places the file
there (``blob``, ``offset``), the image's ``/models`` is still a plain model directory (read by
GNU tar, Python's tarfile and umoci here), ``packer verify`` and the loader read the bytes in
place, and one flipped byte of that single copy is refused by ``packer verify``, the loader
(``verify=True``) and ``model_signing verify`` on the unpacked image.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from packer.building import build
from packer.filetree import disk_usage
from packer.recipe import demo_recipe, with_sign_key
from packer.runtime.env import ArtifactMismatchError
from tests.built import open_build, weight_bytes, weight_location
from tests.oci_validate import require_tool
from tests.sign_fixtures import image_model_dir, make_keypair, model_signing_verify

WEIGHTS = "weights/model.safetensors"
PAGE = 4096


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    key, pub = make_keypair(tmp_path_factory.mktemp("keys"))
    return {"key": key, "pub": pub}


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory, keys: dict[str, Path]) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("one") / "out"
    result = build(with_sign_key(demo_recipe(), keys["key"]), out)
    return out, result.summary()


def _manifest(out: Path) -> dict[str, Any]:
    return json.loads((out / "manifest.json").read_bytes())


def test_the_layer_blob_is_the_one_copy_at_a_page_offset(signed: tuple[Path, dict[str, Any]]) -> None:
    out, summary = signed
    entry = _manifest(out)["files"][WEIGHTS]
    # no second copy beside the image: weights/ holds the chunk table alone
    assert [p.name for p in (out / "weights").iterdir()] == ["packer-chunks.json"]
    blob = out / entry["blob"]
    assert entry["blob"].startswith("image/blobs/sha256/") and entry["offset"] % PAGE == 0
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name  # the blob is its layer
    data = weight_bytes(out)
    assert len(data) == entry["size"] and hashlib.sha256(data).hexdigest() == entry["sha256"]
    with tarfile.open(blob) as tf:  # an independent reader finds the file's data at that offset
        (member,) = [m for m in tf.getmembers() if m.isfile()]
        assert (member.name, member.offset_data, member.size) == ("models/model.safetensors", entry["offset"],
                                                                  entry["size"])
    listed = subprocess.run(["tar", "-tvf", str(blob)], capture_output=True, text=True, check=True).stdout
    assert "models/model.safetensors" in listed and str(entry["size"]) in listed
    # OUT on disk: the weights once, plus the rest (bundle, loader, small layers) under 64 MiB
    assert summary["disk_bytes"] == disk_usage(out) <= 1.05 * entry["size"] + 64 * 2**20, summary
    # the bytes verify checked count each file once: not the blob's hard link, not the file inside it
    assert entry["size"] < summary["bytes"] <= summary["disk_bytes"], summary
    assert disk_usage(out) < 2 * entry["size"]


def test_a_build_is_reproducible_with_the_blob(signed: tuple[Path, dict[str, Any]], keys: dict[str, Path],
                                               tmp_path: Path) -> None:
    out, _ = signed
    again = tmp_path / "again"
    build(with_sign_key(demo_recipe(), keys["key"]), again)
    assert (again / "manifest.json").read_bytes() == (out / "manifest.json").read_bytes()
    path, _, _ = weight_location(again, WEIGHTS)
    assert path.read_bytes() == weight_location(out, WEIGHTS)[0].read_bytes()


def test_the_loader_reads_the_file_inside_the_blob(signed: tuple[Path, dict[str, Any]]) -> None:
    out, _ = signed
    loader = open_build(out)
    path, offset = loader.locate(WEIGHTS)
    entry = _manifest(out)["files"][WEIGHTS]
    assert (path, offset) == (out / entry["blob"], entry["offset"])
    from safetensors.torch import load

    want = load(weight_bytes(out))
    for copy in (False, True):
        got = loader.load_weights("cpu", verify=True, copy=copy)
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype and got[name].view(-1).view(dtype=tensor.dtype).equal(
                tensor.view(-1)), name


def test_inspect_reads_the_weight_file_where_the_build_keeps_it(signed: tuple[Path, dict[str, Any]],
                                                                tmp_path: Path) -> None:
    # the manifest's name for the file, not on disk by itself: inspect finds it in its blob
    out, _ = signed
    entry = _manifest(out)["files"][WEIGHTS]
    from safetensors import safe_open

    from tests.test_cli import packer

    alone = tmp_path / "model.safetensors"
    alone.write_bytes(weight_bytes(out))
    with safe_open(str(alone), framework="numpy") as f:
        want = {n: [f.get_slice(n).get_dtype(), list(f.get_slice(n).get_shape())] for n in f.keys()}  # noqa: SIM118
    proc = packer("inspect", str(out / WEIGHTS), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["path"], report["blob"], report["offset"]) == (str(out / WEIGHTS), str(out / entry["blob"]),
                                                                  entry["offset"])
    assert {t["name"]: [t["dtype"], list(t["shape"])] for t in report["tensors"]} == want
    text = packer("inspect", str(out / WEIGHTS))
    assert text.stdout.startswith(f"{out / WEIGHTS} (held in {out / entry['blob']} at offset {entry['offset']}): "
                                  f"safetensors, {len(want)} tensor")
    missing = packer("inspect", str(out / "weights" / "other.safetensors"))
    assert missing.returncode == 1 and "other.safetensors: does not exist" in missing.stderr
    (tmp_path / "manifest.json").write_text('{"name": "another tool\'s"}')  # not a build output
    elsewhere = packer("inspect", str(tmp_path / "weights" / "model.safetensors"))
    assert elsewhere.returncode == 1 and "model.safetensors: does not exist" in elsewhere.stderr


def _flipped(out: Path, tmp_path: Path) -> Path:
    """A copy of the build with one byte of the weight file's one copy flipped (inside a tensor)."""
    bad = tmp_path / "bad"
    subprocess.run(["cp", "-a", str(out), str(bad)], check=True)
    path, offset, size = weight_location(bad, WEIGHTS)
    header = int.from_bytes(weight_bytes(bad)[:8], "little")
    at = offset + 8 + header + (size - 8 - header) // 2  # the middle of the data section
    with path.open("r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
    return bad


def _unpack_models(out: Path, dest: Path) -> Path:
    """The image's ``/models`` as the layers lay it out, read member by member from each layer tar
    in order (regular files and folders only; names checked; never ``extractall``)."""
    blobs = out / "image/blobs/sha256"
    digest = _manifest(out)["image"]["manifest_digest"].removeprefix("sha256:")
    for layer in json.loads((blobs / digest).read_bytes())["layers"]:
        with tarfile.open(blobs / layer["digest"].removeprefix("sha256:"), mode="r|*") as tf:
            for m in tf:
                parts = PurePosixPath(m.name).parts
                assert not PurePosixPath(m.name).is_absolute() and ".." not in parts, m.name
                if parts[:1] != ("models",):
                    continue
                target = dest.joinpath(*parts[1:])
                if m.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                else:
                    assert m.isfile(), m.name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    src = tf.extractfile(m)
                    assert src is not None
                    target.write_bytes(src.read())
    return dest


def test_a_flipped_byte_of_the_one_copy_is_refused_by_each_reader(
    signed: tuple[Path, dict[str, Any]], keys: dict[str, Path], tmp_path: Path
) -> None:
    out, _ = signed
    bad = _flipped(out, tmp_path)
    r = subprocess.run([sys.executable, "-m", "packer", "verify", str(bad)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and "image/blobs/sha256/" in r.stderr and "does not match" in r.stderr, r.stderr
    assert "the weight file it holds at offset 4096 is the manifest's weights/model.safetensors: sha256" in r.stderr
    # and the chunk table says which chunk of the file holds the flipped byte
    chunk = (r"; \S+/image/blobs/sha256/\w+ \(weights/model.safetensors at offset 4096\): chunk \d+ "
             r"\(bytes \[\d+, \d+\) of \d+\) has sha256 \w+\.\.\., weights/packer-chunks.json pins")
    assert re.search(chunk, r.stderr), r.stderr
    with pytest.raises(ArtifactMismatchError, match=r"chunk \d+ \(bytes .*the chunk table pins"):
        open_build(bad).load_weights("cpu", verify=True)
    open_build(out).load_weights("cpu", verify=True)  # the untouched build loads
    # the image's /models: unpacked by umoci, and read layer tar by layer tar (umoci refuses a
    # blob whose digest differs, so the tampered one is read member by member)
    require_tool("umoci")
    plain = image_model_dir(out, tmp_path / "models")
    assert model_signing_verify(plain, keys["pub"]).returncode == 0
    assert model_signing_verify(_unpack_models(out, tmp_path / "read"), keys["pub"]).returncode == 0
    tampered = _unpack_models(bad, tmp_path / "bad-models")
    assert (tampered / "model.safetensors").read_bytes() == weight_bytes(bad) != weight_bytes(out)
    r = model_signing_verify(tampered, keys["pub"])
    assert r.returncode != 0 and "model.safetensors" in r.stdout + r.stderr, r.stdout + r.stderr


def test_model_dir_materializes_the_file_once_and_checks_it(signed: tuple[Path, dict[str, Any]],
                                                           tmp_path: Path) -> None:
    out, _ = signed
    loader = open_build(out)
    loader.settings = loader.settings._replace(bundle_cache=str(tmp_path))
    from packer.runtime.hf import hf_model_dir

    d = hf_model_dir(loader)
    link = d / "model.safetensors"
    assert link.is_symlink() and link.read_bytes() == weight_bytes(out)
    assert (link.resolve().parent / "packer_loader.py").resolve() == (out / "packer_loader.py").resolve()
    assert hf_model_dir(loader) == d  # reused as it was made
    copy = link.resolve()
    copy.write_bytes(copy.read_bytes()[:-1])
    with pytest.raises(ArtifactMismatchError, match="materialized weights were changed"):
        hf_model_dir(loader)
