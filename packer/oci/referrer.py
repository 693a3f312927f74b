"""The signed provenance as an OCI 1.1 referrer of the image manifest, in ``OUT/image``.

The layout follows cosign's bundle specification (``specs/BUNDLE_SPEC.md``), which is what
``cosign verify-attestation --new-bundle-format``, sigstore-go and oras read: an image
manifest with ``artifactType`` ``application/vnd.dev.sigstore.bundle.v0.3+json`` (the file is a
Sigstore bundle holding the DSSE envelope, not a bare envelope), the empty config
(``application/vnd.oci.empty.v1+json``, the two bytes ``{}``), one layer whose blob is the bundle
file byte for byte, ``subject`` = the runnable image's manifest descriptor, and the annotations
``dev.sigstore.bundle.content``, ``dev.sigstore.bundle.predicateType`` and
``org.opencontainers.image.created`` (the image's own creation time, so a rebuild writes the
same bytes).

Its index entry has no ``org.opencontainers.image.ref.name``: it is found by its subject, never
picked by tag, so tools that open ``oci:OUT/image:TAG`` see the layout they saw before.

The referrer holds the provenance, whose subjects include the manifest that pins the image
index, so the manifest pins the index as the image stage wrote it; ``index.json`` on disk is
that index with exactly this one entry appended (:func:`referrer_blobs`), and
:func:`check_referrer` proves the entry by rebuilding it from ``OUT``'s provenance file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from packer.errors import ImageError, VerifyError
from packer.oci.base import OCI_INDEX, OCI_MANIFEST, REF_NAME
from packer.oci.base_docs import INDEX, MANIFEST, REFERRER
from packer.oci.warm_layer import without_warm
from packer.reading import OCI_DOC, SIGNATURE, blob_path, parse_json, read_bytes, read_json
from packer.runtime.signature import SIGSTORE_BUNDLE_V03
from packer.util.formats import PROVENANCE_NAME
from packer.util.fsutil import atomic_write_bytes, canonical_json
from packer.util.idents import ErrorClass, shown

ARTIFACT_TYPE = SIGSTORE_BUNDLE_V03
EMPTY_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY = b"{}"
CREATED = "org.opencontainers.image.created"
CONTENT = "dev.sigstore.bundle.content"
PREDICATE_TYPE = "dev.sigstore.bundle.predicateType"


def is_referrer(desc: dict[str, Any]) -> bool:
    """Whether an index entry is a signed-bundle referrer (not an image or a ModelPack view)."""
    return desc.get("artifactType") == ARTIFACT_TYPE


def referrers_tag(digest: str) -> str:
    """The referrers tag schema's tag for a subject: ``sha256:abc…`` -> ``sha256-abc…``."""
    algo, _, hexd = digest.partition(":")
    return f"{algo}-{hexd}"


def _desc(media_type: str, raw: bytes) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": "sha256:" + hashlib.sha256(raw).hexdigest(), "size": len(raw)}


def referrer_manifest(subject: dict[str, Any], bundle: bytes, *, predicate_type: str,
                      created: str) -> dict[str, Any]:
    """The referrer manifest of ``bundle`` (a Sigstore bundle's bytes) for ``subject``.

    Args:
        subject: the image manifest's descriptor (``mediaType``, ``digest``, ``size``).
        bundle: the signed provenance file's bytes (the one layer).
        predicate_type: the in-toto statement's predicate type.
        created: RFC 3339 time (the image's ``org.opencontainers.image.created``).
    """
    return {
        "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": ARTIFACT_TYPE,
        "config": _desc(EMPTY_TYPE, EMPTY), "layers": [_desc(SIGSTORE_BUNDLE_V03, bundle)],
        "subject": {k: subject[k] for k in ("mediaType", "digest", "size")},
        "annotations": {CONTENT: "dsse-envelope", PREDICATE_TYPE: predicate_type, CREATED: created},
    }


def _index_entry(manifest: dict[str, Any]) -> dict[str, Any]:
    return {**_desc(OCI_MANIFEST, canonical_json(manifest)), "artifactType": ARTIFACT_TYPE,
            "annotations": dict(manifest["annotations"])}


def _image(image_dir: Path, index: dict[str, Any], tag: str, err: ErrorClass) -> tuple[dict[str, Any], str]:
    """The tagged image's index entry and its manifest's creation time."""
    found = [d for d in index.get("manifests") or [] if (d.get("annotations") or {}).get(REF_NAME) == tag
             and "artifactType" not in d]
    if len(found) != 1:
        raise err(f"{image_dir / 'index.json'}: expected one image tagged {tag!r}, found {len(found)}")
    blob = blob_path(image_dir, found[0].get("digest"), where=image_dir / "index.json", error=err)
    manifest = read_json(blob, OCI_DOC, error=err, shape=MANIFEST, where=f"{blob}: cannot read the image manifest")
    return found[0], str((manifest.get("annotations") or {}).get(CREATED, ""))


def _read_index(image_dir: Path, err: ErrorClass) -> tuple[bytes, dict[str, Any]]:
    path = image_dir / "index.json"
    where = f"{path}: cannot read the image index"
    raw = read_bytes(path, OCI_DOC, error=err, where=where)
    index = parse_json(raw, OCI_DOC, where=where, error=err, shape=INDEX)
    if index.get("mediaType", OCI_INDEX) != OCI_INDEX:
        raise err(f"{path}: not an OCI image index")
    return raw, index


def attach_provenance(out_dir: Path, bundle: bytes, *, tag: str, predicate_type: str) -> dict[str, Any]:
    """Store ``bundle`` as a referrer of the image tagged ``tag`` and list it in ``index.json``.

    Args:
        out_dir: the (staging) output directory holding ``image/``.
        bundle: the signed provenance file's bytes.
        tag: the runnable image's ref name (the subject).
        predicate_type: the statement's predicate type (an annotation).

    Returns:
        The referrer's index entry.

    Raises:
        ImageError: the layout is unreadable or does not hold one image tagged ``tag``.
    """
    image_dir = Path(out_dir) / "image"
    _, index = _read_index(image_dir, ImageError)
    subject, created = _image(image_dir, index, tag, ImageError)
    manifest = referrer_manifest(subject, bundle, predicate_type=predicate_type, created=created)
    blobs = image_dir / "blobs" / "sha256"
    for raw in (EMPTY, bundle, canonical_json(manifest)):
        atomic_write_bytes(blobs / hashlib.sha256(raw).hexdigest(), raw, 0o644)
    entry = _index_entry(manifest)
    index["manifests"] = [d for d in index["manifests"] if not is_referrer(d)] + [entry]
    atomic_write_bytes(image_dir / "index.json", canonical_json(index), 0o644)
    return entry


def referrer_blobs(out_dir: Path, *, index_digest: str) -> list[str]:
    """The blobs of the referrer ``index.json`` ends with, once the rest is the pinned index.

    Args:
        out_dir: the output directory; ``index_digest``: the manifest's ``image.index_digest``.

    Returns:
        The referrer manifest's blob, then its config's and layers' (paths relative to
        ``out_dir``): outside the manifest, like the provenance; :func:`check_referrer` proves them.

    Raises:
        VerifyError: the index is not the pinned one plus one referrer at its end.
    """
    image_dir = Path(out_dir) / "image"
    where = image_dir / "index.json"
    raw, index = _read_index(image_dir, VerifyError)
    canonical = raw == canonical_json(index)
    index = without_warm(index)  # warm states' images come after the build (packer.oci.warm_layer)
    manifests = list(index.get("manifests") or [])
    if not canonical or not manifests or not is_referrer(manifests[-1]):
        raise VerifyError(f"{where}: does not end with the provenance referrer (a signed build's index does)")
    pinned = canonical_json({**index, "manifests": manifests[:-1]})
    if "sha256:" + hashlib.sha256(pinned).hexdigest() != index_digest:
        raise VerifyError(f"{where}: without the provenance referrer, differs from the manifest's image index")
    blob = blob_path(image_dir, manifests[-1].get("digest"), where=where, error=VerifyError)
    manifest = read_json(blob, OCI_DOC, error=VerifyError, shape=REFERRER,
                         where=f"{where}: the provenance referrer is unreadable: {blob}")
    descs = [manifest["config"], *manifest["layers"]]
    paths = [blob, *(blob_path(image_dir, d["digest"], where=blob, error=VerifyError) for d in descs)]
    return [p.relative_to(out_dir).as_posix() for p in paths]


def check_referrer(out_dir: Path, bundle: bytes, *, tag: str, predicate_type: str) -> None:
    """The referrer ``index.json`` ends with is the one of ``bundle`` for the image tagged ``tag``.

    Args:
        out_dir: the output directory; ``bundle``: ``OUT``'s provenance file's bytes.
        tag: the image's tag; ``predicate_type``: the provenance's predicate type.

    Raises:
        VerifyError: the referrer, or one of its blobs, differs from the one ``bundle`` makes.
    """
    image_dir = Path(out_dir) / "image"
    where = image_dir / "index.json"
    _, index = _read_index(image_dir, VerifyError)
    index = without_warm(index)
    subject, created = _image(image_dir, index, tag, VerifyError)
    want = referrer_manifest(subject, bundle, predicate_type=predicate_type, created=created)
    got = (index.get("manifests") or [{}])[-1]
    if got != _index_entry(want):
        raise VerifyError(f"{where}: the referrer {shown(got.get('digest'))} is not the one of "
                          f"{Path(out_dir) / PROVENANCE_NAME} for the image {subject['digest']}")
    for blob in (EMPTY, bundle, canonical_json(want)):
        path = image_dir / "blobs" / "sha256" / hashlib.sha256(blob).hexdigest()
        try:
            same = read_bytes(path, OCI_DOC if blob != bundle else SIGNATURE, error=VerifyError) == blob
        except VerifyError:
            same = False
        if not same:
            raise VerifyError(f"{path}: missing or not the provenance referrer's blob")
