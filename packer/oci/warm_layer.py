"""A warm state as its own image in ``OUT/image``: the build's image plus one layer, per device kind.

``packer warm`` adds, for the state ``OUT/warm/<name>/``, an image manifest whose layers are
the build's image's layers (the same blobs) and one more, uncompressed: the state's files at
``<prefix>/warm/<name>/`` (its ``manifest.json``, ``state.sig`` when signed, ``files/...``),
where the plugin looks for it beside the loader. Its config is the build's with that layer's
diff_id and one history entry appended. ``index.json`` lists it tagged
``<tag>-warm-<name>`` (``demo-0.1-warm-vllm-cpu-x86_64``) with the annotation
:data:`WARM_ANNOTATION`, after the build's own entries and before a signed build's
provenance referrer; one entry per state, replaced when the state is warmed again.

Every byte follows from the state and the build's image (times and owner from the image;
the tar as packer writes every layer), so :func:`check_warm_images` proves an entry by
making it again: ``packer verify`` checks the state's pins, then that each warm image is
exactly the one its state makes, and that ``index.json`` without the warm entries is the
index the build pinned.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packer.errors import ImageError, VerifyError, WarmStateError
from packer.hashing import sha256_file
from packer.oci.base import OCI_CONFIG, OCI_INDEX, OCI_MANIFEST, REF_NAME
from packer.oci.base_docs import CONFIG, INDEX, MANIFEST
from packer.oci.layer import MEDIA_TYPES, write_layer
from packer.oci.layout import ANNOTATION_OWNER, ANNOTATION_PREFIX, PACKER_PREFIX, write_json_blob
from packer.oci.tar_writer import FileRange, Owner, SourceFile, tar_members, tar_pieces
from packer.place import BLOBS
from packer.reading import OCI_DOC, blob_path, check_regular, open_regular, read_bytes, read_json
from packer.runtime.signature import SIGSTORE_BUNDLE_V03
from packer.util.fsutil import atomic_write_bytes, canonical_json
from packer.util.idents import ErrorClass, digest_parts
from packer.warm.pins import FILES, WARM_DIR, check_state, load_state
from packer.warm.pins import MANIFEST as STATE_MANIFEST
from packer.warm.trust import SIGNATURE_NAME

WARM_ANNOTATION = "dev.model-packer.warm"
_CHUNK = 1 << 20


def warm_tag(tag: str, name: str) -> str:
    """The warm image's tag: ``<tag>-warm-<name>``."""
    return f"{tag}-warm-{name}"


def is_warm(desc: dict[str, Any]) -> bool:
    """Whether an index entry is a warm image (:data:`WARM_ANNOTATION`)."""
    return WARM_ANNOTATION in (desc.get("annotations") or {})


def without_warm(index: dict[str, Any]) -> dict[str, Any]:
    """``index`` less its warm entries: the index the build wrote (and pinned)."""
    return {**index, "manifests": [d for d in index.get("manifests") or [] if not is_warm(d)]}


@dataclass(frozen=True)
class WarmImage:
    """What adding a state's warm image changes in ``OUT/image`` (:func:`plan_warm_image`).

    ``index``: the new ``index.json`` bytes; ``blobs``: the blobs written (hex digests), in the
    directory the plan was given; ``stale``: the blobs of ``OUT/image`` that only the warm image
    replaced referenced, to be removed; ``summary``: what :func:`add_warm_image` returns.
    """

    index: bytes
    blobs: tuple[str, ...]
    stale: tuple[str, ...]
    summary: dict[str, Any]


def plan_warm_image(out: Path, state: Path, *, tag: str, blobs_dir: Path) -> WarmImage:
    """Write the warm image of ``state`` into ``blobs_dir``; say how ``out/image`` changes (nothing there is written).

    Args:
        out: the build output; its ``image/index.json`` is read, never written.
        state: a state directory named ``<name>`` (``out/warm/<name>``, or a staged copy of it
            that will be renamed there), checked against its pins first.
        tag: the build's image tag (the manifest's ``image.tag``).
        blobs_dir: where the warm image's layer, config and manifest blobs go.

    Returns:
        the plan: the new index, the blobs written, the stale blobs of the warm image it replaces.

    Raises:
        ImageError: no image tagged ``tag``, or an unreadable layout.
        WarmStateError: the state does not match its pins.
    """
    image = out / "image"
    check_state(state)
    index = _index(image, ImageError)
    base = _base(image, index, tag, ImageError)
    layer = write_layer(tar_pieces(_members(state, base), mtime=base["epoch"]), blobs_dir, compression="none")
    config, manifest = _documents(base, state.name, layer.digest, layer.size)
    cdesc = write_json_blob(blobs_dir, config, OCI_CONFIG)
    desc = write_json_blob(blobs_dir, manifest, OCI_MANIFEST)
    entry = _entry(desc, base, state.name, tag)
    keep = [d for d in index["manifests"] if (d.get("annotations") or {}).get(WARM_ANNOTATION) != state.name]
    replaced = [d for d in index["manifests"] if d not in keep]
    at = len(keep) - 1 if keep and keep[-1].get("artifactType") == SIGSTORE_BUNDLE_V03 else len(keep)
    index["manifests"] = [*keep[:at], entry, *keep[at:]]  # a provenance referrer stays last
    new = {_hex(d) for d in (layer.digest, cdesc["digest"], desc["digest"])}
    used = new | _blobs_of(image, [base["entry"], *(d for d in keep if is_warm(d))])
    stale = _blobs_of(image, replaced) - used
    summary = {"tag": entry["annotations"][REF_NAME], "manifest_digest": desc["digest"],
               "layer_digest": layer.digest, "layer_size": layer.size}
    return WarmImage(canonical_json(index), tuple(sorted(new)), tuple(sorted(stale)), summary)


def add_warm_image(out: Path, state: Path, *, tag: str) -> dict[str, Any]:
    """Add (or replace) the warm image of ``state`` in ``out/image``, on the image tagged ``tag``, in place.

    The blobs of a replaced warm image that nothing else uses are removed. ``packer warm``
    stages the same changes (:func:`plan_warm_image`) and renames them in instead.

    Args:
        out: the build output; ``state``: ``out/warm/<name>``, checked against its pins first.
        tag: the build's image tag (the manifest's ``image.tag``).

    Returns:
        ``{"tag", "manifest_digest", "layer_digest", "layer_size"}`` of the warm image.

    Raises:
        ImageError: no image tagged ``tag``, or an unreadable layout.
        WarmStateError: the state does not match its pins.
    """
    blobs = out / BLOBS
    plan = plan_warm_image(out, state, tag=tag, blobs_dir=blobs)
    atomic_write_bytes(out / "image" / "index.json", plan.index, 0o644)
    for hexd in plan.stale:
        (blobs / hexd).unlink(missing_ok=True)
    return plan.summary


def _blobs_of(image: Path, descs: list[dict[str, Any]]) -> set[str]:
    """The blobs (hex) of image manifests: each manifest, its config and its layers (what can be read)."""
    found: set[str] = set()
    for desc in descs:
        found.add(_hex(desc.get("digest")))
        try:
            path = blob_path(image, desc.get("digest"), where=image / "index.json", error=ImageError)
            manifest = read_json(path, OCI_DOC, error=ImageError, shape=MANIFEST, where=f"{path}: an image manifest")
        except (ImageError, OSError):
            continue  # nothing more to find from it: its manifest blob alone
        found |= {_hex(d.get("digest")) for d in [manifest["config"], *manifest["layers"]]}
    return found - {""}


def _hex(digest: object) -> str:
    """The hex of a ``sha256:`` digest, or "" for anything else (never a path of its own)."""
    parts = digest_parts(digest)
    return parts[1] if parts is not None and parts[0] == "sha256" else ""


def check_warm_images(out: Path, *, tag: str, index_digest: str, signed: bool) -> tuple[list[str], bool]:
    """Prove every warm entry of ``out/image/index.json`` (see the module docstring).

    Args:
        out: the build output; its states were checked against their pins already.
        tag, index_digest: the manifest's ``image.tag`` and ``image.index_digest``.
        signed: a signed build (its referrer, last in the index, is checked by
            :mod:`packer.oci.referrer`, which sees the index without warm entries).

    Returns:
        ``(the warm images' blobs relative to out, whether index.json has warm entries)``;
        with warm entries, ``index.json`` less them is proven here (unsigned) or by the referrer check.

    Raises:
        VerifyError: a warm entry its state does not make, a blob that differs, or an index
            that is not the pinned one plus warm entries.
    """
    image = out / "image"
    index = _index(image, VerifyError)
    warm = [d for d in index["manifests"] if is_warm(d)]
    if not warm:
        return [], False
    if not signed and "sha256:" + hashlib.sha256(canonical_json(without_warm(index))).hexdigest() != index_digest:
        raise VerifyError(f"{image / 'index.json'}: without its warm images, differs from the manifest's image index")
    base = _base(image, index, tag, VerifyError)
    rels: list[str] = []
    for desc in warm:
        rels += _check_one(out, base, desc, tag)
    return rels, True


def _check_one(out: Path, base: dict[str, Any], desc: dict[str, Any], tag: str) -> list[str]:
    image = out / "image"
    name = str(desc["annotations"][WARM_ANNOTATION])
    state = out / WARM_DIR / name
    where = f"{image / 'index.json'}: the warm image {desc.get('digest')}"
    if "/" in name or name in ("", ".", "..") or not state.is_dir() or state.is_symlink():
        raise VerifyError(f"{where} names the state {name!r}, which {out / WARM_DIR} does not hold")
    try:
        digest, size = _tar_digest(_members(state, base), base["epoch"])
    except (WarmStateError, ImageError) as e:
        raise VerifyError(f"{where}: {e}") from e
    config, manifest = _documents(base, name, digest, size)
    want = _entry({"mediaType": OCI_MANIFEST, "digest": _digest(canonical_json(manifest)),
                   "size": len(canonical_json(manifest))}, base, name, tag)
    if desc != want:
        raise VerifyError(f"{where} is not the one {state} makes (warmed again without packer warm?)")
    rels = []
    for doc in (manifest, config):
        raw = canonical_json(doc)
        path = image / "blobs" / "sha256" / _digest(raw).removeprefix("sha256:")
        if read_bytes(path, OCI_DOC, error=VerifyError, what="a warm image's document") != raw:
            raise VerifyError(f"{path}: not the warm image's {'manifest' if doc is manifest else 'config'}")
        rels.append(path.relative_to(out).as_posix())
    path = blob_path(image, digest, where=where, error=VerifyError)
    got = sha256_file(path)
    if got != (size, digest.removeprefix("sha256:")):
        raise VerifyError(f"{path}: the warm layer blob differs from the layer {state} makes")
    return [*rels, path.relative_to(out).as_posix()]


def _index(image: Path, err: ErrorClass) -> dict[str, Any]:
    where = f"{image / 'index.json'}: unreadable"
    index = read_json(image / "index.json", OCI_DOC, error=err, shape=INDEX, where=where)
    if index.get("mediaType", OCI_INDEX) != OCI_INDEX:
        raise err(f"{image / 'index.json'}: not an OCI image index")
    return dict(index)


def _base(image: Path, index: dict[str, Any], tag: str, err: ErrorClass) -> dict[str, Any]:
    """The build's image: its index entry, manifest, config, prefix, owner and time."""
    found = [d for d in index["manifests"] if (d.get("annotations") or {}).get(REF_NAME) == tag
             and "artifactType" not in d and not is_warm(d)]
    if len(found) != 1:
        raise err(f"{image / 'index.json'}: expected one image tagged {tag!r}, found {len(found)}")
    path = blob_path(image, found[0]["digest"], where=image / "index.json", error=err)
    manifest = read_json(path, OCI_DOC, error=err, shape=MANIFEST, where=f"{path}: the image manifest")
    cpath = blob_path(image, manifest["config"]["digest"], where=path, error=err)
    config = read_json(cpath, OCI_DOC, error=err, shape=CONFIG, where=f"{cpath}: the image config")
    ann = manifest.get("annotations") or {}
    try:
        owner = Owner.parse(str(ann.get(ANNOTATION_OWNER, "0:0")))
    except ImageError as e:
        raise err(f"{path}: {e}") from None
    return {"entry": found[0], "manifest": manifest, "config": config, "owner": owner,
            "prefix": "/" + str(ann.get(ANNOTATION_PREFIX, "/models")).strip("/"), "epoch": _epoch(config, err, cpath)}


def _epoch(config: dict[str, Any], err: ErrorClass, where: Path) -> int:
    import calendar
    import time

    try:
        return calendar.timegm(time.strptime(str(config.get("created", "")), "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        raise err(f"{where}: created {config.get('created')!r} is not RFC 3339 UTC") from None


def _members(state: Path, base: dict[str, Any]) -> list[Any]:
    """The layer's entries: the state's files at ``<prefix>/warm/<name>/``, sizes as pinned."""
    doc = load_state(state)  # the caller checked the pins: the tar reads (and hashes) these sizes
    top = f"{base['prefix']}/{WARM_DIR}/{state.name}"
    own = [STATE_MANIFEST, *([SIGNATURE_NAME] if (state / SIGNATURE_NAME).is_file() else [])]
    files = [SourceFile(f"{top}/{rel}", check_regular(state / rel, WarmStateError).st_size, source=state / rel)
             for rel in own]
    files += [SourceFile(f"{top}/{FILES}/{rel}", pin["size"], source=state / FILES / rel)
              for rel, pin in sorted(doc["files"].items())]
    return tar_members(files, owner=base["owner"], prefix=base["prefix"])


def _tar_digest(members: list[Any], mtime: int) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    for piece in tar_pieces(members, mtime=mtime):
        if isinstance(piece, FileRange):
            left = piece.size
            with open_regular(piece.path, WarmStateError) as f:
                while left and (chunk := f.read(min(_CHUNK, left))):
                    h.update(chunk)
                    left -= len(chunk)
            if left:
                raise WarmStateError(f"{piece.path}: shorter than its pin")
            size += piece.size
        else:
            h.update(piece)
            size += len(piece)
    return "sha256:" + h.hexdigest(), size


def _documents(base: dict[str, Any], name: str, digest: str, size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The warm image's config and manifest: the build's, plus the one layer."""
    config = dict(base["config"])
    rootfs = dict(config.get("rootfs") or {"type": "layers"})
    rootfs["diff_ids"] = [*(rootfs.get("diff_ids") or []), digest]
    config["rootfs"] = rootfs
    config["history"] = [*(config.get("history") or []), {
        "created": config.get("created", ""), "created_by": f"{PACKER_PREFIX} warm state {name}",
        "comment": "the engine's start-up state, captured by packer warm"}]
    config_raw = canonical_json(config)
    manifest = dict(base["manifest"])
    manifest["config"] = {"mediaType": OCI_CONFIG, "digest": _digest(config_raw), "size": len(config_raw)}
    manifest["layers"] = [*manifest["layers"], {"mediaType": MEDIA_TYPES["none"], "digest": digest, "size": size}]
    manifest["annotations"] = {**(manifest.get("annotations") or {}), WARM_ANNOTATION: name}
    return config, manifest


def _entry(desc: dict[str, Any], base: dict[str, Any], name: str, tag: str) -> dict[str, Any]:
    entry = {k: desc[k] for k in ("mediaType", "digest", "size")}
    if base["entry"].get("platform"):
        entry["platform"] = base["entry"]["platform"]
    entry["annotations"] = {REF_NAME: warm_tag(tag, name), WARM_ANNOTATION: name}
    return entry


def _digest(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()
