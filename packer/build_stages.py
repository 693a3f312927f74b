"""The build's stages in order: :data:`STAGES`, the one list :mod:`packer.building` runs.

Each entry adapts the :class:`~packer.stage.StageContext` to its stage module's public
function (``convert_layout``, ``run_bundle``, ``emit_loader``, ``build_image``), which the
commands and tests also call directly. This module composes the stages, so it sits above them;
the contract they implement is :mod:`packer.stage`, below them. Stage modules are imported
inside the stage functions, so importing this module stays cheap (no torch).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from packer.errors import SignError
from packer.hashing import sha256_file
from packer.manifest import artifact_manifest, files_map
from packer.reading import SIGNATURE, read_bytes
from packer.stage import Stage, StageContext, StageOutput
from packer.util.formats import MANIFEST_NAME, SAFETENSORS_SUFFIX
from packer.util.fsutil import FileEntry, atomic_write_bytes, canonical_json


def weights_stage(ctx: StageContext) -> StageOutput:
    """Convert the source's checkpoints into ``staging/weights`` (isolated unless ``ctx.sandbox`` is false).

    Where each weight file gets a layer of its own (``image.weights = "layer"``, not
    ``image.single_layer``), the stage writes that layer blob itself, the file's one copy in
    OUT (``ctx.layer_digests``; off: a plain file in ``weights/``, hashed as it is written,
    that the image stage copies into its layer).

    The writer hashes nothing it writes as a blob: it reads each span back as it lands and
    compares it with its source (what landed is what was meant), and this process re-reads
    every blob (:func:`packer.oci.reread.reread_blobs`), hashing the blob, which names it, and
    the file inside it for the manifest from the same read: no digest is taken from the
    sandboxed writer. The final ``verify`` takes both digests from that read for a blob not
    written since (``vouched``).
    """
    from packer.oci.plan import weight_layer_framing
    from packer.oci.reread import reread_blobs, reread_files
    from packer.oci.runconfig import created_epoch
    from packer.weights.options import ConvertOptions
    from packer.weights.stage import convert_layout

    img = ctx.recipe.image
    layer_image = img if ctx.layer_digests and img.weights == "layer" and not img.single_layer else None
    mtime = created_epoch(ctx.snap.identity()) if layer_image else None  # the image's entries' mtime
    # verify=False: the final verify re-hashes every file the writer hashed (a blob's spans it reads back anyway)
    options = ConvertOptions(dry_run=ctx.dry_run, sandbox=ctx.sandbox, progress=ctx.progress, verify=False,
                             layer_image=layer_image, layer_blobs=layer_image is not None, layer_mtime=mtime)
    out = convert_layout(ctx.snap.weights, ctx.staging, ctx.recipe.weights, options, single_file=ctx.snap.single_file)
    if ctx.dry_run:
        return out
    framing = None if layer_image is None else partial(weight_layer_framing, layer_image, mtime=mtime)
    files, vouched = reread_blobs(ctx.staging, out.files, framing, ctx.recipe.weights.chunk_size)
    files, plain = reread_files(ctx.staging, files, ctx.recipe.weights.chunk_size)  # those in no blob
    layers = {f"layer:{f.path}": digest for f in files if f.blob and (digest := f.place().blob_digest)}
    # none of the child's digests stands
    return _with_chunk_table(ctx, replace(out, files=files, vouched={**vouched, **plain}, digests=layers))


def _with_chunk_table(ctx: StageContext, out: StageOutput) -> StageOutput:
    """``out`` with ``weights/packer-chunks.json`` (:mod:`packer.chunks`): the chunk digests the
    re-read of each weight file hashed (in its layer blob or as a plain file), pinned as a weight
    file of the build (its weights section names it under ``chunks``; the model directory and
    ``model.sig`` hold it)."""
    from packer.chunks import CHUNKS_REL, chunk_table
    from packer.oci.reread import PLAIN

    vouches = {f.path: out.vouched.get(str(f.place().blob_digest) if f.blob else PLAIN + f.path) for f in out.files}
    digests = {rel: (v.chunk, v.chunks, v.cuts) for rel, v in vouches.items() if v is not None}
    data = chunk_table(out.files, digests)
    if data is None:
        return out
    (ctx.staging / CHUNKS_REL).parent.mkdir(exist_ok=True)  # with every weight file in a blob, made here
    atomic_write_bytes(ctx.staging / CHUNKS_REL, data)
    entry = FileEntry(CHUNKS_REL, len(data), hashlib.sha256(data).hexdigest())
    return replace(out, files=(*out.files, entry), section={**out.section, "chunks": CHUNKS_REL})


def bundle_stage(ctx: StageContext) -> StageOutput:
    """Write ``staging/bundle.tar.zst`` from the source's tokenizer and config files."""
    from packer.bundle import run_bundle

    return run_bundle(ctx.snap.root, ctx.recipe.bundle, ctx.staging, rel_root=ctx.staging,
                      dry_run=ctx.dry_run)


def embedded_manifest(ctx: StageContext) -> dict[str, Any]:
    """The manifest the loader embeds: identity, the weights and bundle files and sections, runtime."""
    weights, bundle = ctx.outputs["weights"], ctx.outputs.get("bundle")
    return {"name": ctx.recipe.name, "version": ctx.recipe.version,
            "files": files_map([*weights.files, *(bundle.files if bundle else ())]),
            "weights": weights.section, "bundle": bundle.section if bundle else None,
            "runtime": ctx.recipe.normalised()["runtime"]}


def loader_stage(ctx: StageContext) -> StageOutput:
    """Write ``staging/packer_loader.py`` with the embedded manifest, and its runtime beside it."""
    from packer.stub import emit_loader

    return emit_loader(ctx.staging, embedded_manifest(ctx), rel_root=ctx.staging)


def _input_entries(ctx: StageContext) -> list[FileEntry]:
    """sha256 of every source file a stage used, relative to the source root."""
    weights, bundle = ctx.outputs["weights"], ctx.outputs.get("bundle")
    rels = {i["path"] for i in weights.section.get("inputs", [])}
    if bundle is not None:
        rels |= {m["name"] for m in bundle.section.get("members", [])}
    base = ctx.snap.weights.parent if ctx.snap.single_file else ctx.snap.root
    entries = []
    for rel in sorted(rels):
        path = (base / rel).absolute()
        got = ctx.early[path].result() if path in ctx.early else None
        size, digest = got or sha256_file(path)
        entries.append(FileEntry(rel, size, digest))
    return entries


def inputs_stage(ctx: StageContext) -> StageOutput:
    """Pin the inputs; the section is the artifact manifest (everything but the image).

    Most inputs were hashed while the weights stage ran (``ctx.early``); the rest are hashed here.
    """
    inputs = _input_entries(ctx)
    sections = {name: out.section if (out := ctx.outputs.get(name)) else None
                for name in ("weights", "bundle", "loader")}
    if "sign" in ctx.outputs:
        sections["signature"] = ctx.outputs["sign"].section
    manifest = artifact_manifest(recipe=ctx.recipe.normalised(), source=ctx.snap.identity(), inputs=inputs,
                                 files=ctx.artifacts(), sections=sections)
    return StageOutput(section=manifest, bytes_processed=sum(e.size for e in inputs))


def sign_stage(ctx: StageContext) -> StageOutput:
    """Write ``staging/model.sig`` over the model directory, from the embedded manifest's digests.

    The image's model directory also holds packer's own files (the bundle archive, the
    artifact manifest, the loader): the signature lists them as ignored paths, so
    ``model_signing verify key`` on the mounted image checks the model files and nothing else.
    """
    from packer.oci.plan import image_rel
    from packer.sign.keys import load_signing_key
    from packer.sign.model_sig import write_model_signature

    key = load_signing_key(ctx.recipe.sign_key() or "")
    beside = sorted({image_rel(f.path) for f in ctx.artifacts() if not f.path.startswith("weights/")}
                    | {MANIFEST_NAME})
    return write_model_signature(ctx.staging, embedded_manifest(ctx), key, name=ctx.recipe.name, ignore=beside)


def final_manifest(ctx: StageContext) -> dict[str, Any]:
    """``OUT/manifest.json``: the artifact manifest (the inputs stage's) with the image's section and files."""
    image = ctx.outputs["image"]
    return {**ctx.outputs["inputs"].section, "image": image.section, "image_files": files_map(image.files)}


def provenance_stage(ctx: StageContext) -> StageOutput:
    """Write ``staging/provenance.sigstore.json`` for the final manifest, and attach it to the
    image as a referrer of its manifest (``index.json`` gains the entry; the manifest pins the
    index without it, see :mod:`packer.oci.referrer`)."""
    from packer.oci.referrer import attach_provenance
    from packer.sign.keys import load_signing_key
    from packer.sign.provenance import SLSA_PROVENANCE_V1, write_provenance

    out = write_provenance(ctx.staging, final_manifest(ctx), load_signing_key(ctx.recipe.sign_key() or ""))
    attach_provenance(ctx.staging, read_bytes(ctx.staging / out.files[0].path, SIGNATURE, error=SignError),
                      tag=ctx.outputs["image"].section["tag"], predicate_type=SLSA_PROVENANCE_V1)
    return out


def _planned_files(ctx: StageContext) -> list[FileEntry]:
    """The artifact files a dry run would write; a weight file's size is its tensor bytes (the
    header's few KB are not known before it is written), the runtime's files their exact sizes,
    and the files only their writing sizes (:func:`_sized_when_written`) 0."""
    from packer.bundle import ARCHIVE_NAME
    from packer.chunks import CHUNKS_REL
    from packer.components import artifact_files, components_of
    from packer.stub import RUNTIME_DIR, planned_files, runtime_files

    data: dict[str, int] = {f"{RUNTIME_DIR}/{rel}": len(b) for rel, b in runtime_files().items()}
    for section in components_of(ctx.outputs["weights"].section):
        for t in section.get("tensors", {}).values():
            data[t["file"]] = max(data.get(t["file"], 0), t["data_offsets"][1])
    chunks = [CHUNKS_REL] if any(rel.endswith(SAFETENSORS_SUFFIX) for rel in data) else []  # weights re-read in chunks
    names = [*artifact_files(ctx.outputs["weights"].section), *chunks,
             *([ARCHIVE_NAME] if "bundle" in ctx.outputs else []), *planned_files()]
    return [FileEntry(p, data.get(p, 0), "") for p in names]


def _sized_when_written(plan: dict[str, Any], planned_manifest: bytes) -> dict[str, Any]:
    """The dry run's image plan with honest layer sizes: a layer holding a file whose size is
    known only once it is written (the stub, with the manifest embedded; the compressed bundle;
    the manifest; the chunk table) says so, with the bytes known so far, instead of a sum that
    counts those files as empty (or, for the manifest, as the few entries a dry run knows)."""
    from packer.bundle import ARCHIVE_NAME
    from packer.chunks import CHUNKS_NAME
    from packer.stub import LOADER_NAME

    top = plan["prefix"].rstrip("/")
    later = {f"{top}/{name}" for name in (LOADER_NAME, ARCHIVE_NAME, MANIFEST_NAME, CHUNKS_NAME)}
    layers = []
    for layer in plan["layers"]:
        unsized = [f for f in layer["files"] if f in later]
        known = layer["size"] - (len(planned_manifest) if f"{top}/{MANIFEST_NAME}" in unsized else 0)
        layers.append({**layer, "size": None, "known_bytes": known, "sized_when_written": unsized}
                      if unsized else layer)
    return {**plan, "layers": layers}


def _planned_artifact_manifest(ctx: StageContext) -> bytes:
    """What a dry run knows of the artifact manifest: the bundle's members (the image's model files)."""
    bundle = ctx.outputs.get("bundle")
    members = bundle.section["members"] if bundle else []
    return canonical_json({"bundle": {"file": bundle.section["file"], "members": [
        {"name": m["name"], "size": m["size"], "sha256": ""} for m in members]}} if bundle else {})


def image_stage(ctx: StageContext) -> StageOutput:
    """Write the OCI image and Dockerfile around the artifacts and the artifact manifest.

    A dry run plans the image from the planned file names. Otherwise the build verifies the
    whole output once afterwards, so the image is not re-read here.
    """
    from packer.oci import build_image

    common: dict[str, Any] = {"cfg": ctx.recipe.image, "name": ctx.recipe.name, "version": ctx.recipe.version,
                              "source": ctx.snap.identity()}
    if ctx.dry_run:
        from packer.stub import planned_files

        manifest = _planned_artifact_manifest(ctx)
        planned = build_image(ctx.staging, **common, artifact_files=_planned_files(ctx), artifact_manifest=manifest,
                              loader_paths=planned_files(), dry_run=True)
        return replace(planned, section={"plan": _sized_when_written(planned.section["plan"], manifest)})
    return build_image(ctx.staging, **common, artifact_files=ctx.artifacts(),
                       artifact_manifest=canonical_json(ctx.outputs["inputs"].section), verify=False,
                       known_digests=ctx.outputs["weights"].digests,
                       loader_paths=[f.path for f in ctx.outputs["loader"].files])


def _always(ctx: StageContext) -> bool:
    return True


def _has_bundle(ctx: StageContext) -> bool:
    return not ctx.snap.single_file  # a single checkpoint file comes without tokenizer or config


def _writes(ctx: StageContext) -> bool:
    return not ctx.dry_run  # nothing to emit or pin before the files exist


def _signs(ctx: StageContext) -> bool:
    return not ctx.dry_run and ctx.recipe.sign_key() is not None  # only with a key


@dataclass(frozen=True)
class BuildStage:
    """One entry of :data:`STAGES`: the timer's name, the stage, and when it runs."""

    name: str
    run: Stage
    runs_when: Callable[[StageContext], bool] = _always


STAGES: tuple[BuildStage, ...] = (
    BuildStage("weights", weights_stage),
    BuildStage("bundle", bundle_stage, _has_bundle),
    BuildStage("loader", loader_stage, _writes),
    BuildStage("sign", sign_stage, _signs),
    BuildStage("inputs", inputs_stage, _writes),
    BuildStage("image", image_stage),
    BuildStage("provenance", provenance_stage, _signs),
)
"""The stages in build order; each output is in ``ctx.outputs[name]`` for the ones after it."""


def default_layer_digests() -> bool:
    """Whether the weights stage writes each weight layer blob (one copy of the weights): always."""
    return True
