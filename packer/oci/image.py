"""The image stage: plan the layers, write them, the layout, the tarballs and the Dockerfile."""

from __future__ import annotations

import hashlib
import stat
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from packer.errors import ImageError
from packer.hashing import file_entry
from packer.oci.base import REF_NAME, BaseImage, link_blobs, resolve_base
from packer.oci.dockerfile import (
    LAYERS_DIR,
    Standalone,
    check_run_config,
    link_tarball,
    tarball_name,
    write_docker_files,
)
from packer.oci.layer import MEDIA_TYPES, Layer, LayerJob, write_layers
from packer.oci.layout import rfc3339, write_layout
from packer.oci.model_dir import read_members
from packer.oci.modelpack import wanted as modelpack_wanted
from packer.oci.modelpack import write_modelpack
from packer.oci.plan import ImagePlan, PlannedLayer, model_files, plan_layers
from packer.oci.runconfig import base_name, created_epoch, image_annotations, run_config
from packer.oci.tar_writer import SourceFile, tar_members, tar_pieces
from packer.place import BLOBS, blob_hex, blob_rel
from packer.reading import MANIFEST, parse_json, walk_tree
from packer.recipe import ImageConfig
from packer.stage import Progress, StageOutput
from packer.util import tarfmt
from packer.util.formats import LOADER_NAME, MANIFEST_NAME
from packer.util.fsutil import FileEntry


def source_date_epoch() -> int:
    """``SOURCE_DATE_EPOCH`` as an int (0 when unset); ImageError when malformed."""
    return tarfmt.source_date_epoch(ImageError)


def _json_or_empty(raw: bytes) -> dict[str, Any]:
    parsed = parse_json(raw, MANIFEST, where=f"{MANIFEST_NAME}: the artifact manifest", error=ImageError) if raw else {}
    if not isinstance(parsed, dict):
        raise ImageError(f"{MANIFEST_NAME}: the artifact manifest is not a JSON object")
    return parsed


def plan_image(
    *,
    cfg: ImageConfig,
    name: str,
    version: str,
    artifact_files: Sequence[FileEntry],
    artifact_manifest: bytes,
    loader_paths: Collection[str] = (LOADER_NAME,),
) -> ImagePlan:
    """The layer plan only (what ``--dry-run`` prints); reads nothing from disk.

    ``loader_paths`` are the files the loader stage wrote (the top layer); the bundle's
    members come from the artifact manifest (none in a dry run, which has no manifest yet).
    """
    digest = hashlib.sha256(artifact_manifest).hexdigest()
    manifest = FileEntry(MANIFEST_NAME, len(artifact_manifest), digest)
    files = [f for f in artifact_files if f.path != MANIFEST_NAME]
    bundle_path, members = model_files(_json_or_empty(artifact_manifest))
    return plan_layers(files, cfg, name=name, version=version, manifest=manifest, members=members,
                       bundle_path=bundle_path, loader_paths=loader_paths)


def _known_digest(planned: PlannedLayer, known: Mapping[str, str]) -> str | None:
    """The precomputed digest of a one-file uncompressed layer (see weight_layer_framing)."""
    if planned.compression != "none" or len(planned.files) != 1:
        return None
    return known.get(f"layer:{planned.files[0].rel_path}")


def _written_blob(out_dir: Path, planned: PlannedLayer, known: Mapping[str, str]) -> Layer | None:
    """The layer the weights stage wrote already (the weight file's one copy), else None.

    Its bytes are not read here: the build's final verification walks every blob, and
    :func:`packer.oci.verify.verify_image` checks the file inside it against the manifest.
    A known digest for it is trusted as the layer's (a wrong one is caught there too).
    """
    if len(planned.files) != 1 or not planned.files[0].blob:
        return None
    rel = planned.files[0].blob
    hexd, path = blob_hex(rel), out_dir / rel
    if planned.compression != "none" or hexd is None or not path.is_file():
        raise ImageError(f"{out_dir / rel}: the weight layer blob of {planned.files[0].rel_path} is missing")
    digest = _known_digest(planned, known) or "sha256:" + hexd
    return Layer(digest, digest, path.stat().st_size, MEDIA_TYPES["none"], path)


def _write_layers(
    out_dir: Path, plan: ImagePlan, manifest: bytes, mtime: int, progress: Progress | None,
    known: Mapping[str, str], member_bytes: Mapping[str, bytes],
) -> tuple[list[Layer], list[Standalone]]:
    blobs = out_dir / BLOBS
    jobs, rels, written = [], [], {}
    for i, planned in enumerate(plan.layers):
        rels.append(f"{LAYERS_DIR}/{tarball_name(i, planned)}")
        if (done := _written_blob(out_dir, planned, known)) is not None:
            written[i] = done
            continue
        sources = [
            SourceFile(f.dest, f.size, data=manifest) if f.rel_path == MANIFEST_NAME and f.member is None
            else SourceFile(f.dest, f.size, data=member_bytes[f.dest]) if f.member is not None
            else SourceFile(f.dest, f.size, source=out_dir / f.rel_path, executable=f.executable, align=f.align)
            for f in planned.files
        ]
        members = tar_members(sources, owner=plan.owner, prefix=plan.prefix)
        tee = out_dir / rels[-1] if planned.compression == "zstd" else None
        digest = None if tee else _known_digest(planned, known)
        jobs.append(LayerJob(tar_pieces(members, mtime=mtime), planned.compression, tee, digest))
    todo = [i for i in range(len(plan.layers)) if i not in written]

    def report(j: int) -> None:
        if progress:
            progress(plan.layers[todo[j]].size)

    try:
        made = write_layers(jobs, blobs, on_done=report) if jobs else []
    except OSError as e:
        raise ImageError(f"writing the image layers in {blobs}: {e}") from e
    written.update(zip(todo, made, strict=True))
    layers = [written[i] for i in range(len(plan.layers))]
    tarballs = []
    for rel, layer, planned in zip(rels, layers, plan.layers, strict=True):
        if planned.compression != "zstd":
            link_tarball(out_dir, rel, layer)
        media = MEDIA_TYPES["gzip" if planned.compression == "gzip" else "none"]
        tarballs.append(Standalone(rel, media, layer, planned))
    return layers, tarballs


def _layer_section(layer: Layer, planned: PlannedLayer) -> dict[str, Any]:
    return {"digest": layer.digest, "diff_id": layer.diff_id, "size": layer.size,
            "media_type": layer.media_type, "files": [f.label for f in planned.files]}


def _entries(out_dir: Path, layers: Sequence[Layer], tarballs: Sequence[Standalone],
             base: BaseImage | None) -> list[FileEntry]:
    """FileEntry for every file written, without re-reading the large ones."""
    entries: dict[str, FileEntry] = {}
    blob_descs = [la.descriptor() for la in layers] + list(base.layers if base else ())
    for d in blob_descs:
        hexd = d["digest"].removeprefix("sha256:")
        rel = blob_rel(hexd)
        entries[rel] = FileEntry(rel, d["size"], hexd)
    for t in tarballs:
        if t.rel_path.endswith(".gz") or t.layer.media_type == MEDIA_TYPES["none"]:
            entries[t.rel_path] = FileEntry(t.rel_path, t.layer.size, t.layer.digest[7:])
        else:  # the uncompressed tee of a zstd layer: its sha256 is the diff_id
            size = (out_dir / t.rel_path).stat().st_size
            entries[t.rel_path] = FileEntry(t.rel_path, size, t.layer.diff_id[7:])
    for image_rel, p, mode in walk_tree(out_dir / "image", error=ImageError):
        rel = f"image/{image_rel}"
        if (stat.S_ISREG(mode) or stat.S_ISLNK(mode) and p.is_file()) and rel not in entries:  # small JSON files
            entries[rel] = file_entry(out_dir, p)
    entries["Dockerfile"] = file_entry(out_dir, out_dir / "Dockerfile")
    return [entries[k] for k in sorted(entries)]


def _clear_image_dir(image_dir: Path, keep: set[str], out_dir: Path) -> None:
    """Remove our own output of an earlier try in this staging dir, but the weight blobs
    the weights stage wrote (``keep``, paths in OUT)."""
    if not image_dir.exists():
        return
    for _rel, path, mode in reversed(walk_tree(image_dir, error=ImageError)):
        if path.relative_to(out_dir).as_posix() in keep:
            continue
        if stat.S_ISDIR(mode):
            if not any(path.iterdir()):
                path.rmdir()
        else:
            path.unlink()


def build_image(
    out_dir: Path,
    *,
    cfg: ImageConfig,
    name: str,
    version: str,
    source: dict[str, Any],
    artifact_files: list[FileEntry],
    artifact_manifest: bytes,
    dry_run: bool = False,
    verify: bool = True,
    progress: Progress | None = None,
    known_digests: Mapping[str, str] | None = None,
    loader_paths: Collection[str] = (LOADER_NAME,),
) -> StageOutput:
    """Write ``OUT/image`` (OCI layout), standalone layer tarballs and ``OUT/Dockerfile``.

    Args:
        out_dir: the staging output directory holding the artifact files.
        cfg: the recipe's ``[image]`` section.
        name, version: the model's name and version (tag, annotations).
        source: ``{"kind", "uri", "revision"}`` of the model source (annotations).
        artifact_files: the artifact files (relative to ``out_dir``) with size and sha256.
        artifact_manifest: the artifact manifest bytes; stored as ``<prefix>/manifest.json``.
        dry_run: only plan; the section is the plan and nothing is written.
        verify: re-read the written image with :func:`verify_image` (checks every byte).
        progress: called after each layer with its size (an increment, see
            :data:`packer.stage.Progress`).
        known_digests: ``{"layer:<path in OUT>": "sha256:…"}`` of one-file uncompressed
            layers, hashed while the weights were written: those layers are copied, not
            hashed. Trusted: a wrong one is caught by ``verify`` (or the build's own check).
        loader_paths: the files the loader stage wrote (the top layer; ``packer_loader.py`` executable).

    Returns:
        The files written and the manifest's ``image`` section.

    Raises:
        ImageError: bad config, unreadable base, a file changed while written.
        VerifyError: ``verify`` found the written image inconsistent.
    """
    plan = plan_image(cfg=cfg, name=name, version=version, artifact_files=artifact_files,
                      artifact_manifest=artifact_manifest, loader_paths=loader_paths)
    check_run_config(plan, cfg)  # what OUT/Dockerfile cannot say fails here, before any layer
    if dry_run:
        return StageOutput(section={"plan": plan.as_json()})
    epoch = created_epoch(source)
    created = rfc3339(epoch)
    image_dir = out_dir / "image"
    _clear_image_dir(image_dir, {f.blob for la in plan.layers for f in la.files if f.blob}, out_dir)
    (image_dir / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (out_dir / LAYERS_DIR).mkdir()
    base = resolve_base(cfg.base, platform=cfg.platform) if cfg.base else None
    base_bytes = link_blobs(base, image_dir / "blobs" / "sha256") if base else 0
    # digests hashed during conversion assumed SOURCE_DATE_EPOCH's mtime: trust them only then
    # (the weight blobs the build's weights stage writes use this image's own mtime)
    known = (known_digests or {}) if epoch == source_date_epoch() else {}
    member_bytes = read_members(out_dir, plan)
    layers, tarballs = _write_layers(out_dir, plan, artifact_manifest, epoch, progress, known, member_bytes)
    annotations = image_annotations(name, version, source, created)
    extra = [write_modelpack(out_dir, plan, layers, member_bytes=member_bytes, mtime=epoch, created=created,
                             source=source, name=name, version=version, annotations=annotations)
             ] if modelpack_wanted(plan) else []
    run = run_config(cfg, (base.config.get("config") or {}) if base else {}, prefix=plan.prefix,
                     runnable=base is not None)
    digests = write_layout(
        image_dir, plan, layers, base=base, created=created, annotations=annotations, run=run,
        base_name=base_name(cfg, base.ref_name) if base else None, extra=extra,
    )
    write_docker_files(out_dir, plan, tarballs, annotations, cfg)
    if verify:
        from packer.oci.verify import verify_image

        verify_image(out_dir, artifact_manifest=artifact_manifest)
    section = {
        "tag": plan.tag, "index_digest": digests.index, "manifest_digest": digests.manifest,
        "config_digest": digests.config, "compression": plan.compression, "prefix": plan.prefix,
        "owner": str(plan.owner), "weights": plan.weights,
        "layers": [_layer_section(la, p) for la, p in zip(layers, plan.layers, strict=True)],
        "base": None if base is None else {
            "name": base.reference, "digest": base.manifest_digest, "layers": len(base.layers)},
        "modelpack": None if not extra else {"tag": extra[0]["annotations"][REF_NAME],
                                             "manifest_digest": extra[0]["digest"]},
    }
    return StageOutput(
        files=tuple(_entries(out_dir, layers, tarballs, base)),
        section=section,
        bytes_processed=base_bytes + sum(la.size for la in layers),
    )
