"""The base image's documents and blobs: found inside the layout, bounded, checked in shape.

A base layout is an input like any other. Its ``index.json``, manifests and config are read
with a size cap, refused when nested too deeply, checked against their digest and size, and
checked against the shapes below before :mod:`packer.oci.base` uses a field: a fault is one
line naming the file, the JSON path and what was expected. Every blob a descriptor names
must resolve inside the layout's own ``blobs/``; a layout whose blobs are symbolic links into
another tree (bazel writes such layouts) is refused with the way out: a self-contained copy.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

from packer.errors import ImageError
from packer.reading import OCI_DOC, parse_json, read_bytes
from packer.util.idents import confined, digest_parts, shown
from packer.util.jsonshape import (
    BOOL,
    INT,
    SIZE,
    STR,
    ListOf,
    MapOf,
    Nullable,
    Obj,
    Shape,
    leaf,
)

MAX_DOC_BYTES = OCI_DOC.max_bytes  # the registries' manifest limit; configs with long histories fit

DIGEST = leaf("a digest like sha256:<64 hex digits>", lambda v: digest_parts(v) is not None)
STRINGS = ListOf(STR, expected="an array of strings")
PLATFORM = Obj(required={"architecture": STR, "os": STR},
               optional={"variant": STR, "os.version": STR, "os.features": STRINGS},
               expected='an object like {"os": "linux", "architecture": "amd64"}')
DESCRIPTOR = Obj(required={"mediaType": STR, "digest": DIGEST, "size": SIZE},
                 optional={"annotations": MapOf(STR), "platform": PLATFORM, "urls": STRINGS},
                 expected="a descriptor (an object with mediaType, digest and size)")
INDEX = Obj(required={"manifests": ListOf(DESCRIPTOR)},
            optional={"schemaVersion": INT, "mediaType": STR, "annotations": MapOf(STR)},
            expected="an image index (an object with a manifests array)")
MANIFEST = Obj(required={"config": DESCRIPTOR, "layers": ListOf(DESCRIPTOR)},
               optional={"schemaVersion": INT, "mediaType": STR, "annotations": MapOf(STR)},
               expected="an image manifest (an object with config and layers)")
REFERRER = Obj(required={"config": DESCRIPTOR, "layers": ListOf(DESCRIPTOR)},
               optional={"subject": DESCRIPTOR, "annotations": MapOf(STR)},
               expected="an image manifest with config, layers and a subject descriptor")
RUN_CONFIG = Obj(optional={"Env": Nullable(STRINGS), "Cmd": Nullable(STRINGS), "Entrypoint": Nullable(STRINGS),
                           "User": STR, "WorkingDir": STR, "Labels": Nullable(MapOf(STR)), "StopSignal": STR})
HISTORY = Obj(optional={"created": STR, "created_by": STR, "comment": STR, "author": STR, "empty_layer": BOOL})
CONFIG = Obj(optional={"architecture": STR, "os": STR, "variant": STR, "created": STR,
                       "config": Nullable(RUN_CONFIG),
                       "rootfs": Obj(required={"type": STR, "diff_ids": ListOf(DIGEST)}),
                       "history": Nullable(ListOf(HISTORY))},
             expected="an image config (an object)")


def _self_contained(layout: Path) -> str:
    return (f"the base layout's files must lie inside it, and this one links into another tree (as bazel's "
            f"rules_oci writes layouts): copy it into a self-contained layout (cp -rL {layout} COPY) and "
            "name the copy in image.base")


def blob_file(layout: Path, desc: dict[str, Any]) -> tuple[Path, str]:
    """The resolved blob file a (shape-checked) descriptor names, and its sha256 hex.

    Raises:
        ImageError: not a sha256 digest, missing, not a regular file, its size not the
            descriptor's, or a link leading outside the layout's ``blobs/``.
    """
    parts = digest_parts(desc["digest"])
    if parts is None:
        raise ImageError(f"{layout}: {shown(desc['digest'])} is not a digest (sha256:<64 hex digits>)")
    algo, hexd = parts
    if algo != "sha256":
        raise ImageError(f"{layout}: blob {desc['digest']!r}: only sha256 blobs are supported; copy the "
                         "image with skopeo, which writes sha256 digests")
    path = layout / "blobs" / "sha256" / hexd
    real = confined(path, [layout / "blobs"], error=ImageError, what="symlink", hint=_self_contained(layout))
    try:
        st = os.stat(real)
    except OSError as e:
        raise ImageError(f"{layout}: blob {desc['digest']} is missing: {e.strerror}") from e
    if not stat.S_ISREG(st.st_mode):
        raise ImageError(f"{path}: blob {desc['digest']} is not a regular file")
    if st.st_size != desc["size"]:
        raise ImageError(f"{path}: blob {desc['digest']} holds {st.st_size} bytes, its descriptor says "
                         f"{desc['size']}")
    return real, hexd


def _read(path: Path, shape: Shape, where: str, sha256: str | None = None) -> dict[str, Any]:
    """Read (at most the cap), check the digest, parse with bounds and check ``shape``."""
    raw = read_bytes(path, OCI_DOC, error=ImageError, where=where)
    if sha256 is not None and hashlib.sha256(raw).hexdigest() != sha256:
        raise ImageError(f"{where}: its bytes do not match its digest")
    doc: dict[str, Any] = parse_json(raw, OCI_DOC, where=where, error=ImageError, shape=shape)
    return doc


def read_index(layout: Path) -> dict[str, Any]:
    """``LAYOUT/index.json``, checked in shape (:data:`INDEX`)."""
    path = layout / "index.json"
    if not path.is_file():
        raise ImageError(f"{layout}: no index.json file; expected an OCI image layout "
                         "(skopeo copy docker://IMAGE oci:DIR:TAG writes one)")
    real = confined(path, [layout], error=ImageError, what="index.json", hint=_self_contained(layout))
    return _read(real, INDEX, str(path))


def read_doc(layout: Path, desc: dict[str, Any], shape: Shape, what: str) -> dict[str, Any]:
    """The JSON blob a (shape-checked) descriptor names, checked against its digest and ``shape``.

    Args:
        layout: the base layout.
        desc: the descriptor naming the blob.
        shape: :data:`INDEX`, :data:`MANIFEST` or :data:`CONFIG`.
        what: how messages name the document ("manifest").

    Raises:
        ImageError: see :func:`blob_file`; larger than :data:`MAX_DOC_BYTES`, bytes that do not
            match the digest, not JSON, too deep, or a fault in shape.
    """
    where = f"{layout}/blobs/{desc['digest'].replace(':', '/', 1)} ({what})"
    if desc["size"] > MAX_DOC_BYTES:
        raise ImageError(f"{where}: {desc['size']} bytes, over the limit of {MAX_DOC_BYTES} for this document")
    real, hexd = blob_file(layout, desc)
    return _read(real, shape, where, sha256=hexd)
