"""The build's OpenSSF model signature, checked where the model is served.

A signed build holds ``model.sig`` beside the loader: a Sigstore bundle (v0.3) whose DSSE
envelope carries an in-toto statement of the ``model_signing`` v1.0 predicate, listing every
file of the model directory (:func:`model_files`) with its sha256. ``model_signing verify
key`` checks it on a model directory; this module checks it with the same rules and, in
addition, against the manifest embedded in the loader, so ``PACKER_REQUIRE_SIGNATURE=PUB``
can refuse a build the key did not sign without re-reading anything but ``model.sig``.

:func:`require_signature` is the runtime's one signature check (the loader, and the engine
gate for the files it serves); the functions before it are its steps, which the build side
reuses (``packer.signed``) rather than restating the format.

The ECDSA check needs the ``cryptography`` package, imported only when a signature is
checked: the loader itself still runs on the standard library, torch and zstandard.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .chunks import table_in_tree
from .components import model_tree
from .env import ArtifactMismatchError
from .reading import CAPS, loads_json, read_bytes

SIGNATURE_FILE = "model.sig"
SIGSTORE_BUNDLE_V03 = "application/vnd.dev.sigstore.bundle.v0.3+json"
INTOTO_PAYLOAD = "application/vnd.in-toto+json"
INTOTO_STATEMENT = "https://in-toto.io/Statement/v1"
MODEL_SIGNING_PREDICATE = "https://model_signing/signature/v1.0"
MAX_SIGNED_BYTES = CAPS["signature"]  # a statement lists one line per file: far below this
# the curves model_signing verifies, and the hash each signs with (the signer uses this table too)
CURVE_HASHES = {"secp256r1": "SHA256", "secp384r1": "SHA384", "secp521r1": "SHA512"}


def model_layout(manifest: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """The build's model directory: every file's name, where it comes from, and its sha256.

    The layout ``model_dir()`` makes (``packer.runtime.dirtree``) and the plain model
    directory shipped beside the loader: the bundle's members at their relative paths, each
    weight file at its place in the build's model tree (``model.safetensors``, or a
    component's ``unet/diffusion_pytorch_model.safetensors``) and the chunk table
    (``packer-chunks.json``, :mod:`.chunks`: so ``model.sig`` signs it), a weight file winning
    over a member of the same name. ``model.sig`` itself is never part of it. Every digest comes from
    the manifest: nothing is hashed here.

    Args:
        manifest: a build manifest (the loader's embedded one or ``OUT/manifest.json``).

    Returns:
        ``{relative posix path: (origin, sha256 hex)}`` sorted by path; ``origin`` is the
        artifact's path in OUT (``weights/model.safetensors``), or "" for a bundle member.

    Raises:
        ValueError: the manifest's model tree names a path outside the directory.
    """
    pairs = [*model_tree(manifest["weights"]), *table_in_tree(manifest["weights"])]
    out = {dst: (rel, manifest["files"][rel]["sha256"]) for dst, rel in pairs}
    for member in (manifest.get("bundle") or {}).get("members", []):
        if member["name"] not in out and member["name"] != SIGNATURE_FILE:
            out[member["name"]] = ("", member["sha256"])
    return dict(sorted(out.items()))


def model_files(manifest: Mapping[str, Any]) -> dict[str, str]:
    """``{name: sha256 hex}`` of the model directory's files (:func:`model_layout`): what
    ``model.sig`` signs."""
    return {name: digest for name, (_, digest) in model_layout(manifest).items()}


def dsse_pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding: the bytes a DSSE signature is made over."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def _public_key(pem: bytes, where: str) -> Any:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        key = serialization.load_pem_public_key(pem)
    except ValueError as e:
        raise ArtifactMismatchError(f"{where}: not a PEM public key ({e})") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in CURVE_HASHES:
        raise ArtifactMismatchError(f"{where}: expected an EC public key on P-256, P-384 or P-521")
    return key


def public_key_hint(key: Any) -> str:
    """sha256 (hex) of the key's PEM SubjectPublicKeyInfo: the bundle's ``publicKey.hint``."""
    from cryptography.hazmat.primitives import serialization

    spki = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(spki).hexdigest()


def read_bundle(data: bytes, where: str) -> tuple[bytes, bytes, str]:
    """``(payload, signature, key hint)`` of a key-signed Sigstore bundle of an in-toto
    payload, not yet verified.

    Raises:
        ArtifactMismatchError: not such a bundle.
    """
    try:
        bundle = loads_json(data, where)
    except ArtifactMismatchError as e:
        raise ArtifactMismatchError(f"{where}: not a key-signed Sigstore bundle ({str(e)[len(where) + 2:]})") from None
    try:
        env = bundle["dsseEnvelope"]
        payload = base64.b64decode(env["payload"], validate=True)
        sig = base64.b64decode(env["signatures"][0]["sig"], validate=True)
        kind, media, hint = env["payloadType"], bundle["mediaType"], bundle["verificationMaterial"]["publicKey"]["hint"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ArtifactMismatchError(f"{where}: not a key-signed Sigstore bundle ({type(e).__name__}: {e})") from None
    if media != SIGSTORE_BUNDLE_V03 or kind != INTOTO_PAYLOAD:
        raise ArtifactMismatchError(f"{where}: a {media!r} bundle of {kind!r}; expected {SIGSTORE_BUNDLE_V03!r} "
                                    f"of {INTOTO_PAYLOAD!r}")
    return payload, sig, str(hint or "")


def statement_of(payload: bytes, where: str) -> dict[str, Any]:
    """The in-toto v1 statement in a bundle's payload.

    Raises:
        ArtifactMismatchError: the payload is not one.
    """
    try:
        statement = loads_json(payload, f"{where}: the signed payload")
    except ArtifactMismatchError:
        statement = None
    if not isinstance(statement, dict) or statement.get("_type") != INTOTO_STATEMENT:
        raise ArtifactMismatchError(f"{where}: the signed payload is not an in-toto {INTOTO_STATEMENT} statement")
    return statement


def open_signed(data: bytes, public_pem: bytes, where: str, *, key_name: str = "the public key") -> dict[str, Any]:
    """The in-toto statement of a key-signed Sigstore bundle, after its signature verified.

    Args:
        data: the bundle file's bytes (``model.sig``, the provenance).
        public_pem: the PEM public key it must verify with.
        where: the bundle's name for messages.
        key_name: the key's name for messages (its path).

    Returns:
        the statement (``_type``, ``subject``, ``predicateType``, ``predicate``).

    Raises:
        ArtifactMismatchError: not such a bundle, signed by another key, or changed.
        ImportError: the cryptography package is missing.
    """
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = _public_key(public_pem, key_name)
    payload, sig, hint = read_bundle(data, where)
    if hint and hint != public_key_hint(key):
        raise ArtifactMismatchError(f"{where}: signed by another key than {key_name} (key hint {hint[:16]!r}...)")
    try:
        key.verify(sig, dsse_pae(INTOTO_PAYLOAD, payload), ec.ECDSA(getattr(hashes, CURVE_HASHES[key.curve.name])()))
    except InvalidSignature:
        raise ArtifactMismatchError(f"{where}: the signature does not verify with {key_name} "
                                    "(the statement was changed after signing)") from None
    return statement_of(payload, where)


def signed_digests(statement: Mapping[str, Any], where: str) -> dict[str, str]:
    """``{name: sha256 hex}`` of a model-signing v1.0 statement, its root digest checked.

    Raises:
        ArtifactMismatchError: another predicate, a digest other than sha256, a repeated
            name, or resources that do not hash to the subject's root digest.
    """
    if statement.get("predicateType") != MODEL_SIGNING_PREDICATE:
        raise ArtifactMismatchError(f"{where}: predicate {statement.get('predicateType')!r}; "
                                    f"expected {MODEL_SIGNING_PREDICATE!r}")
    try:
        resources = statement["predicate"]["resources"]
        root = statement["subject"][0]["digest"]["sha256"]
        pairs = [(r["name"], r["algorithm"], r["digest"]) for r in resources]
        raw = b"".join(bytes.fromhex(d) for _, _, d in pairs)
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise ArtifactMismatchError(f"{where}: malformed model-signing statement ({type(e).__name__}: {e})") from None
    other = [algo for _, algo, _ in pairs if algo != "sha256"]
    if other:
        raise ArtifactMismatchError(f"{where}: signs {other[0]} digests; packer pins sha256")
    digests = {name: digest for name, _, digest in pairs}
    if len(digests) != len(pairs):
        raise ArtifactMismatchError(f"{where}: names a file twice")
    if hashlib.sha256(raw).hexdigest() != root:
        raise ArtifactMismatchError(f"{where}: the resources do not hash to the signed root digest")
    return digests


def digest_difference(signed: Mapping[str, str], pinned: Mapping[str, str], where: str, pinner: str, *,
                      verb: str = "sign") -> str | None:
    """The first difference between the signed and the pinned ``{name: sha256}``, in words.

    ``verb`` is what ``where`` does with a name: ``sign`` (a signature's statement), ``name``
    (the provenance's subjects)."""
    for name in sorted(set(signed) | set(pinned)):
        if name not in signed:
            return f"{where}: does not {verb} {name}, which {pinner} holds"
        if name not in pinned:
            return f"{where}: {verb}s {name}, which {pinner} does not hold"
        if signed[name] != pinned[name]:
            return (f"{where}: {verb}s {name} with sha256 {signed[name][:16]}..., "
                    f"{pinner} pins {pinned[name][:16]}...")
    return None


UNSIGNED_HELP = "docs/troubleshooting.md#a-build-refused-under-packer_require_signature"


def read_public_key(public_key: str) -> bytes:
    """The PEM bytes of ``PACKER_REQUIRE_SIGNATURE``'s key file.

    Raises:
        ArtifactMismatchError: missing, not a regular file, over 64 KiB or unreadable.
    """
    try:
        return read_bytes(public_key, "key")
    except (OSError, ArtifactMismatchError) as e:
        why = e.strerror if isinstance(e, OSError) else str(e)
        raise ArtifactMismatchError(f"PACKER_REQUIRE_SIGNATURE={public_key}: cannot read the public key "
                                    f"({why or e})") from None


def require_signature(root: str | Path, public_key: str, *,
                      manifest: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Prove ``root/model.sig`` with ``public_key`` (``PACKER_REQUIRE_SIGNATURE``): the runtime's
    one signature check.

    Args:
        root: the build's directory (the one holding ``model.sig``).
        public_key: the PEM public key's path.
        manifest: the manifest the signature must sign exactly (every file of its model
            directory with its digest, and no other: the loader's embedded one); None: the
            caller compares what is signed itself (the served directory's files).

    Returns:
        ``{name: sha256 hex}`` that ``model.sig`` signs.

    Raises:
        ArtifactMismatchError: the key cannot be read; ``model.sig`` is missing, not a regular
            file, over the cap, not a key-signed bundle, does not verify, or signs other files
            or digests than ``manifest``.
        ImportError: the cryptography package is missing.
    """
    pem = read_public_key(public_key)
    where = str(Path(root).absolute() / SIGNATURE_FILE)
    try:
        data = read_bytes(where, "signature")
    except FileNotFoundError:
        raise ArtifactMismatchError(f"{where}: missing, and PACKER_REQUIRE_SIGNATURE asks for a build signed "
                                    f"with packer build --sign-key (see {UNSIGNED_HELP})") from None
    signed = signed_digests(open_signed(data, pem, where, key_name=public_key), where)
    problem = None if manifest is None else digest_difference(signed, model_files(manifest), where,
                                                              "this loader's manifest")
    if problem:
        raise ArtifactMismatchError(problem)
    return signed
