"""The build side's one way to open a signature file, and its one translation of the runtime's errors.

``model.sig``, the provenance and a warm state's ``state.sig`` are all key-signed Sigstore
bundles of an in-toto statement. The runtime reads that format (:mod:`packer.runtime.signature`,
whose own check is :func:`~packer.runtime.signature.require_signature`); the build side opens
such a file here and only here: read as every input is (a regular file, bounded, its JSON and
its payload's nesting within bounds, so the statement parsers after this never meet a parser
bomb), its statement verified when a key is given, and every ``ArtifactMismatchError`` of the
runtime's parsers turned into the caller's error type by :func:`translated`.

It sits among the formats, below the signing stage (:mod:`packer.sign.check`) and the warm
state (:mod:`packer.warm.trust`), so that both of them open signatures the same way.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from packer.reading import Kind, parse_json, read_bytes
from packer.runtime.env import ArtifactMismatchError
from packer.runtime.signature import MAX_SIGNED_BYTES, open_signed, read_bundle, read_public_key, statement_of
from packer.util.idents import ErrorClass

SIGNED = Kind("signature file", MAX_SIGNED_BYTES, 32)  # a Sigstore bundle nests 5 deep, its statement 6


@contextmanager
def translated(error: ErrorClass) -> Iterator[None]:
    """Raise the runtime's refusals (and a missing ``cryptography``) inside as ``error``, same text."""
    try:
        yield
    except (ArtifactMismatchError, ImportError) as e:
        raise error(str(e)) from None


def open_signature(path: Path, *, error: ErrorClass, missing: str, public_key: str | Path | None = None,
                   pem: bytes | None = None, kind: Kind = SIGNED, what: str = "") -> tuple[bytes, dict[str, Any]]:
    """The bytes of the signature file ``path`` and its in-toto statement.

    Args:
        path: the bundle file (``model.sig``, the provenance, ``state.sig``).
        error: the caller's error type; every refusal is raised as one.
        missing: the message when there is no such file.
        public_key: the PEM public key's path the bundle must verify with; None: the statement
            is read unverified (it describes the build, and proves nothing about who signed it).
        pem: that key's bytes, where the caller read and checked them already; else they are
            read from ``public_key`` (``PACKER_REQUIRE_SIGNATURE``'s reader).
        kind: the file's bounds; what: its name in a read error.

    Returns:
        ``(the file's bytes, the statement)``.

    Raises:
        error: missing, not a regular file, over the cap, nested too deep, not a key-signed
            bundle of an in-toto statement, or not verifying with the key; the cryptography
            package missing.
    """
    if not os.path.lexists(path):
        raise error(missing)
    where = str(path)
    data = read_bytes(path, kind, error=error, what=what)
    parse_json(data, kind, where=where, error=error)
    try:
        payload: bytes | None = read_bundle(data, where)[0]
    except ArtifactMismatchError:
        payload = None  # opened below, which says what is wrong
    if payload is not None:
        parse_json(payload, kind, where=f"{where}: the signed payload", error=error)
    with translated(error):
        if public_key is None:
            return data, statement_of(read_bundle(data, where)[0], where)
        key = read_public_key(str(public_key)) if pem is None else pem
        return data, open_signed(data, key, where, key_name=str(public_key))
