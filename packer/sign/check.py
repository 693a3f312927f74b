"""What ``packer verify`` checks of a signed build: the statements, and with a key, the signatures.

:func:`check_signatures` is the build side's one entry point for a build's signatures; every
signature file is opened by :func:`packer.signed.open_signature` (the warm state's ``state.sig``
too, :mod:`packer.warm.trust`), which turns the runtime's refusals into ``VerifyError``.

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
from pathlib import Path
from typing import Any

from packer.errors import VerifyError
from packer.oci.referrer import check_referrer
from packer.reading import MANIFEST, read_bytes
from packer.runtime.signature import digest_difference, model_files, signed_digests
from packer.sign.keys import load_public_key
from packer.sign.provenance import SLSA_PROVENANCE_V1, provenance_subjects
from packer.signed import open_signature, translated
from packer.util.formats import MANIFEST_NAME, PROVENANCE_NAME, SIGNATURE_NAME


def check_signatures(out: Path, manifest: dict[str, Any], *, public_key: Path | None = None) -> None:
    """Check a build's signatures: the build side's one entry point (``packer verify``, the
    build's final check).

    ``model.sig`` and the provenance describe exactly what ``manifest`` pins, and the image's
    provenance referrer is OUT's provenance file for the image it pins. With ``public_key``
    both also verify with it: ``model.sig`` by model_signing's own verifier, the provenance's
    DSSE signature with ``cryptography``.

    Args:
        out: the build output; manifest: its ``manifest.json``, parsed.
        public_key: a PEM public key's path, or None (the statements only).

    Raises:
        VerifyError: with a key, the build is not signed; a statement is missing, malformed,
            or names other files or digests; a signature does not verify.
        DependencyError: a key is given and the ``sign`` extra is not installed.
    """
    if not manifest.get("signature"):
        if public_key is not None:
            raise VerifyError(f"{out / MANIFEST_NAME}: the build is not signed (built without --sign-key)")
        return
    pem = load_public_key(public_key, VerifyError) if public_key is not None else None
    sig, prov = out / SIGNATURE_NAME, out / PROVENANCE_NAME
    _, sig_statement = _open(sig)  # model_signing opens it itself: a regular file, bounded, first
    if public_key is not None:
        _same_files(_model_signing_verify(sig, public_key), manifest, sig)
    with translated(VerifyError):
        signed = signed_digests(sig_statement, str(sig))
    _same_files(signed, manifest, sig)
    bundle, statement = _open(prov, public_key=public_key, pem=pem)
    _check_subjects(statement, out, manifest, str(prov))
    if manifest.get("image"):
        check_referrer(out, bundle, tag=manifest["image"]["tag"], predicate_type=SLSA_PROVENANCE_V1)


def _open(path: Path, *, public_key: Path | None = None, pem: bytes | None = None) -> tuple[bytes, dict[str, Any]]:
    return open_signature(path, error=VerifyError, missing=f"{path}: missing; the manifest says the build is signed",
                          public_key=public_key, pem=pem)


def _same_files(signed: dict[str, str], manifest: dict[str, Any], sig: Path) -> None:
    problem = digest_difference(signed, model_files(manifest), str(sig), "the manifest")
    if problem:
        raise VerifyError(problem)


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
