"""The ModelPack view: a second manifest in the layout, over the same weight blobs.

CNCF ModelPack (github.com/modelpack/model-spec) is what modctl, KitOps, Docker Model Runner,
Harbor, Dragonfly and CRI-O read: an OCI manifest with ``artifactType``
``application/vnd.cncf.model.manifest.v1+json``, a model config (``descriptor``, ``config``,
``modelfs.diffIds``) and one layer per file, each annotated with its path
(``org.cncf.model.filepath``) and tar metadata (``org.cncf.model.file.metadata+json``).

containerd mounts only runnable images as volumes, so one manifest cannot serve both; this one
lives under its own tag (:func:`modelpack_tag`). Its weight layers *are* the runnable image's
weight layers (same blobs, same digests: a registry stores each once), only their media type
differs; the small model files (config, tokenizer, shard index) get one small layer each. Every
layer holds its file at the same path as the runnable image (below the prefix), which is what
``filepath`` says.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from packer.errors import ImageError
from packer.oci.base import OCI_MANIFEST, REF_NAME
from packer.oci.layer import Layer, LayerJob, write_layers
from packer.oci.layout import write_json_blob
from packer.oci.plan import ImagePlan, PlannedFile, PlannedLayer
from packer.oci.tar_writer import SourceFile, tar_members, tar_pieces
from packer.place import BLOBS
from packer.util.tarfmt import FILE_MODE

ARTIFACT_TYPE = "application/vnd.cncf.model.manifest.v1+json"
CONFIG_TYPE = "application/vnd.cncf.model.config.v1+json"
WEIGHT_TYPE = "application/vnd.cncf.model.weight.v1.tar"
WEIGHT_CONFIG_TYPE = "application/vnd.cncf.model.weight.config.v1.tar"
DOC_TYPE = "application/vnd.cncf.model.doc.v1.tar"
FILEPATH = "org.cncf.model.filepath"
FILE_METADATA = "org.cncf.model.file.metadata+json"
_SUFFIX = {"none": "", "gzip": "+gzip", "zstd": "+zstd"}
_TAR_REGULAR = ord("0")


def modelpack_tag(tag: str) -> str:
    """The ModelPack manifest's tag beside the image's: ``name:1.0`` -> ``name:1.0-modelpack``."""
    return f"{tag}-modelpack" if ":" in tag.rpartition("/")[2] else f"{tag}:modelpack"


def compression_of(media_type: str) -> str:
    """``none``, ``gzip`` or ``zstd`` for a ModelPack tar media type; ImageError for another."""
    for kind, suffix in _SUFFIX.items():
        if suffix and media_type.endswith(".tar" + suffix):
            return kind
    if media_type.endswith(".tar"):
        return "none"
    raise ImageError(f"ModelPack layer media type {media_type!r}: not a tar layer")


def wanted(plan: ImagePlan) -> bool:
    """A ModelPack view is written when the weights are in their own layers (not external, not
    one single layer): only then can it share their blobs."""
    return plan.weights == "layer" and not (len(plan.layers) == 1 and plan.layers[0].name == "model")


def _is_weight_layer(planned: PlannedLayer) -> bool:
    return planned.compression == "none" and planned.name.startswith("weights ")


def _doc(path: str) -> bool:
    name = PurePosixPath(path).name.upper()
    return name.endswith(".MD") or name.startswith(("README", "LICENSE", "NOTICE"))


def _annotations(f: PlannedFile, plan: ImagePlan, created: str) -> dict[str, str]:
    path = f.dest.lstrip("/")
    meta = {"name": PurePosixPath(path).name, "mode": FILE_MODE, "uid": plan.owner.uid,
            "gid": plan.owner.gid, "size": f.size, "mtime": created, "typeflag": _TAR_REGULAR}
    return {FILEPATH: path, FILE_METADATA: json.dumps(meta, sort_keys=True, separators=(",", ":"))}


def _small_files(plan: ImagePlan) -> list[PlannedFile]:
    return sorted((f for la in plan.layers if la.name == "model files" for f in la.files), key=lambda f: f.dest)


def _write_small(out_dir: Path, plan: ImagePlan, files: Sequence[PlannedFile],
                 member_bytes: Mapping[str, bytes], mtime: int) -> list[Layer]:
    jobs = []
    for f in files:
        src = (SourceFile(f.dest, f.size, data=member_bytes[f.dest]) if f.member is not None
               else SourceFile(f.dest, f.size, source=out_dir / f.rel_path))
        members = tar_members([src], owner=plan.owner, prefix=plan.prefix)
        jobs.append(LayerJob(tar_pieces(members, mtime=mtime), plan.compression))
    try:
        return write_layers(jobs, out_dir / BLOBS)
    except OSError as e:
        raise ImageError(f"writing the ModelPack layers: {e}") from e


def _descriptor(source: Mapping[str, Any], name: str, version: str, created: str) -> dict[str, Any]:
    desc: dict[str, Any] = {"name": name, "version": version, "createdAt": created}
    uri, revision = str(source.get("uri") or ""), source.get("revision")
    if uri.startswith("hf://"):  # never a local path: it means nothing outside the build machine
        desc["sourceURL"] = "https://huggingface.co/" + uri[5:].partition("@")[0]
    if revision:
        desc["revision"] = str(revision)
    return desc


def write_modelpack(
    out_dir: Path, plan: ImagePlan, layers: Sequence[Layer], *, member_bytes: Mapping[str, bytes],
    mtime: int, created: str, source: Mapping[str, Any], name: str, version: str,
    annotations: Mapping[str, str], precision: str | None = None,
) -> dict[str, Any]:
    """Write the ModelPack config, its small layers and its manifest; return its index entry.

    Args:
        out_dir: the output directory (``image/blobs/sha256`` receives the blobs).
        plan: the image plan; ``layers``: the runnable image's layers written from it.
        member_bytes: the bundle members' bytes by image path (:func:`packer.oci.model_dir.read_members`).
        mtime: the tar entries' mtime; ``created``: the same time in RFC 3339.
        source: ``{"kind", "uri", "revision"}`` of the model source.
        name, version: the model's identity; ``annotations``: the image's manifest annotations.
        precision: the weights' dtype, when one.

    Returns:
        The index descriptor (with ``artifactType`` and the ModelPack tag).

    Raises:
        ImageError: a layer cannot be written.
    """
    blobs = out_dir / BLOBS
    descs: list[dict[str, Any]] = []
    diff_ids: list[str] = []
    for planned, layer in zip(plan.layers, layers, strict=True):
        if _is_weight_layer(planned):  # the same blob as the image's layer
            descs.append({"mediaType": WEIGHT_TYPE, "digest": layer.digest, "size": layer.size,
                          "annotations": _annotations(planned.files[0], plan, created)})
            diff_ids.append(layer.diff_id)
    small = _small_files(plan)
    for f, layer in zip(small, _write_small(out_dir, plan, small, member_bytes, mtime), strict=True):
        kind = (DOC_TYPE if _doc(f.dest) else WEIGHT_CONFIG_TYPE) + _SUFFIX[plan.compression]
        descs.append({"mediaType": kind, "digest": layer.digest, "size": layer.size,
                      "annotations": _annotations(f, plan, created)})
        diff_ids.append(layer.diff_id)
    config: dict[str, Any] = {"descriptor": _descriptor(source, name, version, created),
                              "config": {"format": "safetensors",
                                         **({"precision": precision} if precision else {})},
                              "modelfs": {"type": "layers", "diffIds": diff_ids}}
    config_desc = write_json_blob(blobs, config, CONFIG_TYPE)
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": ARTIFACT_TYPE,
                "config": config_desc, "layers": descs, "annotations": dict(annotations)}
    manifest_desc = write_json_blob(blobs, manifest, OCI_MANIFEST)
    return {**manifest_desc, "artifactType": ARTIFACT_TYPE,
            "annotations": {REF_NAME: modelpack_tag(plan.tag)}}
