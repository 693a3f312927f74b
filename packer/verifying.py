"""``packer verify``: prove that a build output still matches its manifest, byte for byte.

The walk composes each stage's own check (:func:`packer.oci.verify.verify_image`,
:func:`packer.weights.verify.verify_weights`, :func:`packer.bundle.verify_bundle`) with the
manifest's file list (:mod:`packer.manifest`), so it sits above the stages it calls.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from packer.bundle import verify_bundle
from packer.chunks import Hashed, chunk_difference, verify_chunks
from packer.components import artifact_files, components_of
from packer.errors import ImageArtifactMismatchError, VerifyError, WarmStateError
from packer.filetree import disk_usage
from packer.hashing import sha256_file, sha256_file_or_none
from packer.manifest import TIMINGS, read_manifest
from packer.oci.referrer import referrer_blobs
from packer.oci.reread import PLAIN, Vouch, Vouched
from packer.oci.verify import verify_image
from packer.oci.warm_layer import check_warm_images
from packer.place import BLOBS, FilePlace, blob_hex, blob_rel, places_of
from packer.reading import member, walk_tree
from packer.runtime.env import STREAM_FILE
from packer.sign.check import check_signatures
from packer.sign.provenance import INDEX_REL
from packer.util.formats import MANIFEST_NAME, PROVENANCE_NAME
from packer.util.fsutil import canonical_json, identity, split_artifact
from packer.util.idents import shown
from packer.warm.pins import verify_states
from packer.weights.verify import verify_weights

Inode = tuple[int, int]


def _plain_vouches(out: Path, vouched: Vouched | None) -> dict[str, Vouch]:
    """The build's own re-read of each weight file written as a plain file, by its path, where
    that file is still the one read (its identity unchanged): its digests are taken, not hashed again."""
    found = {}
    for key, v in (vouched or {}).items():
        if key.startswith(PLAIN):
            rel = key[len(PLAIN):]
            with contextlib.suppress(OSError):
                if identity((out / rel).lstat()) == v.identity:
                    found[rel] = v
    return found


def _hash_ahead(out: Path, listed: dict[str, Any], pool: ThreadPoolExecutor,
                stop: threading.Event, plain: dict[str, Vouch]) -> dict[Inode, Future[tuple[int, str] | None]]:
    """Start hashing, largest first, the listed files the image walk does not check itself.

    The image walk hashes every blob (and the files inside packer's layers); the files
    outside the image (and nothing twice: layer tarballs are hardlinks of blobs) can be
    hashed at the same time on the other cores; a weight file the build re-read (``plain``) is not.
    """
    found: dict[str, os.stat_result] = {}
    for rel in listed:
        try:
            st = (out / rel).lstat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and rel not in plain:
            found[rel] = st
    blobs = {(st.st_dev, st.st_ino) for rel, st in found.items() if blob_hex(rel) is not None}
    ahead: dict[Inode, Future[tuple[int, str] | None]] = {}
    for rel, st in sorted(found.items(), key=lambda kv: (-kv[1].st_size, kv[0])):
        inode = (st.st_dev, st.st_ino)
        if inode not in blobs and inode not in ahead:
            ahead[inode] = pool.submit(sha256_file_or_none, out / rel, stop)
    return ahead


def _in_blob(out: Path, place: FilePlace, checked_blobs: set[str]) -> None:
    """A file held in its layer blob: the image walk read that blob once, checking its digest and
    the file inside it (size, sha256, offset) side by side; nothing is read again here (and its
    bytes are counted once, as the blob's)."""
    if place.blob_digest not in checked_blobs:
        raise VerifyError(f"{out / place.rel}: the manifest places it in {place.path(out)[0]}, "
                          "which the image does not hold")


def _check_files(out: Path, listed: dict[str, Any], checked_blobs: set[str],
                 ahead: dict[Inode, Future[tuple[int, str] | None]], places: dict[str, FilePlace],
                 plain: dict[str, Vouch]) -> int:
    total = 0
    hashed: dict[Inode, str] = {}  # layer tarballs are hardlinks of blobs: hash once
    counted: set[Inode] = set()
    for rel, want in sorted(listed.items()):
        if rel in places and places[rel].in_blob:
            _in_blob(out, places[rel], checked_blobs)
            continue
        path = out / rel
        if not path.is_file() or path.is_symlink():
            raise VerifyError(f"{path}: listed in the manifest but missing")
        st = path.stat()
        walked = (hexd := blob_hex(rel)) is not None and "sha256:" + hexd in checked_blobs
        if st.st_size != want["size"] and walked:  # the blob matches its digest: the manifest is wrong
            raise VerifyError(f"{out / MANIFEST_NAME}: records size {want['size']} for the blob {rel}, which "
                              f"matches its digest at {st.st_size} bytes (edited after the build?)")
        if st.st_size != want["size"]:
            raise VerifyError(f"{path}: size {st.st_size} differs from the manifest's {want['size']}")
        size = st.st_size
        inode = (st.st_dev, st.st_ino)
        if blob_hex(rel) == want["sha256"] and "sha256:" + want["sha256"] in checked_blobs:
            hashed[inode] = want["sha256"]  # the image walk hashed this blob against its name
        if rel in plain and identity(st) == plain[rel].identity:
            hashed[inode] = plain[rel].sha256  # the build's re-read of it, not written since (checked here, at use)
        if inode not in hashed:
            early = ahead[inode].result() if inode in ahead else None  # None: hash it here
            hashed[inode] = (early or sha256_file(path))[1]
        digest = hashed[inode]
        if digest != want["sha256"]:
            raise VerifyError(f"{path}: sha256 {digest[:16]}… differs from the manifest's {want['sha256'][:16]}…")
        if inode not in counted:  # a hard link's bytes are on disk (and read) once
            counted.add(inode)
            total += size
    return total


def _check_no_extras(out: Path, listed: set[str], unlisted: tuple[str, ...]) -> None:
    for rel, path, mode in walk_tree(out, error=VerifyError):
        if stat.S_ISDIR(mode):
            continue
        if rel not in listed and rel not in (MANIFEST_NAME, TIMINGS, *unlisted):
            raise VerifyError(f"{path}: not listed in the manifest")


def _check_names(out: Path, listed: dict[str, Any], manifest: dict[str, Any]) -> dict[str, FilePlace]:
    """Every path the manifest names is a plain relative name inside OUT, and every file a
    stage's section names is one the manifest lists (and so hashes): no name from the
    manifest reaches outside OUT, before anything is opened. Returns the files' places."""
    where = out / MANIFEST_NAME
    for rel in listed:
        member(out, rel, where=where, error=VerifyError)
    places = places_of(manifest["files"], where=where)
    for place in places.values():
        if place.in_blob:
            _check_placed(where, place, manifest.get("image_files") or {})
    try:
        named = artifact_files(manifest["weights"]) if manifest.get("weights") else []
        if manifest.get("bundle"):
            named.append(manifest["bundle"]["file"])
    except (KeyError, TypeError, AttributeError) as e:
        raise VerifyError(f"{where}: a malformed weights or bundle section ({type(e).__name__}: {e})") from None
    for rel in named:
        if not isinstance(rel, str) or rel not in listed:
            raise VerifyError(f"{where}: a section names {shown(rel)}, which the manifest's files do not list")
    return places


def _check_placed(where: Path, place: FilePlace, image_files: dict[str, Any]) -> None:
    """A file held in a layer blob (its place read, :func:`packer.place.place_of`) names a blob
    the image lists, and lies inside it."""
    blob = image_files.get(place.blob or "")
    if blob is None:
        raise VerifyError(f"{where}: files[{shown(place.rel)}] is placed in {place.blob}, not a layer blob "
                          "the image lists")
    if place.offset + place.size > int(blob["size"]):
        raise VerifyError(f"{where}: files[{shown(place.rel)}]: offset {place.offset} + size {place.size} is past "
                          f"the end of {place.blob} ({blob['size']} bytes)")


def _check_self(out: Path, raw: bytes, manifest: dict[str, Any]) -> None:
    """Blame manifest.json itself when it disagrees with the redundancy the build left."""
    path = out / MANIFEST_NAME
    if raw != canonical_json(manifest):
        raise VerifyError(f"{path}: not in canonical form (edited after the build?)")
    image_files = manifest.get("image_files", {})
    for rel, entry in image_files.items():  # blobs are named by their digest
        if rel.startswith(f"{BLOBS}/") and rel != blob_rel(entry["sha256"]):
            raise VerifyError(f"{path}: records sha256 {entry['sha256'][:16]}… for the blob {rel}")
    section = manifest.get("image") or {}
    index = image_files.get("image/index.json")
    if section and (index is None or "sha256:" + index["sha256"] != section.get("index_digest")):
        raise VerifyError(f"{path}: image.index_digest disagrees with image_files")
    for digest in [section.get("manifest_digest"), section.get("config_digest"),
                   *(layer.get("digest") for layer in section.get("layers", []))]:
        if digest and blob_rel(digest.removeprefix("sha256:")) not in image_files:
            raise VerifyError(f"{path}: image section names {digest}, which is not in image_files")


def _name_every_link(out: Path, e: VerifyError) -> VerifyError:
    """``e`` naming every hard link of the file it blames (layer tarballs are links of blobs)."""
    where, sep, rest = str(e).partition(": ")
    try:
        st = os.lstat(where)
    except (OSError, ValueError):
        return e
    if not sep or not stat.S_ISREG(st.st_mode) or st.st_nlink < 2:
        return e
    others = []
    with contextlib.suppress(VerifyError):  # a tree too deep to name them all: the fault as it is
        for _rel, path, _mode in walk_tree(out, error=VerifyError):
            with contextlib.suppress(OSError):
                other = path.lstat()
                if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino) and path != Path(where):
                    others.append(str(path))
    return VerifyError(f"{where} (the same file as {', '.join(others)}): {rest}") if others else e


def verify(out: Path, *, public_key: Path | None = None, vouched: Vouched | None = None) -> dict[str, Any]:
    """Check every file of a build output against its manifest, then each stage's own rules.

    A signed build's ``model.sig`` and provenance must describe exactly what the manifest
    pins; with ``public_key`` both signatures must also verify with it
    (:mod:`packer.sign.check`).

    The image is checked first on its own (its blobs are content-addressed); it holds a copy
    of the artifact manifest, so a manifest.json edited after the build is named as such
    rather than blaming the file whose recorded digest was changed. A blamed file with other
    names (a layer tarball under ``image/layers/`` is a hard link of its blob) is named by all.

    ``vouched`` is for the build's own final verification: its weights stage re-read each
    weight layer blob (:func:`packer.oci.reread.reread_blobs`: the blob hashed, which names it,
    and the file inside it from the same read). A blob that stat shows unwritten since takes
    both digests from there, its tar entries checked all the same; anything else is hashed
    here. ``packer verify`` passes nothing and hashes the blob and the file side by side.

    Returns:
        A summary: files checked (every name, hard links and files held in blobs included),
        bytes checked (each file's bytes once: a hard link or a file inside a blob adds none),
        ``disk_bytes`` (what OUT takes on disk, as ``du`` counts it: hard links once).

    Raises:
        VerifyError: naming the first mismatch.
    """
    if (Path(out) / STREAM_FILE).is_file() and not (Path(out) / "image").exists():
        raise VerifyError(f"{out}: a model directory `packer stream` made, not a build output: its weights stay "
                          "in the registry and each chunk is proven as it loads; verify the build's OUT before "
                          f"`packer push`, or check this directory with `packer profile {out}`")
    try:
        return {**_verify(out, public_key, vouched), "disk_bytes": disk_usage(Path(out), VerifyError)}
    except VerifyError as e:
        named = _name_every_link(out, e)
        if named is e:
            raise
        raise named from e


def _chunk_vouches(places: dict[str, FilePlace], vouched: Vouched | None,
                   plain: dict[str, Vouch]) -> dict[str, Hashed]:
    """The chunk digests the build's re-read took of each file, by its path (a blob holds one file)."""
    by_blob = {p.blob_digest: rel for rel, p in places.items() if p.in_blob}
    held = {by_blob[d]: v for d, v in (vouched or {}).items() if d in by_blob}
    return {rel: (v.chunk, v.chunks, v.cuts) for rel, v in {**held, **plain}.items() if v.chunk}


def _verify(out: Path, public_key: Path | None, vouched: Vouched | None) -> dict[str, Any]:
    raw, manifest = read_manifest(out)
    _check_self(out, raw, manifest)
    listed = {**manifest["files"], **manifest.get("image_files", {})}
    places = _check_names(out, listed, manifest)
    signed = bool(manifest.get("signature"))
    image = manifest.get("image") or {}
    referrer = referrer_blobs(out, index_digest=image["index_digest"]) if signed and image else []
    # pinned apart: warm states (and their images) come after the build
    warm_files, warm_bytes, warm_names = _check_warm(out, public_key)
    warm_blobs, warm_index = check_warm_images(out, tag=image["tag"], index_digest=image["index_digest"],
                                               signed=signed) if image else ([], False)
    _check_no_extras(out, set(listed), (*warm_files, *warm_blobs, *((PROVENANCE_NAME, *referrer) if signed else ())))
    count = len(listed) + 1 + len(referrer)  # with manifest.json
    if referrer or warm_index:  # the pinned index is index.json less the referrer and warm images: checked above
        listed = {rel: e for rel, e in listed.items() if rel != INDEX_REL}
    checked: set[str] = set()
    plain = _plain_vouches(out, vouched)
    stop = threading.Event()
    pool = ThreadPoolExecutor(max(1, os.cpu_count() or 1), thread_name_prefix="packer-verify-files")
    try:
        ahead = _hash_ahead(out, listed, pool, stop, plain)  # while the image is walked
        if manifest.get("image"):
            try:
                checked = verify_image(out, artifact_manifest=split_artifact(manifest), vouched=vouched)
            except ImageArtifactMismatchError as e:
                raise VerifyError(f"{out / MANIFEST_NAME}: differs from the copy built into the image ({e})") from e
        nbytes = _check_files(out, listed, checked, ahead, places, plain)
    except VerifyError as e:  # a changed weight byte blames its whole blob: the chunk table says where
        where = chunk_difference(out, manifest, places)
        raise (VerifyError(f"{e}; {where}") if where else e) from e
    finally:
        stop.set()  # a failure above need not wait for every file to be hashed
        pool.shutdown(wait=True, cancel_futures=True)
    verify_chunks(out, manifest, places, _chunk_vouches(places, vouched, plain))
    if manifest.get("weights"):
        for section in components_of(manifest["weights"]):  # each component on its own
            verify_weights(out, section, places)
    if manifest.get("bundle"):
        verify_bundle(out, manifest["bundle"])
    check_signatures(out, manifest, public_key=public_key)
    return {"files": count + len(warm_files) + len(warm_blobs), "bytes": nbytes + warm_bytes, "signed": signed,
            "signature_verified": public_key is not None, "warm_states": warm_names}


def _check_warm(out: Path, public_key: Path | None) -> tuple[set[str], int, list[str]]:
    try:
        return verify_states(out, public_key=str(public_key) if public_key is not None else None)
    except WarmStateError as e:
        raise VerifyError(str(e)) from e


def verify_ref(ref: str, *, public_key: Path | None = None) -> dict[str, Any]:
    """Prove a pushed build in its registry, chunk by chunk, writing none of its weights.

    The image is opened as the loader opens it (:func:`packer.runtime.view_open.open_view`):
    its manifest's digest is the reference's, its small layers are proven by their digests and
    laid out in a private directory (removed after), and the manifest the build ships there is
    the one every file is checked against. Each weight file is then read through its source,
    which proves every chunk against the chunk table (:func:`packer.runtime.proof.prove_chunk`)
    as it arrives, and its whole sha256 is compared with the manifest's. A signed build's
    ``model.sig`` must sign exactly the manifest's files (with ``public_key``, verify with it).

    Args:
        ref: ``oci://HOST[:PORT]/REPO@sha256:<hex>`` (a tag is resolved once and reported).
        public_key: a PEM public key the signature must verify with.

    Returns:
        A summary: files and bytes proven, chunks, whether signed and verified, the pinned ref.

    Raises:
        VerifyError: the registry, the image, a small file, a chunk or the signature refused,
            in one line naming it (a chunk: file, index and byte range).
    """
    from tempfile import TemporaryDirectory

    from packer.runtime.env import ArtifactMismatchError
    from packer.runtime.view_open import open_view

    with TemporaryDirectory(prefix="packer-verify-") as tmp:
        try:
            view = open_view(None, ref, dest=Path(tmp) / "small", named="packer verify")
            proven = _prove_view(view)
            signed = _check_view_signature(view, public_key)
        except ArtifactMismatchError as e:
            raise VerifyError(str(e)) from None
    return {**proven, "signed": signed, "signature_verified": signed and public_key is not None,
            "ref": view.origin}


def _prove_view(view: Any) -> dict[str, Any]:
    """Every weight file of ``view``'s build read through its source, each chunk proven; the
    small files checked against the manifest (their size and sha256)."""
    from packer.runtime.proof import SpanCheck, check_sha256, hash_span
    from packer.runtime.view import close_source

    table, files = view.chunk_table(), view.manifest["files"]
    weights = sorted(rel for rel in files if view.held(rel) is not None or rel in table)
    small = sorted(rel for rel in files if rel not in weights and view.path(rel).is_file())
    missing = [rel for rel in weights if rel not in table]
    if missing:
        raise VerifyError(f"{view.origin}: the build has no chunk digests of {missing[0]} (built before "
                          "packer-chunks.json): pull the image and verify its directory")
    nbytes = chunks = 0
    for rel in weights:
        src, base, where = view.open_bytes(rel)
        try:
            size, want = files[rel]["size"], files[rel]["sha256"]
            if view.proves_reads:  # its reads prove each chunk as it arrives: read it once, whole
                check_sha256(where, hash_span(src, base, size, where), want)
            else:
                SpanCheck(table).check_file(rel, src, base, where)
        finally:
            close_source(src)
        nbytes, chunks = nbytes + size, chunks + table[rel].total
    for rel in small:
        view.check_small(rel, verify=True)
        nbytes += files[rel]["size"]
    return {"files": len(weights) + len(small), "bytes": nbytes, "chunks": chunks}


def _check_view_signature(view: Any, public_key: Path | None) -> bool:
    """Whether the build is signed; its ``model.sig`` (under the view's root) checked: it signs
    exactly the manifest's model files, and with ``public_key`` it verifies with it."""
    from packer.runtime.reading import read_bytes
    from packer.runtime.signature import (
        SIGNATURE_FILE,
        digest_difference,
        model_files,
        read_bundle,
        require_signature,
        signed_digests,
        statement_of,
    )

    sig = view.root / SIGNATURE_FILE
    if not view.manifest.get("signature"):
        if public_key is not None:
            raise VerifyError(f"{view.origin}: the build is not signed (built without --sign-key)")
        return False
    if public_key is not None:
        require_signature(view.root, str(public_key), manifest=view.manifest)
        return True
    try:
        data = read_bytes(sig, "signature")
    except FileNotFoundError:
        raise VerifyError(f"{view.origin}: {SIGNATURE_FILE} missing; the manifest says the build is signed") from None
    signed = signed_digests(statement_of(read_bundle(data, str(sig))[0], str(sig)), str(sig))
    problem = digest_difference(signed, model_files(view.manifest), str(sig), "the manifest")
    if problem:
        raise VerifyError(problem)
    return True
