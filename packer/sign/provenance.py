"""``provenance.sigstore.json``: the build's SLSA provenance, signed with the build's key.

An in-toto statement (v1) with a SLSA provenance v1 predicate, in the same key-signed
Sigstore bundle as ``model.sig``. Everything in it comes from the final manifest:

* subjects: every output file by its sha256 (the artifacts, ``model.sig``, the image
  layout's files but ``index.json``, which lists this provenance's referrer), ``manifest.json``
  itself, and the image manifest under the image's tag;
* ``buildDefinition``: the recipe as built (``externalParameters``) and its digest, the
  source and its revision, every input file's sha256, the base image's digest;
* ``runDetails.builder.version``: packer's and the tools' versions.

No time stamps: a rebuild gives the same statement, and with the same key the same bytes.
The provenance cannot list itself, so it stays outside the manifest (which names it), and
it is checked against the manifest it describes (:mod:`packer.sign.check`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from packer.runtime.signature import INTOTO_STATEMENT
from packer.sign.keys import SigningKey, signed_bundle
from packer.stage import StageOutput
from packer.util.formats import MANIFEST_NAME, PROVENANCE_NAME
from packer.util.fsutil import FileEntry, atomic_write_bytes, canonical_json

SLSA_PROVENANCE_V1 = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "https://pypi.org/project/model-packer/#packer-build-v1"
BUILDER_ID = "https://pypi.org/project/model-packer/"
INDEX_REL = "image/index.json"


def _subject(name: str, digest: str) -> dict[str, Any]:
    return {"name": name, "digest": {"sha256": digest.removeprefix("sha256:")}}


def provenance_subjects(manifest: dict[str, Any], manifest_sha256: str) -> list[dict[str, Any]]:
    """Every output by digest: the manifest's files and image files (but the image index), the
    manifest, the image.

    Args:
        manifest: the final ``OUT/manifest.json``.
        manifest_sha256: sha256 (hex) of its bytes.
    """
    files = {**manifest["files"], **manifest.get("image_files", {})}
    files.pop(INDEX_REL, None)  # on disk it also lists this provenance's referrer: it cannot be a subject
    subjects = [_subject(rel, entry["sha256"]) for rel, entry in sorted(files.items())]
    subjects.append(_subject(MANIFEST_NAME, manifest_sha256))
    image = manifest.get("image") or {}
    if image.get("manifest_digest"):
        subjects.append(_subject(image["tag"], image["manifest_digest"]))
    return subjects


def _dependencies(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    source = manifest["source"]
    recipe = hashlib.sha256(canonical_json(manifest["recipe"])).hexdigest()  # the recipe as built, canonical
    deps: list[dict[str, Any]] = [{"name": "recipe", "mediaType": "application/json", "digest": {"sha256": recipe}}]
    origin: dict[str, Any] = {"name": "source", "uri": source["uri"]}
    if source.get("revision"):
        origin["annotations"] = {"revision": source["revision"]}
        if len(source["revision"]) == 40 and all(c in "0123456789abcdef" for c in source["revision"]):
            origin["digest"] = {"gitCommit": source["revision"]}
    deps.append(origin)
    deps += [{"name": rel, "digest": {"sha256": entry["sha256"]}} for rel, entry in sorted(source["files"].items())]
    base = (manifest.get("image") or {}).get("base")
    if base:
        deps.append({"name": "base image", "uri": base["name"],
                     "digest": {"sha256": base["digest"].removeprefix("sha256:")}})
    return deps


def provenance_statement(manifest: dict[str, Any], manifest_sha256: str) -> dict[str, Any]:
    """The in-toto statement (SLSA provenance v1) of the build ``manifest`` describes."""
    versions = {"model-packer": manifest["packer_version"],
                **{tool: v for tool, v in sorted(manifest.get("tools", {}).items()) if v}}
    return {
        "_type": INTOTO_STATEMENT,
        "subject": provenance_subjects(manifest, manifest_sha256),
        "predicateType": SLSA_PROVENANCE_V1,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {"recipe": manifest["recipe"],
                                       "source": {"uri": manifest["source"]["uri"],
                                                  "revision": manifest["source"].get("revision")}},
                "resolvedDependencies": _dependencies(manifest),
            },
            "runDetails": {"builder": {"id": BUILDER_ID, "version": versions}},
        },
    }


def write_provenance(out_dir: Path, manifest: dict[str, Any], key: SigningKey) -> StageOutput:
    """Write ``out_dir/provenance.sigstore.json`` for the final manifest.

    Args:
        out_dir: the build's (staging) output directory.
        manifest: the final manifest (its canonical JSON is ``manifest.json``'s bytes).
        key: the signing key (the same as ``model.sig``'s).

    Returns:
        the stage output (the provenance file; it is not part of the manifest).
    """
    raw = canonical_json(manifest)
    data = signed_bundle(key, provenance_statement(manifest, hashlib.sha256(raw).hexdigest()))
    atomic_write_bytes(Path(out_dir) / PROVENANCE_NAME, data)
    entry = FileEntry(PROVENANCE_NAME, len(data), hashlib.sha256(data).hexdigest())
    return StageOutput(files=(entry,), bytes_processed=len(data))
