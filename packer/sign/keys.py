"""The signing key, and the key-signed Sigstore bundle both of packer's signatures are.

The key is a PEM private key on a curve ``model_signing`` verifies (P-256, P-384, P-521),
unencrypted or encrypted with the password in ``PACKER_SIGN_KEY_PASSWORD`` (a CI secret,
never the recipe). The bundle is what ``model_signing``'s own key signer writes (media type
v0.3, the public key named by its hash, a DSSE envelope of an in-toto statement), with one
difference that is the reason packer signs itself rather than through the library's signer:
the ECDSA signature is deterministic (RFC 6979), so a rebuild of the same inputs with the
same key gives the same ``model.sig``, the same manifest and the same image digest. The
library's signer draws a random nonce, which would make every signed build different.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packer.errors import DependencyError, SignError
from packer.reading import KEY, read_bytes
from packer.runtime.signature import CURVE_HASHES, INTOTO_PAYLOAD, SIGSTORE_BUNDLE_V03, dsse_pae, public_key_hint
from packer.util.fsutil import canonical_json
from packer.util.idents import ErrorClass

PASSWORD_ENV = "PACKER_SIGN_KEY_PASSWORD"
EXTRA = "pip install 'model-packer[sign]'"


def require_sign_extra() -> None:
    """Raises DependencyError: the ``sign`` extra (model-signing and pyOpenSSL) is not installed."""
    try:
        import model_signing.manifest  # noqa: F401  (its package imports pyOpenSSL, undeclared)
    except ImportError as e:
        raise DependencyError(f"signing needs the sign extra: {e} ({EXTRA})") from e


@dataclass(frozen=True)
class SigningKey:
    """A loaded private key.

    Attributes:
        path: the PEM file it was read from (for messages).
        private: the ``cryptography`` EC private key.
        hint: sha256 (hex) of its public key's PEM, as the bundle names it.
    """

    path: Path
    private: Any
    hint: str

    def sign(self, data: bytes) -> bytes:
        """A deterministic (RFC 6979) DER ECDSA signature of ``data`` with the curve's hash."""
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec

        algorithm = getattr(hashes, CURVE_HASHES[self.private.curve.name])()
        return bytes(self.private.sign(data, ec.ECDSA(algorithm, deterministic_signing=True)))


def load_signing_key(path: str | Path) -> SigningKey:
    """Read a PEM EC private key (password from ``PACKER_SIGN_KEY_PASSWORD`` when encrypted).

    Raises:
        SignError: unreadable, not a PEM private key, wrong or missing password, another
            kind of key or curve.
        DependencyError: the ``sign`` extra is not installed.
    """
    require_sign_extra()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    path = Path(path)
    pem = read_bytes(path, KEY, error=SignError, what="the signing key")
    password = os.environ.get(PASSWORD_ENV)
    try:
        key = serialization.load_pem_private_key(pem, password.encode() if password else None)
    except TypeError as e:  # encrypted without a password, or a password for a plain key
        raise SignError(f"{path}: {e} (the password is read from {PASSWORD_ENV})") from e
    except ValueError as e:
        raise SignError(f"{path}: not a usable PEM private key ({e})") from e
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name not in CURVE_HASHES:
        kind = getattr(getattr(key, "curve", None), "name", None) or type(key).__name__
        raise SignError(f"{path}: a {kind} key; model_signing verifies EC keys on P-256, P-384 or P-521 "
                        "(openssl ecparam -genkey -name prime256v1 -noout | openssl pkcs8 -topk8 -nocrypt)")
    return SigningKey(path, key, public_key_hint(key.public_key()))


def load_public_key(path: Path, error: ErrorClass) -> bytes:
    """The PEM bytes of the EC public key at ``path`` (P-256, P-384 or P-521), checked.

    Raises:
        error: unreadable, not a PEM public key, or another kind of key or curve (an RSA or
            Ed25519 key: one line saying which keys are accepted).
        DependencyError: the ``sign`` extra is not installed.
    """
    require_sign_extra()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pem = read_bytes(path, KEY, error=error, what="the public key")
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as e:
        raise error(f"{path}: not a PEM public key ({str(e).strip()[:120]})") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in CURVE_HASHES:
        kind = key.curve.name if isinstance(key, ec.EllipticCurvePublicKey) else \
            type(key).__name__.lstrip("_").removesuffix("PublicKey")
        raise error(f"{path}: the key is {kind}; model.sig and the provenance verify with EC public keys on "
                    "P-256, P-384 or P-521 only (the public half of packer's --sign-key)")
    return pem


def public_pem(key: SigningKey) -> bytes:
    """The PEM SubjectPublicKeyInfo of ``key``'s public half (what verifiers are given)."""
    from cryptography.hazmat.primitives import serialization

    return bytes(key.private.public_key().public_bytes(serialization.Encoding.PEM,
                                                       serialization.PublicFormat.SubjectPublicKeyInfo))


def signed_bundle(key: SigningKey, statement: dict[str, Any]) -> bytes:
    """A Sigstore bundle (v0.3) holding ``statement`` in a DSSE envelope signed by ``key``.

    Returns:
        the bundle's canonical JSON bytes (the same for the same statement and key).
    """
    payload = canonical_json(statement).rstrip(b"\n")
    signature = key.sign(dsse_pae(INTOTO_PAYLOAD, payload))
    bundle = {
        "mediaType": SIGSTORE_BUNDLE_V03,
        "verificationMaterial": {"publicKey": {"hint": key.hint}, "tlogEntries": []},
        "dsseEnvelope": {"payload": base64.b64encode(payload).decode(), "payloadType": INTOTO_PAYLOAD,
                         "signatures": [{"sig": base64.b64encode(signature).decode(), "keyid": ""}]},
    }
    return canonical_json(bundle)
