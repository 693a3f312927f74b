"""What ``packer verify`` checks of a signed build: the statements, and with a key, the signatures.

Without a key (every ``packer verify``, and the build's own final check) the two statements
are read unverified and must describe exactly what the manifest pins: ``model.sig`` every
file of the model directory with the manifest's digest, the provenance every output. That
catches a stale or swapped signature file but proves nothing about who signed it.

With ``--public-key PUB``, ``model.sig`` is verified by the ``model_signing`` library's own
key verifier (the code ``model_signing verify key`` runs: bundle, key hint, DSSE signature,
payload, root digest), and the provenance's DSSE signature with ``cryptography``. The files
themselves were hashed by verify already, so nothing is read twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from pathlib import Path
from typing import Any

from packer.errors import VerifyError
from packer.formats import MANIFEST_NAME, PROVENANCE_NAME, SIGNATURE_NAME
from packer.oci.referrer import check_referrer
from packer.reading import MANIFEST, Kind, parse_json, read_bytes
from packer.runtime.env import ArtifactMismatchError
from packer.runtime.signature import (
    MAX_SIGNED_BYTES,
    digest_difference,
    model_files,
    open_signed,
    read_bundle,
    signed_digests,
    statement_of,
)
from packer.sign.keys import load_public_key
from packer.sign.provenance import SLSA_PROVENANCE_V1, provenance_subjects

_SIGNED = Kind("signature file", MAX_SIGNED_BYTES, 32)  # a Sigstore bundle nests 5 deep, its statement 6


def _read(path: Path) -> bytes:
    """A signature file's bytes (a regular file, bounded) whose JSON, and its payload's, nest
    within bounds: the statement parsers after this never meet a parser bomb."""
    if not os.path.lexists(path):
        raise VerifyError(f"{path}: missing; the manifest says the build is signed")
    data = read_bytes(path, _SIGNED, error=VerifyError)
    parse_json(data, _SIGNED, where=str(path), error=VerifyError)
    try:
        payload = read_bundle(data, str(path))[0]
    except ArtifactMismatchError:
        return data  # the caller reads it again and reports what is wrong
    parse_json(payload, _SIGNED, where=f"{path}: the signed payload", error=VerifyError)
    return data


def _check_subjects(statement: dict[str, Any], out: Path, manifest: dict[str, Any], where: str) -> None:
    if statement.get("predicateType") != SLSA_PROVENANCE_V1:
        raise VerifyError(f"{where}: predicate {statement.get('predicateType')!r}; expected {SLSA_PROVENANCE_V1!r}")
    raw = read_bytes(out / MANIFEST_NAME, MANIFEST, error=VerifyError)
    want = {s["name"]: s["digest"]["sha256"] for s in provenance_subjects(manifest, hashlib.sha256(raw).hexdigest())}
    try:
        got = {s["name"]: s["digest"]["sha256"] for s in statement["subject"]}
    except (KeyError, TypeError) as e:
        raise VerifyError(f"{where}: malformed subjects ({type(e).__name__}: {e})") from None
    problem = digest_difference(got, want, where, "the build", verb="name")
    if problem:
        raise VerifyError(problem)


def check_signed_outputs(out: Path, manifest: dict[str, Any]) -> None:
    """Without a key: ``model.sig`` and the provenance describe exactly what ``manifest`` pins,
    and the image's provenance referrer is OUT's provenance file for the image it pins.

    Raises:
        VerifyError: a statement is missing, malformed, or names other files or digests.
    """
    sig = out / SIGNATURE_NAME
    prov = out / PROVENANCE_NAME
    try:
        signed = signed_digests(statement_of(read_bundle(_read(sig), str(sig))[0], str(sig)), str(sig))
        provenance = statement_of(read_bundle(_read(prov), str(prov))[0], str(prov))
    except ArtifactMismatchError as e:
        raise VerifyError(str(e)) from None
    problem = digest_difference(signed, model_files(manifest), str(sig), "the manifest")
    if problem:
        raise VerifyError(problem)
    _check_subjects(provenance, out, manifest, str(prov))
    if manifest.get("image"):
        check_referrer(out, _read(prov), tag=manifest["image"]["tag"], predicate_type=SLSA_PROVENANCE_V1)


def _model_signing_verify(sig: Path, public_key: Path) -> dict[str, str]:
    """``{name: sha256}`` that ``model.sig`` signs, verified by model_signing's key verifier."""
    from packer.sign.keys import require_sign_extra

    require_sign_extra()
    from cryptography.exceptions import InvalidSignature
    from model_signing._signing import sign_ec_key, sign_sigstore_pb

    try:  # the library prints a warning for bundles without a key hint: library code does not print
        with contextlib.redirect_stdout(io.StringIO()):
            verified = sign_ec_key.Verifier(public_key).verify(sign_sigstore_pb.Signature.read(sig))
    except InvalidSignature:
        raise VerifyError(f"{sig}: the signature does not verify with {public_key} "
                          "(model_signing: invalid signature)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise VerifyError(f"{sig}: model_signing refuses it with {public_key}: {str(e).strip()}") from None
    return {rd.identifier: rd.digest.digest_hex for rd in verified.resource_descriptors()
            if rd.digest.algorithm == "sha256"}


def verify_signatures(out: Path, manifest: dict[str, Any], public_key: Path) -> None:
    """``model.sig`` and the provenance verify with ``public_key`` and describe ``manifest``.

    Raises:
        VerifyError: the build is not signed, a signature does not verify, or a statement
            names other files or digests than the manifest.
        DependencyError: the ``sign`` extra is not installed.
    """
    if not manifest.get("signature"):
        raise VerifyError(f"{out / MANIFEST_NAME}: the build is not signed (built without --sign-key)")
    pem = load_public_key(public_key, VerifyError)
    sig = out / SIGNATURE_NAME
    _read(sig)  # model_signing opens it itself: a regular file, bounded, first
    problem = digest_difference(_model_signing_verify(sig, public_key), model_files(manifest), str(sig),
                                "the manifest")
    if problem:
        raise VerifyError(problem)
    prov = out / PROVENANCE_NAME
    try:
        statement = open_signed(_read(prov), pem, str(prov), key_name=str(public_key))
    except ArtifactMismatchError as e:
        raise VerifyError(str(e)) from None
    _check_subjects(statement, out, manifest, str(prov))
