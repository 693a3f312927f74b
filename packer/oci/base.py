"""Read a base image from an OCI layout (``oci:PATH[:TAG]``) and bring its blobs along.

A multi-platform index is resolved to the requested platform. Docker media types (a
``docker save``-style v2 manifest or manifest list) are rewritten to their OCI equivalents:
skopeo and umoci cannot resolve tags in a layout whose manifest uses Docker types. Layer
blobs are unchanged (hardlinked or copied byte for byte), but the rewritten manifest and the
new config have new digests; ``base.digest`` records the base manifest digest as found.

Every document is read through :mod:`packer.oci.base_docs` (bounded, checked in shape and
against its digest) before a field is used, and every blob a descriptor names must lie in the
layout's own ``blobs/``: a descriptor cannot make packer read or write anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packer.errors import ImageError
from packer.filetree import link_or_copy
from packer.oci.base_docs import CONFIG, INDEX, MANIFEST, blob_file, read_doc, read_index

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
    ref_name: str | None = None  # the layout's ref annotation of the picked image, as found


def parse_reference(ref: str) -> tuple[Path, str | None]:
    """Split ``oci:PATH[:TAG]`` into the layout path and the tag (None when absent)."""
    if not ref.startswith("oci:") or len(ref) <= 4:
        raise ImageError(f"image.base: expected 'oci:PATH[:TAG]', got {ref!r}")
    rest = ref[4:]
    path, sep, tag = rest.rpartition(":")
    if sep and path and tag and "/" not in tag:
        return Path(path), tag
    return Path(rest), None


def platform_fields(platform: str) -> dict[str, str]:
    """``"os/arch[/variant]"`` (``linux/arm64/v8``) as OCI platform fields: os, architecture, variant."""
    os_, _, rest = platform.partition("/")
    arch, _, variant = rest.partition("/")
    return {"os": os_, "architecture": arch, **({"variant": variant} if variant else {})}


def _platform_matches(desc: dict[str, Any], platform: str) -> bool:
    want, p = platform_fields(platform), desc.get("platform") or {}
    return all(p.get(k) == v for k, v in want.items())


def _pick(descs: list[dict[str, Any]], tag: str | None) -> dict[str, Any]:
    if tag is not None:
        found = [d for d in descs if (d.get("annotations") or {}).get(REF_NAME) == tag]
        if not found:
            names = sorted({(d.get("annotations") or {}).get(REF_NAME, "") for d in descs} - {""})
            tags = ", ".join(names) or "none"
            raise ImageError(f"no image tagged {tag!r} (tags: {tags})")
        return found[0]
    if len(descs) != 1:
        raise ImageError(f"holds {len(descs)} images; name one with 'oci:PATH:TAG'")
    return descs[0]


def resolve_base(ref: str, *, platform: str) -> BaseImage:
    """Resolve ``oci:PATH[:TAG]`` to a single-platform manifest.

    Raises:
        ImageError: no layout, unknown tag, no manifest for ``platform``, bad media type, a
            document that is malformed in shape (one line: file, JSON path, what was expected).
    """
    layout, tag = parse_reference(ref)
    try:
        index = read_index(layout)
        desc = top = _pick(index["manifests"], tag)
        for _ in range(4):  # index -> (nested index) -> manifest
            if desc["mediaType"] not in INDEX_TYPES:
                break
            nested = read_doc(layout, desc, INDEX, "index")
            matches = [d for d in nested["manifests"] if _platform_matches(d, platform)]
            if not matches:
                raise ImageError(f"no manifest for platform {platform}")
            desc = matches[0]
        manifest = read_doc(layout, desc, MANIFEST, "manifest")
        media = manifest.get("mediaType") or desc["mediaType"]
        if media not in MANIFEST_TYPES:
            raise ImageError(f"unsupported manifest media type {media!r}")
        config = read_doc(layout, manifest["config"], CONFIG, "config")
    except ImageError as e:
        raise e.with_context(f"image.base {ref!r}") from e.__cause__
    layers = []
    for d in manifest["layers"]:
        mt = DOCKER_TO_OCI.get(d["mediaType"], d["mediaType"])
        if not mt.startswith("application/vnd.oci.image.layer.v1.tar"):
            raise ImageError(f"image.base {ref!r}: layer {d['digest']}: unsupported type {mt!r}")
        layers.append({"mediaType": mt, "digest": d["digest"], "size": d["size"]})
    check_platform(config, platform, f"image.base {ref!r}")
    ref_name = (top.get("annotations") or {}).get(REF_NAME)
    return BaseImage(ref, layout, desc["digest"], tuple(layers), config,
                     ref_name=ref_name if isinstance(ref_name, str) else None)


def check_platform(config: dict[str, Any], platform: str, where: str) -> None:
    """The base's config must be for ``platform``: a single-manifest base is not resolved by
    platform, and appending to another architecture would make an image that lies about it.

    Raises:
        ImageError: naming the config's platform and the requested one.
    """
    want = platform_fields(platform)
    got = {k: config.get(k) for k in ("os", "architecture", "variant") if config.get(k)}
    if got.get("os") != want["os"] or got.get("architecture") != want["architecture"] or (
            "variant" in want and "variant" in got and got["variant"] != want["variant"]):
        have = "/".join(str(got.get(k, "?")) for k in ("os", "architecture")) + (
            f"/{got['variant']}" if "variant" in got else "")
        raise ImageError(f"{where}: the base image is for {have}, but image.platform is {platform}; "
                         f"set image.platform = \"{have}\" or use a base for {platform}")


def link_blobs(base: BaseImage, blobs_dir: Path) -> int:
    """Hardlink (or copy byte for byte) the base's layer blobs into ``blobs_dir``.

    Each blob is first resolved inside the base layout's ``blobs/`` (a descriptor's digest is
    checked in shape, so its file name cannot leave ``blobs_dir`` either); a link there is
    followed, so the new name is a link to the file itself, never to a relative symlink.

    Returns:
        The number of bytes brought along.

    Raises:
        ImageError: a blob is missing, of the wrong size, not sha256, or leads outside.
    """
    total = 0
    for d in base.layers:
        try:
            src, hexd = blob_file(base.layout, d)
        except ImageError as e:
            raise e.with_context(f"image.base {base.reference!r}") from e.__cause__
        link_or_copy(src, blobs_dir / hexd)
        total += d["size"]
    return total
