"""``model.sig``: the OpenSSF model signature over the build's model directory.

The statement is the ``model_signing`` library's own (v1.0 predicate, ``files``
serialization with sha256, resources sorted as the library sorts them, the root digest over
them), made by the library from a manifest of precomputed digests: its ``Manifest`` takes
``(path, digest)`` items, so packer hands it the manifest's sha256 of every file of the
model directory (:func:`packer.runtime.signature.model_files`) and nothing is hashed again.
Only the signing itself is packer's (:mod:`packer.sign.keys` says why). ``model.sig`` is in
the signature's own ``ignore_paths``, so it may lie inside the directory it signs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from packer.runtime.signature import MODEL_SIGNING_PREDICATE, model_files
from packer.sign.keys import SigningKey, require_sign_extra, signed_bundle
from packer.stage import StageOutput
from packer.util.formats import PROVENANCE_NAME, SIGNATURE_NAME
from packer.util.fsutil import FileEntry, atomic_write_bytes


def model_statement(name: str, files: Mapping[str, str], ignore: Sequence[str] = ()) -> dict[str, Any]:
    """The ``model_signing`` v1.0 in-toto statement of a model directory, from its digests.

    Args:
        name: the model's name (the statement's subject name; informative only).
        files: ``{relative posix path: sha256 hex}`` of every file in the directory.
        ignore: other paths in the directory that are not signed (besides ``model.sig``).

    Returns:
        the statement as JSON-able data, exactly as the library builds it.

    Raises:
        DependencyError: the ``sign`` extra is not installed.
    """
    require_sign_extra()
    from google.protobuf import json_format
    from model_signing import manifest as ms_manifest
    from model_signing._hashing.hashing import Digest
    from model_signing._signing.signing import Payload

    serialization = ms_manifest.SerializationType.from_args(
        {"method": "files", "hash_type": "sha256", "allow_symlinks": False, "ignore_paths": [SIGNATURE_NAME, *ignore]})
    items = [serialization.new_item(path, Digest("sha256", bytes.fromhex(digest))) for path, digest in files.items()]
    statement = Payload(ms_manifest.Manifest(name, items, serialization)).statement
    data: dict[str, Any] = json_format.MessageToDict(statement.pb)
    return data


def write_model_signature(out_dir: Path, manifest: Mapping[str, Any], key: SigningKey, *,
                          name: str, ignore: Sequence[str] = ()) -> StageOutput:
    """Write ``out_dir/model.sig`` over the model directory ``manifest`` describes.

    Args:
        out_dir: the build's (staging) output directory.
        manifest: a manifest with the ``files``, ``weights`` and ``bundle`` sections (the
            loader's embedded one).
        key: the signing key.
        name: the model's name.
        ignore: packer's own files that lie beside the model files in the image's model
            directory (the bundle archive, the manifest, the loader), left unsigned.

    Returns:
        the stage output: ``model.sig`` and the manifest's ``signature`` section
        (``file``, ``predicate``, ``files``, ``root_digest``, ``public_key_sha256``, ``provenance``).

    Raises:
        DependencyError: the ``sign`` extra is not installed.
    """
    files = model_files(manifest)
    statement = model_statement(name, files, ignore)
    data = signed_bundle(key, statement)
    atomic_write_bytes(Path(out_dir) / SIGNATURE_NAME, data)
    section = {"file": SIGNATURE_NAME, "predicate": MODEL_SIGNING_PREDICATE, "files": len(files),
               "root_digest": "sha256:" + statement["subject"][0]["digest"]["sha256"],
               "public_key_sha256": key.hint, "provenance": PROVENANCE_NAME}
    entry = FileEntry(SIGNATURE_NAME, len(data), hashlib.sha256(data).hexdigest())
    return StageOutput(files=(entry,), section=section, bytes_processed=len(data))
