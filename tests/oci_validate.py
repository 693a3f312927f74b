"""The one OCI layout validator every image test calls, plus fixture builders.

``validate_layout`` re-derives everything from the bytes on disk with the standard library
(and zstandard), independent of ``packer.oci.verify``: oci-layout marker, index, manifest,
config, every blob's digest and size, every diff_id, and returns what it read so tests can
assert on entries. ``make_out`` writes a small fake packer OUT directory; ``make_base``
writes a small base image layout (OCI or Docker media types, optionally multi-platform).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from packer.hashing import file_entry
from packer.util.fsutil import FileEntry, canonical_json

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar": "none",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
}
REF = "org.opencontainers.image.ref.name"


@dataclass
class LayerInfo:
    descriptor: dict[str, Any]
    diff_id: str
    members: list[tarfile.TarInfo] = field(default_factory=list)
    contents: dict[str, bytes] = field(default_factory=dict)


@dataclass
class Layout:
    index: dict[str, Any]
    manifest_digest: str
    manifest: dict[str, Any]
    config: dict[str, Any]
    layers: list[LayerInfo]


def require_tool(name: str) -> str:
    """Path of an external tool, or skip the test saying which one is missing."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (apt-get install {name})")
    return path


def _blob(image: Path, desc: dict[str, Any]) -> bytes:
    algo, hexd = desc["digest"].split(":")
    assert algo == "sha256"
    data = (image / "blobs" / "sha256" / hexd).read_bytes()
    assert len(data) == desc["size"], f"{desc['digest']}: size {len(data)} != {desc['size']}"
    assert hashlib.sha256(data).hexdigest() == hexd, f"{desc['digest']}: digest mismatch"
    return data


def _decompress(data: bytes, kind: str) -> bytes:
    if kind == "gzip":
        return gzip.decompress(data)
    if kind == "zstd":
        import zstandard

        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)) as r:
            return r.read()
    return data


def validate_layout(image: Path, tag: str | None = None, *, packer: bool = True) -> Layout:
    """Check an OCI image layout; return what it holds (layers read fully: keep them small).

    ``packer=True`` also demands packer's conventions: canonical JSON for index, manifest and
    config; ``False`` checks any layout (one written by skopeo, say).
    """
    assert json.loads((image / "oci-layout").read_bytes()) == {"imageLayoutVersion": "1.0.0"}
    raw_index = (image / "index.json").read_bytes()
    index = json.loads(raw_index)
    assert not packer or raw_index == canonical_json(index), "index.json is not canonical JSON"
    assert index["schemaVersion"] == 2 and index.get("mediaType", OCI_INDEX) == OCI_INDEX
    assert not packer or index["mediaType"] == OCI_INDEX
    descs = index["manifests"]
    if tag is not None:
        descs = [d for d in descs if d.get("annotations", {}).get(REF) == tag]
    else:  # the runnable image, not an artifact (packer's ModelPack view) beside it
        descs = [d for d in descs if "artifactType" not in d]
    assert len(descs) == 1, f"expected one manifest tagged {tag!r}, got {len(descs)}"
    mraw = _blob(image, descs[0])
    assert descs[0]["mediaType"] == OCI_MANIFEST
    manifest = json.loads(mraw)
    assert not packer or mraw == canonical_json(manifest)
    assert manifest["schemaVersion"] == 2 and manifest["mediaType"] == OCI_MANIFEST
    assert manifest["config"]["mediaType"] == OCI_CONFIG
    craw = _blob(image, manifest["config"])
    config = json.loads(craw)
    assert not packer or craw == canonical_json(config)
    diff_ids = config["rootfs"]["diff_ids"]
    assert config["rootfs"]["type"] == "layers" and len(diff_ids) == len(manifest["layers"])
    non_empty = [h for h in config["history"] if not h.get("empty_layer")]
    assert len(non_empty) == len(diff_ids)
    layers = []
    for desc, diff_id in zip(manifest["layers"], diff_ids, strict=True):
        assert desc["mediaType"] in LAYER_TYPES, desc["mediaType"]
        tar = _decompress(_blob(image, desc), LAYER_TYPES[desc["mediaType"]])
        assert "sha256:" + hashlib.sha256(tar).hexdigest() == diff_id
        info = LayerInfo(desc, diff_id)
        with tarfile.open(fileobj=io.BytesIO(tar), mode="r:") as tf:
            for m in tf.getmembers():
                info.members.append(m)
                if m.isfile():
                    f = tf.extractfile(m)
                    assert f is not None
                    info.contents[m.name] = f.read()
        layers.append(info)
    return Layout(index, descs[0]["digest"], manifest, config, layers)


SIGSTORE_BUNDLE = "application/vnd.dev.sigstore.bundle.v0.3+json"
EMPTY_TYPE = "application/vnd.oci.empty.v1+json"


def validate_referrer(image: Path, subject: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], bytes]:
    """Check the one Sigstore-bundle referrer of ``subject`` (a descriptor) in a layout, the way
    cosign's bundle spec lays it out (OCI 1.1 artifact manifest, empty config, one bundle layer).

    Returns:
        Its index entry, its manifest and its layer's bytes (the bundle).
    """
    index = json.loads((image / "index.json").read_bytes())
    (desc,) = [d for d in index["manifests"] if d.get("artifactType") == SIGSTORE_BUNDLE]
    assert REF not in desc.get("annotations", {}), "a referrer is found by its subject, not by a tag"
    raw = _blob(image, desc)
    manifest = json.loads(raw)
    assert raw == canonical_json(manifest) and desc["mediaType"] == manifest["mediaType"] == OCI_MANIFEST
    assert manifest["schemaVersion"] == 2 and manifest["artifactType"] == SIGSTORE_BUNDLE
    assert manifest["subject"] == {k: subject[k] for k in ("mediaType", "digest", "size")}
    assert manifest["config"] == {"mediaType": EMPTY_TYPE, "size": 2,
                                  "digest": "sha256:" + hashlib.sha256(b"{}").hexdigest()}
    assert _blob(image, manifest["config"]) == b"{}"
    (layer,) = manifest["layers"]
    assert layer["mediaType"] == SIGSTORE_BUNDLE
    data = _blob(image, layer)
    assert json.loads(data)["mediaType"] == SIGSTORE_BUNDLE
    assert desc["annotations"] == manifest["annotations"]  # what a referrers listing shows
    return desc, manifest, data


def all_files(layout: Layout) -> dict[str, bytes]:
    """Every regular file of every layer, by path (upper layers win)."""
    out: dict[str, bytes] = {}
    for la in layout.layers:
        out.update(la.contents)
    return out


# ---------------------------------------------------------------------------------------
# fixtures


def make_out(out: Path, *, shards: int = 2, seed: int = 0) -> tuple[list[FileEntry], bytes]:
    """A fake packer OUT: weights, bundle, loader; returns (artifact files, artifact manifest)."""
    rnd = hashlib.sha256(str(seed).encode()).digest()
    (out / "weights").mkdir(parents=True, exist_ok=True)
    if shards == 1:
        (out / "weights" / "model.safetensors").write_bytes(rnd * 300)
    else:
        for i in range(1, shards + 1):
            name = f"model-{i:05d}-of-{shards:05d}.safetensors"
            (out / "weights" / name).write_bytes(rnd * (100 * i) + bytes([i]))
        (out / "weights" / "model.safetensors.index.json").write_bytes(b'{"weight_map":{}}\n')
    (out / "bundle.tar.zst").write_bytes(rnd[::-1] * 20)
    (out / "packer_loader.py").write_bytes(b"def load():\n    return 1\n")
    files = [file_entry(out, p) for p in sorted(out.rglob("*")) if p.is_file()]
    files = [f for f in files if not f.path.startswith(("image/", "Dockerfile"))]
    manifest = canonical_json({"files": {f.path: f.as_json() for f in files}, "name": "demo"})
    return files, manifest


def _tar_bytes(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in sorted(files.items()):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            ti.mode = 0o644
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _put(image: Path, data: bytes) -> str:
    hexd = hashlib.sha256(data).hexdigest()
    (image / "blobs" / "sha256" / hexd).write_bytes(data)
    return f"sha256:{hexd}"


def make_base(image: Path, *, tag: str = "base", docker_types: bool = False,
              platforms: tuple[str, ...] = (), arch: str = "amd64") -> dict[str, str]:
    """A small base image layout; returns {platform: manifest digest}.

    ``platforms`` makes a multi-platform index; without it, one manifest for linux/``arch``.
    """
    (image / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (image / "oci-layout").write_bytes(b'{"imageLayoutVersion":"1.0.0"}')
    mt_manifest = "application/vnd.docker.distribution.manifest.v2+json" if docker_types else OCI_MANIFEST
    mt_config = "application/vnd.docker.container.image.v1+json" if docker_types else OCI_CONFIG
    mt_layer = ("application/vnd.docker.image.rootfs.diff.tar.gzip" if docker_types
                else "application/vnd.oci.image.layer.v1.tar+gzip")
    digests: dict[str, str] = {}
    descs = []
    for plat in platforms or (f"linux/{arch}",):
        os_, arch = plat.split("/")[:2]
        tar = _tar_bytes({"etc/base-release": f"base {plat}\n".encode()})
        blob = gzip.compress(tar, mtime=0)
        layer = {"mediaType": mt_layer, "digest": _put(image, blob), "size": len(blob)}
        config = {"architecture": arch, "os": os_,
                  "config": {"Env": ["PATH=/usr/bin", "BASE=1"], "Cmd": ["/bin/true"], "User": "1000"},
                  "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(tar).hexdigest()]},
                  "history": [{"created_by": "base layer"}]}
        craw = json.dumps(config).encode()
        manifest = {"schemaVersion": 2, "mediaType": mt_manifest,
                    "config": {"mediaType": mt_config, "digest": _put(image, craw), "size": len(craw)},
                    "layers": [layer]}
        mraw = json.dumps(manifest).encode()
        digests[plat] = _put(image, mraw)
        descs.append({"mediaType": mt_manifest, "digest": digests[plat], "size": len(mraw),
                      "platform": {"os": os_, "architecture": arch}})
    if platforms:
        mt_index = ("application/vnd.docker.distribution.manifest.list.v2+json" if docker_types
                    else OCI_INDEX)
        iraw = json.dumps({"schemaVersion": 2, "mediaType": mt_index, "manifests": descs}).encode()
        top = {"mediaType": mt_index, "digest": _put(image, iraw), "size": len(iraw)}
    else:
        top = {k: v for k, v in descs[0].items() if k != "platform"}
    top["annotations"] = {REF: tag}
    index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [top]}
    (image / "index.json").write_bytes(json.dumps(index).encode())
    return digests


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run a tool; on failure, fail the test with its stderr."""
    env = {**os.environ, **kw.pop("env", {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, **kw)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}"
    return proc


def edit_base(image: Path, part: str, edit: Any) -> None:
    """Replace one document of a :func:`make_base` layout by ``edit(doc)`` and re-pin its parents.

    ``part`` is ``index`` (index.json), ``nested`` (the platform index of a multi-platform
    base), ``manifest`` or ``config``; ``edit`` may change the document in place and return it,
    or return anything else (a list, raw bytes). Digests and sizes above it are rewritten, so
    only the edited document is wrong.
    """
    def load(desc: dict[str, Any]) -> Any:
        return json.loads((image / "blobs" / "sha256" / desc["digest"][7:]).read_bytes())

    def store(desc: dict[str, Any], doc: Any) -> None:
        raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        desc["digest"], desc["size"] = _put(image, raw), len(raw)

    index = json.loads((image / "index.json").read_bytes())
    top = index["manifests"][0]
    if part == "index":
        index = edit(index)
    elif part == "nested":
        store(top, edit(load(top)))
    else:
        doc = load(top)
        nested, desc = (doc, doc["manifests"][0]) if "manifests" in doc else (None, top)
        manifest = load(desc)
        if part == "config":
            store(manifest["config"], edit(load(manifest["config"])))
        else:
            manifest = edit(manifest)
        store(desc, manifest)
        if nested is not None:
            store(top, nested)
    raw = index if isinstance(index, bytes) else json.dumps(index).encode()
    (image / "index.json").write_bytes(raw)
