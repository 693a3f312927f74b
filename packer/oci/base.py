"""Read a base image from an OCI layout (``oci:PATH[:TAG]``) and bring its blobs along.

A multi-platform index is resolved to the requested platform. Docker media types (a
``docker save``-style v2 manifest or manifest list) are rewritten to their OCI equivalents:
skopeo and umoci cannot resolve tags in a layout whose manifest uses Docker types. Layer
blobs are unchanged (hardlinked or copied byte for byte), but the rewritten manifest and the
new config have new digests; ``base.digest`` records the base manifest digest as found.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packer.errors import ImageError
from packer.fsutil import link_or_copy

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_TO_OCI = {
    DOCKER_LIST: OCI_INDEX,
    DOCKER_MANIFEST: OCI_MANIFEST,
    "application/vnd.docker.container.image.v1+json": OCI_CONFIG,
}
_DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar"
_OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
DOCKER_TO_OCI.update({
    _DOCKER_LAYER: _OCI_LAYER,
    _DOCKER_LAYER + ".gzip": _OCI_LAYER + "+gzip",
    _DOCKER_LAYER + ".zstd": _OCI_LAYER + "+zstd",
})
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
REF_NAME = "org.opencontainers.image.ref.name"


@dataclass(frozen=True)
class BaseImage:
    """A resolved base: its converted layer descriptors and its config (as data)."""

    reference: str  # as given in the recipe, "oci:PATH[:TAG]"
    layout: Path
    manifest_digest: str  # digest of the base manifest as found (before conversion)
    layers: tuple[dict[str, Any], ...]  # OCI descriptors
    config: dict[str, Any]


def parse_reference(ref: str) -> tuple[Path, str | None]:
    """Split ``oci:PATH[:TAG]`` into the layout path and the tag (None when absent)."""
    if not ref.startswith("oci:") or len(ref) <= 4:
        raise ImageError(f"image.base: expected 'oci:PATH[:TAG]', got {ref!r}")
    rest = ref[4:]
    path, sep, tag = rest.rpartition(":")
    if sep and path and tag and "/" not in tag:
        return Path(path), tag
    return Path(rest), None


def read_blob(layout: Path, digest: str) -> bytes:
    """Read a (small, JSON) blob from a layout."""
    algo, _, hexd = digest.partition(":")
    if algo != "sha256" or len(hexd) != 64 or not all(c in "0123456789abcdef" for c in hexd):
        raise ImageError(f"{layout}: unsupported or malformed digest {digest!r}")
    try:
        return (layout / "blobs" / "sha256" / hexd).read_bytes()
    except OSError as e:
        raise ImageError(f"{layout}: blob {digest} is missing: {e.strerror}") from e


def read_json(layout: Path, digest: str) -> dict[str, Any]:
    """Read and parse a JSON blob."""
    try:
        data = json.loads(read_blob(layout, digest))
    except ValueError as e:
        raise ImageError(f"{layout}: blob {digest} is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise ImageError(f"{layout}: blob {digest} is not a JSON object")
    return data


def platform_fields(platform: str) -> dict[str, str]:
    """``"os/arch[/variant]"`` (``linux/arm64/v8``) as OCI platform fields: os, architecture, variant."""
    os_, _, rest = platform.partition("/")
    arch, _, variant = rest.partition("/")
    return {"os": os_, "architecture": arch, **({"variant": variant} if variant else {})}


def _platform_matches(desc: dict[str, Any], platform: str) -> bool:
    want, p = platform_fields(platform), desc.get("platform") or {}
    return all(p.get(k) == v for k, v in want.items())


def _pick(descs: list[dict[str, Any]], tag: str | None, where: str) -> dict[str, Any]:
    if tag is not None:
        found = [d for d in descs if (d.get("annotations") or {}).get(REF_NAME) == tag]
        if not found:
            names = sorted({(d.get("annotations") or {}).get(REF_NAME, "") for d in descs} - {""})
            tags = ", ".join(names) or "none"
            raise ImageError(f"{where}: no image tagged {tag!r} (tags: {tags})")
        return found[0]
    if len(descs) != 1:
        raise ImageError(f"{where}: holds {len(descs)} images; name one with 'oci:PATH:TAG'")
    return descs[0]


def resolve_base(ref: str, *, platform: str) -> BaseImage:
    """Resolve ``oci:PATH[:TAG]`` to a single-platform manifest.

    Raises:
        ImageError: no layout, unknown tag, no manifest for ``platform``, bad media type.
    """
    layout, tag = parse_reference(ref)
    try:
        index = json.loads((layout / "index.json").read_bytes())
    except (OSError, ValueError) as e:
        raise ImageError(f"image.base {ref!r}: cannot read {layout}/index.json: {e}") from e
    desc = _pick(list(index.get("manifests") or []), tag, f"image.base {ref!r}")
    for _ in range(4):  # index -> (nested index) -> manifest
        if desc.get("mediaType") not in INDEX_TYPES:
            break
        nested = read_json(layout, desc["digest"])
        matches = [d for d in nested.get("manifests") or [] if _platform_matches(d, platform)]
        if not matches:
            raise ImageError(f"image.base {ref!r}: no manifest for platform {platform}")
        desc = matches[0]
    manifest = read_json(layout, desc["digest"])
    media = manifest.get("mediaType") or desc.get("mediaType")
    if media not in MANIFEST_TYPES:
        raise ImageError(f"image.base {ref!r}: unsupported manifest media type {media!r}")
    config = read_json(layout, manifest["config"]["digest"])
    layers = []
    for d in manifest.get("layers") or []:
        mt = DOCKER_TO_OCI.get(d["mediaType"], d["mediaType"])
        if not mt.startswith("application/vnd.oci.image.layer.v1.tar"):
            raise ImageError(f"image.base {ref!r}: layer {d['digest']}: unsupported type {mt!r}")
        layers.append({"mediaType": mt, "digest": d["digest"], "size": d["size"]})
    return BaseImage(ref, layout, desc["digest"], tuple(layers), config)


def link_blobs(base: BaseImage, blobs_dir: Path) -> int:
    """Hardlink (or copy byte for byte) the base's layer blobs into ``blobs_dir``.

    Returns:
        The number of bytes brought along.
    """
    total = 0
    for d in base.layers:
        hexd = d["digest"].removeprefix("sha256:")
        src, dst = base.layout / "blobs" / "sha256" / hexd, blobs_dir / hexd
        if not src.is_file():
            raise ImageError(f"image.base {base.reference!r}: blob {d['digest']} is missing")
        if src.stat().st_size != d["size"]:
            raise ImageError(f"image.base {base.reference!r}: blob {d['digest']} has a wrong size")
        link_or_copy(src, dst)
        total += d["size"]
    return total
