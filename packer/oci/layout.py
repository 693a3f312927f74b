"""OCI image layout: ``oci-layout``, ``index.json``, config and manifest as canonical JSON."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packer.oci.base import OCI_CONFIG, OCI_INDEX, OCI_MANIFEST, REF_NAME, BaseImage, platform_fields
from packer.oci.layer import Layer
from packer.oci.plan import ImagePlan
from packer.util.fsutil import atomic_write_bytes, canonical_json

OCI_LAYOUT = b'{"imageLayoutVersion":"1.0.0"}\n'
PACKER_PREFIX = "packer:"  # history created_by of every layer packer wrote starts with this
ANNOTATION_PREFIX = "dev.model-packer.prefix"
ANNOTATION_OWNER = "dev.model-packer.owner"
ANNOTATION_WEIGHTS = "dev.model-packer.weights"


@dataclass(frozen=True)
class LayoutDigests:
    """Digests of the three JSON documents, for the manifest's image section."""

    index: str
    manifest: str
    config: str


def rfc3339(epoch: int) -> str:
    """``epoch`` as an RFC 3339 UTC timestamp with second precision."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def write_json_blob(blobs_dir: Path, data: dict[str, Any], media_type: str) -> dict[str, Any]:
    """Store ``data`` as canonical JSON under its digest; return its descriptor."""
    raw = canonical_json(data)
    hexd = hashlib.sha256(raw).hexdigest()
    atomic_write_bytes(blobs_dir / hexd, raw, 0o644)
    return {"mediaType": media_type, "digest": f"sha256:{hexd}", "size": len(raw)}


def image_config(
    plan: ImagePlan,
    layers: Sequence[Layer],
    *,
    base: BaseImage | None,
    created: str,
    labels: dict[str, str],
    run: dict[str, Any],
) -> dict[str, Any]:
    """The image config: the base's, with ``run`` as its run config, plus packer's layers and history."""
    cfg: dict[str, Any] = dict(base.config) if base else {}
    for key, value in platform_fields(plan.platform).items():
        cfg.setdefault(key, value)
    cfg["created"] = created
    run = dict(run)
    run["Labels"] = {**(run.get("Labels") or {}), **labels}
    cfg["config"] = run
    base_ids = list((cfg.get("rootfs") or {}).get("diff_ids") or []) if base else []
    cfg["rootfs"] = {"type": "layers", "diff_ids": base_ids + [la.diff_id for la in layers]}
    history = list(cfg.get("history") or []) if base else []
    for planned in plan.layers:
        history.append({"created": created, "created_by": planned.created_by(plan.prefix),
                        "comment": "reproducible layer written by packer"})
    cfg["history"] = history
    return cfg


def write_layout(
    image_dir: Path,
    plan: ImagePlan,
    layers: Sequence[Layer],
    *,
    base: BaseImage | None,
    created: str,
    annotations: dict[str, str],
    run: dict[str, Any],
    base_name: str | None = None,
    extra: Sequence[dict[str, Any]] = (),
) -> LayoutDigests:
    """Write config, manifest, ``index.json`` and ``oci-layout`` (blobs already stored).

    Args:
        image_dir: the layout directory (``OUT/image``).
        plan: the layer plan the layers were written from.
        layers: packer's layers, bottom to top.
        base: the base image whose layers go below packer's, or None.
        created: RFC 3339 creation time (from SOURCE_DATE_EPOCH).
        annotations: ``org.opencontainers.image.*`` annotations for the manifest.
        run: the image config's run config (see :func:`packer.oci.runconfig.run_config`).
        base_name: the base's registry reference (``base.name``), or None to leave it out.
        extra: more index entries (descriptors with their own tag), after the image's.

    Returns:
        The digests of index, manifest and config.
    """
    blobs = image_dir / "blobs" / "sha256"
    config = image_config(plan, layers, base=base, created=created, labels=annotations, run=run)
    config_desc = write_json_blob(blobs, config, OCI_CONFIG)
    manifest_annotations = dict(annotations)
    manifest_annotations[ANNOTATION_PREFIX] = plan.prefix
    manifest_annotations[ANNOTATION_OWNER] = str(plan.owner)
    manifest_annotations[ANNOTATION_WEIGHTS] = plan.weights
    if base is not None:
        if base_name:
            manifest_annotations["org.opencontainers.image.base.name"] = base_name
        manifest_annotations["org.opencontainers.image.base.digest"] = base.manifest_digest
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": config_desc,
        "layers": [*(base.layers if base else ()), *(la.descriptor() for la in layers)],
        "annotations": manifest_annotations,
    }
    manifest_desc = write_json_blob(blobs, manifest, OCI_MANIFEST)
    # the index says what the config says: a runtime picks by the index, then runs the config
    platform = {k: config[k] for k in ("os", "architecture", "variant") if config.get(k)}
    index = {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [{**manifest_desc, "platform": platform, "annotations": {REF_NAME: plan.tag}},
                      *extra],
    }
    index_raw = canonical_json(index)
    atomic_write_bytes(image_dir / "oci-layout", OCI_LAYOUT, 0o644)
    atomic_write_bytes(image_dir / "index.json", index_raw, 0o644)
    return LayoutDigests(
        "sha256:" + hashlib.sha256(index_raw).hexdigest(),
        manifest_desc["digest"],
        config_desc["digest"],
    )
