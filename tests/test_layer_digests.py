"""Weight-layer digests computed while the weights are written, used by the image stage."""

from __future__ import annotations

import hashlib
import io
import tarfile
from functools import partial
from pathlib import Path
from typing import Any

import pytest

import packer.oci
from packer.building import build
from packer.demo import write_demo
from packer.errors import ImageError, VerifyError
from packer.hashing import file_entry
from packer.oci import build_image
from packer.oci.layer import write_layer
from packer.oci.plan import WEIGHT_ALIGN, image_rel, weight_layer_framing
from packer.oci.tar_writer import Owner, SourceFile, tar_members, tar_pieces, tar_size
from packer.recipe import ImageConfig, WeightsConfig, recipe_from_dict
from packer.util.fsutil import FileEntry, canonical_json
from packer.weights.convert import convert
from packer.weights.options import ConvertOptions
from packer.weights.sandbox import convert_sandboxed

WEIGHTS = "weights/model.safetensors"


def tree(out: Path) -> dict[str, str]:
    """sha256 of every file under ``out`` except the timings, by relative path."""
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and p.name != "build-timings.json"}


def _artifact(out: Path, size: int) -> tuple[list[FileEntry], bytes]:
    """A minimal OUT: one weight file of ``size`` bytes and a loader."""
    (out / "weights").mkdir(parents=True)
    (out / WEIGHTS).write_bytes(bytes(i % 251 for i in range(size)))
    (out / "packer_loader.py").write_bytes(b"def load():\n    return 1\n")
    files = [file_entry(out, out / WEIGHTS), file_entry(out, out / "packer_loader.py")]
    return files, canonical_json({"files": {f.path: f.as_json() for f in files}})


@pytest.mark.parametrize(("size", "owner", "prefix", "epoch"), [
    (0, "0:0", "/opt/model", None),
    (1, "1000:0", "/opt/model", "1700000000"),
    (511, "0:0", "/srv/deep/m/", None),
    (512, "1000:0", "/m", "42"),
    (70_001, "0:0", "/" + "long-directory-name/" * 6 + "x", None),  # PAX path record
])
def test_framing_plus_content_is_the_stage_blob(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int, owner: str, prefix: str,
    epoch: str | None,
) -> None:
    if epoch is not None:
        monkeypatch.setenv("SOURCE_DATE_EPOCH", epoch)
    else:
        monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    cfg = ImageConfig(owner=owner, prefix=prefix)
    files, manifest = _artifact(tmp_path, size)
    result = build_image(tmp_path, cfg=cfg, name="m", version="1", source={"kind": "demo"},
                         artifact_files=files, artifact_manifest=manifest)
    (layer,) = [la for la in result.section["layers"] if la["files"] == [WEIGHTS]]
    blob = (tmp_path / "image/blobs/sha256" / layer["digest"][7:]).read_bytes()
    head, tail = weight_layer_framing(cfg, WEIGHTS, size)
    assert head + (tmp_path / WEIGHTS).read_bytes() + tail == blob
    assert weight_layer_framing(cfg, WEIGHTS, size, mtime=int(epoch or 0)) == (head, tail)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tf:  # an independent reader agrees
        member = tf.getmember(f"{prefix.strip('/')}/{image_rel(WEIGHTS)}")
        assert (member.size, f"{member.uid}:{member.gid}", member.mtime) == (size, owner, int(epoch or 0))


def test_framing_of_a_file_over_8_gib_uses_a_pax_size() -> None:
    size = 9 * 2**30 + 3
    cfg = ImageConfig(owner="1000:0")
    head, tail = weight_layer_framing(cfg, WEIGHTS, size, mtime=7)
    assert f" size={size}\n".encode() in head and len(head) % 512 == 0
    assert tail == b"\0" * (-size % 512) + b"\0" * 1024
    members = tar_members([SourceFile(f"/models/{image_rel(WEIGHTS)}", size, source=Path("x"), align=WEIGHT_ALIGN)],
                          owner=Owner(1000, 0), prefix="/models")
    assert len(head) + size + len(tail) == tar_size(members, mtime=7)
    assert head == b"".join(p for p in tar_pieces(members, mtime=7) if isinstance(p, bytes))[: len(head)]


def test_known_digest_is_copied_not_hashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ImageConfig(owner="1000:0")
    plain, fast = tmp_path / "plain", tmp_path / "fast"
    for out in (plain, fast):
        out.mkdir()
        files, manifest = _artifact(out, 100_003)
    head, tail = weight_layer_framing(cfg, WEIGHTS, 100_003)
    known = {f"layer:{WEIGHTS}": "sha256:" + hashlib.sha256(head + (fast / WEIGHTS).read_bytes() + tail).hexdigest()}
    args: dict[str, Any] = {"cfg": cfg, "name": "m", "version": "1", "source": {"kind": "demo"},
                            "artifact_files": files, "artifact_manifest": manifest}
    first = build_image(plain, **args)
    monkeypatch.setattr("packer.oci.layer._copy_range_fast", _never)  # the hashing copy path
    second = build_image(fast, **args, known_digests=known)  # verify=True: verify_image passes
    assert first.section == second.section and first.files == second.files
    assert tree(plain) == tree(fast)


def _never(*_: object) -> None:
    raise AssertionError("a layer with a known digest was hashed")


def test_a_known_digest_must_be_a_sha256_digest(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="expected sha256:<64 hex digits>"):
        write_layer([b"x" * 1024], tmp_path, compression="none", digest="sha256:../../escape")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def demo_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    write_demo(src)
    return src


def _layer_hashes(out: Path, framing: Any, files: Any) -> dict[str, str]:
    expected = {}
    for f in files:
        if f.path.endswith(".safetensors"):
            head, tail = framing(f.path, f.size)
            layer = head + (out / f.path).read_bytes() + tail
            expected[f"layer:{f.path}"] = "sha256:" + hashlib.sha256(layer).hexdigest()
    return expected


def test_convert_hashes_each_shard_layer_while_writing(demo_src: Path, tmp_path: Path) -> None:
    cfg = WeightsConfig(max_shard_size=12 * 10**6)
    image = ImageConfig(owner="1000:0", prefix="/srv/m")
    framing = partial(weight_layer_framing, image, mtime=5)
    plain = convert(demo_src, tmp_path / "a" / "weights", cfg, rel_root=tmp_path / "a")
    framed = convert(demo_src, tmp_path / "b" / "weights", cfg, rel_root=tmp_path / "b",
                     layer_framing=framing)
    assert plain.digests == {} and plain.files == framed.files and plain.section == framed.section
    assert len(framed.digests) >= 2  # sharded: one layer per shard
    assert framed.digests == _layer_hashes(tmp_path / "b", framing, framed.files)


def test_sandboxed_convert_returns_the_same_digests(
    demo_src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1234")
    cfg = WeightsConfig(max_shard_size=12 * 10**6)
    image = ImageConfig(owner="1000:0", prefix="/srv/m")
    result = convert_sandboxed(demo_src, tmp_path / "weights", cfg, ConvertOptions(layer_image=image),
                               rel_root=tmp_path)
    framing = partial(weight_layer_framing, image, mtime=1234)
    assert len(result.digests) >= 2
    assert result.digests == _layer_hashes(tmp_path, framing, result.files)


def _patched_build_image(monkeypatch: pytest.MonkeyPatch, seen: list[dict[str, str]],
                         replace: str | None) -> None:
    """Wrap the image stage as build() calls it: record the digests, drop or falsify them."""
    real = packer.oci.build_image

    def wrapper(*args: Any, known_digests: dict[str, str] | None = None, **kw: Any) -> Any:
        seen.append(dict(known_digests or {}))
        if replace == "drop":
            known_digests = None
        elif replace is not None:
            known_digests = {k: replace for k in known_digests or {}}
        return real(*args, known_digests=known_digests, **kw)

    monkeypatch.setattr(packer.oci, "build_image", wrapper)


def _recipe(src: Path, **image: Any) -> Any:
    return recipe_from_dict({"name": "m", "version": "1", "source": str(src),
                             "weights": {"max_shard_size": "12MB"}, "image": image})


@pytest.mark.parametrize("sandbox", [True, False])
def test_build_with_and_without_precomputed_digests_is_identical(
    demo_src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sandbox: bool
) -> None:
    recipe = _recipe(demo_src, owner="1000:0", prefix="/srv/m")
    seen: list[dict[str, str]] = []
    _patched_build_image(monkeypatch, seen, None)
    build(recipe, tmp_path / "fast", sandbox=sandbox, layer_digests=True)
    _patched_build_image(monkeypatch, seen, "drop")
    build(recipe, tmp_path / "plain", sandbox=sandbox, layer_digests=True)
    assert tree(tmp_path / "fast") == tree(tmp_path / "plain")
    assert len(seen[0]) >= 2 and seen[0] == seen[1]  # both computed; the second run dropped them
    for digest in seen[0].values():
        assert (tmp_path / "fast/image/blobs/sha256" / digest[7:]).is_file()


def test_no_precomputation_for_a_single_layer_or_external_weights(
    demo_src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[dict[str, str]] = []
    _patched_build_image(monkeypatch, seen, None)
    build(_recipe(demo_src, single_layer=True, compression="zstd"), tmp_path / "one", sandbox=False,
          layer_digests=True)
    build(_recipe(demo_src, weights="external"), tmp_path / "ext", sandbox=False, layer_digests=True)
    assert seen == [{}, {}]


def test_a_wrong_known_digest_fails_verification_and_publishes_nothing(
    demo_src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = _recipe(demo_src)
    out = tmp_path / "out"
    build(recipe, out, sandbox=False)
    before = tree(out)
    seen: list[dict[str, str]] = []
    _patched_build_image(monkeypatch, seen, "sha256:" + "0" * 64)
    with pytest.raises(VerifyError, match="0" * 64):
        build(recipe, out, sandbox=False, layer_digests=True)
    assert tree(out) == before  # the previous build is still there, untouched
    with pytest.raises(VerifyError):
        build(recipe, tmp_path / "new", sandbox=False, layer_digests=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no OUT, no staging left

