"""A warm state's signature: ``OUT/warm/<name>/state.sig``, by the key that signed the build.

A warm state is made after the build (on the device kind it is for), so the build's
``model.sig`` cannot cover it. ``packer warm --sign-key KEY`` (or ``packer build`` with a
``[warm]`` table and ``--sign-key``) signs the state's manifest instead: ``state.sig`` is a
key-signed Sigstore bundle, the same kind as ``model.sig`` and the provenance, of an in-toto
v1 statement whose one subject is the state's ``manifest.json`` (its sha256), and whose
predicate names the build it was made for (the sha256 of the build's artifact manifest, the bytes
the image ships as its ``manifest.json``: the same in OUT and in the image). The state's
manifest pins every file of the state, so the signature covers every byte of it.

Where the build must be signed (``PACKER_REQUIRE_SIGNATURE=PUB``), the plugin uses a state
only when ``state.sig`` verifies with ``PUB``, signs the manifest bytes it read and decided
on, and names the build it serves; otherwise it prints one ``miss (refused: ...)`` line.
``packer verify OUT`` checks that ``state.sig`` signs the manifest beside it (with ``--key``,
also that it verifies).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from packer.errors import WarmStateError
from packer.reading import MANIFEST, SIGNATURE, parse_json, read_bytes
from packer.runtime.signature import INTOTO_STATEMENT
from packer.signed import open_signature
from packer.util.formats import MANIFEST_NAME
from packer.util.fsutil import split_artifact

SIGNATURE_NAME = "state.sig"
PREDICATE = "https://model-packer.dev/warm-state/v1"


def statement(name: str, manifest_sha256: str, build_sha256: str) -> dict[str, Any]:
    """The in-toto statement ``state.sig`` signs.

    Args:
        name: the state's name (``vllm-cpu-x86_64``).
        manifest_sha256: sha256 (hex) of the state's ``manifest.json`` bytes.
        build_sha256: sha256 (hex) of the build's artifact manifest (:func:`build_digest`).
    """
    return {"_type": INTOTO_STATEMENT,
            "subject": [{"name": f"warm/{name}/{MANIFEST_NAME}", "digest": {"sha256": manifest_sha256}}],
            "predicateType": PREDICATE,
            "predicate": {"build": {"name": MANIFEST_NAME, "digest": {"sha256": build_sha256}}}}


def build_digest(out: Path) -> str:
    """sha256 (hex) of the build's artifact manifest, the build a state is signed for.

    The artifact manifest is ``out/manifest.json`` without the image's own digests
    (:func:`packer.util.fsutil.split_artifact`), in canonical JSON: the very bytes the image ships
    as ``<prefix>/manifest.json``. So the same state, signed once, is for the same build in
    ``OUT`` and in the image's model directory.

    Raises:
        WarmStateError: no readable manifest, or not a JSON object.
    """
    where = out / MANIFEST_NAME
    raw = read_bytes(where, MANIFEST, error=WarmStateError, what="the build's manifest")
    doc = parse_json(raw, MANIFEST, where=str(where), error=WarmStateError)
    if not isinstance(doc, dict):
        raise WarmStateError(f"{where}: not a packer manifest (a JSON object)")
    return hashlib.sha256(split_artifact(doc)).hexdigest()


def check_signature(state: Path, manifest_sha256: str, *, public_key: str | None, build_sha256: str) -> None:
    """Refuse ``state`` unless its ``state.sig`` signs ``manifest_sha256`` for ``build_sha256``.

    Args:
        state: the state directory.
        manifest_sha256: sha256 (hex) of the manifest bytes the caller read (and decided on).
        public_key: a PEM public key's path: the bundle must verify with it; None: only its
            statement is compared (``packer verify`` without ``--key``).
        build_sha256: sha256 (hex) of the build's ``manifest.json``.

    Raises:
        WarmStateError: ``state.sig`` missing, unreadable, not a key-signed bundle, not
            verifying with ``public_key``, or signing another manifest or build.
    """
    where = state / SIGNATURE_NAME
    _, st = open_signature(where, error=WarmStateError, public_key=public_key, kind=SIGNATURE,
                           what="the warm state's signature",
                           missing=f"{where}: missing; the state is unsigned (sign it with packer warm --sign-key, "
                                   "the key that signed the build)")
    want = statement(state.name, manifest_sha256, build_sha256)
    if st.get("predicateType") != PREDICATE or st.get("subject") != want["subject"]:
        raise WarmStateError(f"{where}: signs another manifest than {state / MANIFEST_NAME} (changed after signing?)")
    if st.get("predicate") != want["predicate"]:
        raise WarmStateError(f"{where}: signed for another build than {state.parent.parent / MANIFEST_NAME}")
