"""``verify_image``: check an OCI layout written by packer, blob by blob and entry by entry.

Every blob's digest and size, every layer's diff_id (by decompressing it, streamed), the
index -> manifest -> config walk and media types. Packer's own layers (history entries whose
``created_by`` starts with ``packer:``) are also read entry by entry against the tar rules;
with the artifact manifest, their files must equal the artifact files byte for byte.
"""

from __future__ import annotations

import calendar
import contextlib
import gzip
import hashlib
import os
import tarfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import IO, Any, cast

from packer.errors import BlobDigestError, ImageArtifactMismatchError, ImageError, VerifyError
from packer.oci import modelpack
from packer.oci.base import OCI_CONFIG, OCI_INDEX, OCI_MANIFEST, REF_NAME
from packer.oci.base_docs import CONFIG, DIGEST, INDEX, MANIFEST
from packer.oci.layer import COMPRESSION_OF, MEDIA_TYPES
from packer.oci.layout import (
    ANNOTATION_OWNER,
    ANNOTATION_PREFIX,
    ANNOTATION_WEIGHTS,
    OCI_LAYOUT,
    PACKER_PREFIX,
)
from packer.oci.plan import WEIGHTS_DIR, image_rel, model_files
from packer.oci.referrer import ARTIFACT_TYPE as REFERRER_TYPE
from packer.oci.reread import Vouch, Vouched
from packer.oci.tar_reader import TarReader
from packer.oci.tar_writer import ALLOWED_PAX, Owner
from packer.oci.warm_layer import is_warm
from packer.place import places_of
from packer.reading import MANIFEST as MANIFEST_DOC
from packer.reading import OCI_DOC, blob_path, map_readonly, open_regular, parse_json, read_bytes, read_json
from packer.util.formats import MANIFEST_NAME
from packer.util.fsutil import HashThread, identity
from packer.util.jsonshape import ListOf, Obj
from packer.util.tarfmt import DIR_MODE, EXEC_MODE, FILE_MODE

CHUNK = 16 * 2**20
Expected = dict[str, tuple[int, str]]  # image path -> (size, sha256 hex)
Offsets = dict[str, tuple[str, int]]  # image path -> (uncompressed layer blob digest, data offset in it)


class _Mapped:
    """An uncompressed blob through a read-only mapping: ``read`` hands out views of it, so the
    blob's digest (one thread) and the files' sha256 (the walk) read the same pages, uncopied."""

    def __init__(self, path: Path) -> None:
        self.fd, self.mm, self.size = map_readonly(path, VerifyError)
        self.view = memoryview(self.mm) if self.mm is not None else memoryview(b"")
        self.pos = 0

    def read(self, n: int = -1) -> memoryview:
        end = self.size if n < 0 else min(self.size, self.pos + n)
        out = self.view[self.pos:end]
        self.pos = end
        return out

    def close(self) -> None:
        self.view.release()
        if self.mm is not None:
            with contextlib.suppress(BufferError):  # a view still held (a traceback): freed with it
                self.mm.close()
        os.close(self.fd)


class _Known:
    """A blob's digest taken by a re-read of the same, unwritten file: stands in for its hasher."""

    def __init__(self, hexdigest: str) -> None:
        self._hex = hexdigest

    def update(self, data: bytes | memoryview) -> None:
        pass

    def close(self) -> None:
        pass

    def hexdigest(self) -> str:
        return self._hex


class _HashingReader:
    """A read-only stream that hashes (on another thread) and counts everything read through it.

    The blob's digest runs beside the tar walk, which hashes the files inside the layer; a blob
    hashed ahead (``known``: its sha256 hex) is only counted.
    """

    def __init__(self, raw: IO[bytes] | _Mapped, known: str | None = None) -> None:
        self.raw, self.size = raw, 0
        self.hash: HashThread | _Known = HashThread() if known is None else _Known(known)

    def read(self, n: int = -1) -> bytes | memoryview:
        data = self.raw.read(n)
        self.hash.update(data)
        self.size += len(data)
        return data

    def readable(self) -> bool:
        return True

    def drain(self) -> None:
        while self.read(CHUNK):
            pass


def _fail(where: str, what: str) -> VerifyError:
    return VerifyError(f"{where}: {what}")


def _blob_path(image: Path, digest: object) -> Path:
    return blob_path(image, digest, where=image, error=VerifyError)


_SHAPES = {OCI_MANIFEST: MANIFEST, OCI_CONFIG: CONFIG,
           modelpack.CONFIG_TYPE: Obj(optional={"modelfs": Obj(optional={"diffIds": ListOf(DIGEST)})})}


def _check_json_blob(image: Path, desc: dict[str, Any], media: str) -> dict[str, Any]:
    if desc.get("mediaType") != media:
        got = desc.get("mediaType")
        raise _fail(str(image), f"{desc.get('digest')}: media type {got!r}, expected {media}")
    path = _blob_path(image, desc.get("digest", ""))
    try:
        raw = read_bytes(path, OCI_DOC, error=VerifyError)
    except VerifyError as e:
        if not path.exists():
            raise _fail(str(path), "missing blob") from e
        raise
    _check_digest(path, desc, len(raw), "sha256:" + hashlib.sha256(raw).hexdigest())
    data: dict[str, Any] = parse_json(raw, OCI_DOC, where=str(path), error=VerifyError, shape=_SHAPES[media])
    if data.get("mediaType", media) != media:
        raise _fail(str(path), f"mediaType {data.get('mediaType')!r}, expected {media}")
    return data


def _check_digest(path: Path, desc: dict[str, Any], size: int, digest: str) -> None:
    if size != desc.get("size") or digest != desc.get("digest"):
        raise _fail(str(path), f"blob does not match its descriptor: size {size}, {digest} "
                               f"(expected {desc.get('size')}, {desc.get('digest')})")


def _decompressed(reader: _HashingReader, media: str) -> IO[bytes]:
    kind = COMPRESSION_OF[media]
    if kind == "gzip":
        return cast(IO[bytes], gzip.GzipFile(fileobj=cast(IO[bytes], reader), mode="rb"))
    if kind == "zstd":
        import zstandard

        dctx = zstandard.ZstdDecompressor()
        return cast(IO[bytes], dctx.stream_reader(cast(IO[bytes], reader), read_across_frames=True))
    return cast(IO[bytes], reader)


class _DiffHasher:
    """Wraps the decompressed stream so the uncompressed bytes are hashed as read.

    For an uncompressed layer the blob's own hash is the diff_id: pass ``hasher`` to share it.
    """

    def __init__(self, inner: IO[bytes], hasher: Any = None) -> None:
        self.inner, self.own = inner, hasher is None
        self.hash = hashlib.sha256() if hasher is None else hasher

    def read(self, n: int = -1) -> bytes:
        data = self.inner.read(n)
        if self.own:
            self.hash.update(data)
        return data

    def drain(self) -> None:
        while self.read(CHUNK):
            pass


def _check_entry(
    m: tarfile.TarInfo, where: str, rules: dict[str, Any], seen: set[str], last: str
) -> str:
    name = m.name.rstrip("/")
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts:
        raise _fail(where, f"entry {m.name!r}: unsafe path")
    if name <= last:
        raise _fail(where, f"entry {m.name!r}: not sorted after {last!r}")
    if p.parent.as_posix() != "." and p.parent.as_posix() not in seen:
        raise _fail(where, f"entry {m.name!r}: parent directory not written before it")
    if m.type not in (tarfile.REGTYPE, tarfile.DIRTYPE):
        raise _fail(where, f"entry {m.name!r}: type {m.type!r} (only files and directories)")
    allowed = (DIR_MODE,) if m.isdir() else (FILE_MODE, EXEC_MODE)
    if m.mode not in allowed:
        want = " or ".join(map(oct, allowed))
        raise _fail(where, f"entry {m.name!r}: mode {oct(m.mode)}, expected {want}")
    prefix = rules["prefix"]
    in_prefix = not prefix or name == prefix or name.startswith(prefix + "/")
    owner = rules["owner"] if in_prefix else Owner()
    if (m.uid, m.gid) != (owner.uid, owner.gid) or m.uname or m.gname:
        got = f"{m.uid}:{m.gid} ({m.uname!r}:{m.gname!r})"
        raise _fail(where, f"entry {m.name!r}: owner {got}, expected {owner} with empty names")
    if m.mtime != rules["mtime"]:
        raise _fail(where, f"entry {m.name!r}: mtime {m.mtime}, expected {rules['mtime']}")
    extra = set(m.pax_headers) - ALLOWED_PAX
    if extra:
        raise _fail(where, f"entry {m.name!r}: unexpected PAX records {sorted(extra)}")
    seen.add(name)
    return name


def _walk_tar(stream: _DiffHasher, where: str, rules: dict[str, Any], hash_files: bool,
              offsets: tuple[str, Offsets] | None = None, vouched: tuple[int, int, str] | None = None) -> Expected:
    """Every entry against the rules; each file's size and sha256 (``hash_files``), and, for an
    uncompressed layer (``offsets``: its digest and the map to fill), where its data lies. The
    file at ``vouched``'s offset and size takes its sha256 from there: the caller checks the
    blob's digest after the walk, and nothing the walk found counts before that passes."""
    seen: set[str] = set()
    last = ""
    found: Expected = {}
    reader = TarReader(stream)
    for m in reader:
        last = _check_entry(m, where, rules, seen, last)
        if m.isfile() and offsets is not None:
            offsets[1]["/" + last] = (offsets[0], m.offset_data)
        if m.isfile() and hash_files and vouched is not None and (m.offset_data, m.size) == vouched[:2]:
            found["/" + last] = (m.size, vouched[2])  # its bytes still feed the blob's digest
        elif m.isfile() and hash_files:
            h = hashlib.sha256()
            for chunk in reader.chunks():
                h.update(chunk)
            found["/" + last] = (m.size, h.hexdigest())
    return found


def _hashed_ahead(vouch: Vouch | None, raw: IO[bytes] | _Mapped) -> str | None:
    """The blob's sha256 hex from the build's own re-read (:mod:`packer.oci.reread`), if the file
    open now has the identity it read (no write since that stat shows); else None: hash it now."""
    if vouch is None or not isinstance(raw, _Mapped):
        return None
    return vouch.digest if vouch.identity == identity(os.fstat(raw.fd)) else None


def _check_layer(image: Path, desc: dict[str, Any], diff_id: str, rules: dict[str, Any] | None,
                 hash_files: bool, kind: str | None = None, offsets: Offsets | None = None,
                 vouched: Vouched | None = None) -> Expected:
    """One layer blob in one pass: its digest on a thread beside the tar walk, which hashes the
    files inside (a weight file's sha256 and its layer's digest from the same read). A blob
    ``vouched`` for takes its digest from the build's re-read while it is the file that was read
    (else it is hashed here), and the file inside it that read's sha256: its tar entries are
    walked and checked all the same."""
    media = desc.get("mediaType")
    path = _blob_path(image, desc.get("digest", ""))
    if kind is not None:  # an artifact's own tar media type
        media = MEDIA_TYPES[kind]
    if media not in COMPRESSION_OF:
        known = ", ".join(sorted(MEDIA_TYPES.values()))
        raise _fail(str(path), f"layer media type {media!r} is not one of {known}")
    found: Expected = {}
    plain = COMPRESSION_OF[media] == "none"
    try:  # closed in finally, read again on error
        raw: IO[bytes] | _Mapped = _Mapped(path) if plain else open_regular(path, VerifyError)
    except OSError as e:
        raise _fail(str(path), f"missing blob ({e.strerror})") from e
    vouch = (vouched or {}).get(str(desc.get("digest"))) if plain else None
    try:
        reader = _HashingReader(raw, _hashed_ahead(vouch, raw))
    except BaseException:
        raw.close()
        raise
    try:
        stream = _DiffHasher(_decompressed(reader, media), reader.hash if plain else None)
        if rules is not None:
            mine = (str(desc.get("digest")), offsets) if plain and offsets is not None else None
            inside = (vouch.offset, vouch.size, vouch.sha256) if vouch is not None else None
            found = _walk_tar(stream, str(path), rules, hash_files, mine, inside)
        stream.drain()
        reader.drain()
    except (OSError, EOFError, tarfile.TarError, ValueError, zlib.error, VerifyError) as e:
        # a damaged blob explains any read error: name the digest mismatch first (when the
        # rest of the blob can be read: a read that fails again leaves the first error standing)
        try:
            reader.drain()
        except OSError:
            pass
        else:
            _check_digest(path, desc, reader.size, "sha256:" + reader.hash.hexdigest())
        if isinstance(e, VerifyError):
            raise
        raise _fail(str(path), f"cannot read layer: {e}") from e
    finally:
        reader.hash.close()  # done with the views of a mapping before it is closed
        raw.close()
    try:
        _check_digest(path, desc, reader.size, "sha256:" + reader.hash.hexdigest())
    except VerifyError as e:
        raise BlobDigestError(str(e), found) from None
    if "sha256:" + stream.hash.hexdigest() != diff_id:
        raise _fail(str(path), f"diff_id sha256:{stream.hash.hexdigest()} != config's {diff_id}")
    return found


def _packer_layers(config: dict[str, Any]) -> list[bool]:
    return [str(h.get("created_by", "")).startswith(PACKER_PREFIX)
            for h in config.get("history") or [] if not h.get("empty_layer")]


def _epoch(created: str) -> int:
    try:
        return calendar.timegm(time.strptime(created, "%Y-%m-%dT%H:%M:%SZ"))
    except (TypeError, ValueError) as e:
        raise _fail("config", f"created {created!r} is not RFC 3339 UTC") from e


def _rules(ann: dict[str, Any], created: str) -> dict[str, Any]:
    return {"prefix": str(ann.get(ANNOTATION_PREFIX, "/models")).strip("/"),
            "owner": Owner.parse(str(ann.get(ANNOTATION_OWNER, "0:0"))), "mtime": _epoch(created)}


def _check_manifest(image: Path, desc: dict[str, Any], found: Expected, hash_files: bool,
                    per_layer: dict[str, Expected] | None = None,
                    offsets: Offsets | None = None, vouched: Vouched | None = None) -> dict[str, Any]:
    manifest = _check_json_blob(image, desc, OCI_MANIFEST)
    config = _check_json_blob(image, manifest.get("config") or {}, OCI_CONFIG)
    _check_platform(str(image / "index.json"), desc, config)
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
    layers = manifest.get("layers") or []
    if len(diff_ids) != len(layers):
        raise _fail(str(image), f"{len(layers)} layers but {len(diff_ids)} diff_ids in the config")
    ours = _packer_layers(config)
    if len(ours) != len(layers):
        raise _fail(str(image), f"{len(layers)} layers but {len(ours)} non-empty history entries")
    ann = manifest.get("annotations") or {}
    rules = _rules(ann, config.get("created", ""))
    # layers are independent: check them concurrently (hashing releases the GIL), then
    # report the first problem in layer order so the message does not depend on timing
    workers = max(1, min(len(layers), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="packer-verify") as pool:
        futures = [pool.submit(_check_layer, image, ldesc, diff_id, rules if mine else None,
                               hash_files, None, offsets, vouched)
                   for ldesc, diff_id, mine in zip(layers, diff_ids, ours, strict=True)]
        for ldesc, fut in zip(layers, futures, strict=True):
            got = fut.result()
            found.update(got)
            if per_layer is not None:
                per_layer[ldesc["digest"]] = got
    return manifest


def expected_files(artifact_manifest: bytes, ann: dict[str, Any], where: str) -> tuple[Expected, set[str]]:
    """What a packer image holds: every artifact file where :func:`image_rel` puts it, the bundle's
    members as plain files, the artifact manifest; and the paths that may be missing (external weights)."""
    prefix = str(ann.get(ANNOTATION_PREFIX, "/models")).strip("/")
    external = ann.get(ANNOTATION_WEIGHTS) == "external"
    try:
        artifact = parse_json(artifact_manifest, MANIFEST_DOC, where=f"{where}: {MANIFEST_NAME}", error=VerifyError)
        files = artifact["files"]
        _, members = model_files(artifact)
    except (KeyError, TypeError, AttributeError, ImageError) as e:
        raise _fail(where, f"the artifact manifest is not JSON with a 'files' map: {e}") from e
    root = f"/{prefix}/" if prefix else "/"
    expected: Expected = {f"{root}{MANIFEST_NAME}": (len(artifact_manifest),
                                                  hashlib.sha256(artifact_manifest).hexdigest())}
    optional = set()
    for rel, entry in files.items():
        expected[f"{root}{image_rel(rel)}"] = (entry["size"], entry["sha256"])
        if external and rel.startswith(WEIGHTS_DIR):
            optional.add(f"{root}{image_rel(rel)}")
    for m in members:
        expected.setdefault(f"{root}{m.path}", (m.size, m.sha256))
    return expected, optional


def _check_places(offsets: Offsets, artifact_manifest: bytes, ann: dict[str, Any], where: str) -> None:
    """A weight file the manifest says is held in a layer blob (``blob``, ``offset``) is the file
    of that blob, its data at that offset: the loader reads it there."""
    prefix = str(ann.get(ANNOTATION_PREFIX, "/models")).strip("/")
    root = f"/{prefix}/" if prefix else "/"
    files = parse_json(artifact_manifest, MANIFEST_DOC, where=where, error=VerifyError).get("files") or {}
    for rel, place in sorted(places_of(files, where=f"{where}: {MANIFEST_NAME}").items()):
        if place.in_blob:
            got = offsets.get(f"{root}{image_rel(rel)}")
            if got != (place.blob_digest, place.offset):
                raise _fail(where, f"{rel}: the manifest places it in {place.blob} at offset "
                                   f"{place.offset}, the image layers hold it at {got}")


def _name_the_file(out_dir: Path, e: BlobDigestError, artifact_manifest: bytes, ann: dict[str, Any]) -> VerifyError:
    """A blob that holds a weight file's one copy, its digest wrong: name the weight file whose
    sha256 differs too (the walk hashed both side by side) after the blob. (A file the build
    vouched for was not hashed: the blob alone is named.)"""
    prefix = str(ann.get(ANNOTATION_PREFIX, "/models")).strip("/")
    root = f"/{prefix}/" if prefix else "/"
    files = parse_json(artifact_manifest, MANIFEST_DOC, where=str(out_dir), error=VerifyError).get("files") or {}
    for rel, place in sorted(places_of(files, where=f"{out_dir}: {MANIFEST_NAME}").items()):
        got = e.found.get(f"{root}{image_rel(rel)}")
        if place.in_blob and got and got[1] != place.sha256:
            name = repr(str(rel))[1:-1]  # control characters escaped, no quotes
            return VerifyError(f"{e}; the weight file it holds at offset {place.offset} is the manifest's "
                               f"{name}: sha256 {got[1][:16]}… differs from the manifest's {place.sha256[:16]}…")
    return e


def _check_artifacts(found: Expected, artifact_manifest: bytes, ann: dict[str, Any], where: str,
                     *, complete: bool = True) -> None:
    expected, optional = expected_files(artifact_manifest, ann, where)
    manifest_paths = {p for p in expected if p.endswith("/" + MANIFEST_NAME)}
    # the artifact files first: a changed file is a more useful message than the manifest's
    for path, got in sorted(found.items(), key=lambda kv: (kv[0] in manifest_paths, kv[0])):
        if path not in expected:
            raise _fail(where, f"{path}: in the image but not an artifact file")
        if got != expected[path]:
            want = expected[path]
            raise _fail(where, f"{path}: size/sha256 {got} differ from the artifact's {want}")
    for path in sorted(set(expected) - set(found) - optional) if complete else ():
        raise _fail(where, f"{path}: artifact file missing from the image")


def _check_platform(where: str, desc: dict[str, Any], config: dict[str, Any]) -> None:
    """The index's platform must be the config's: a node picks by the one and runs the other."""
    said = desc.get("platform")
    if said is None:
        return
    for key in ("os", "architecture", "variant"):
        if said.get(key) != config.get(key):
            raise _fail(where, f"manifest {desc.get('digest')}: the index says {key} {said.get(key)!r}, "
                               f"the image config {config.get(key)!r}")


def _check_modelpack(image: Path, desc: dict[str, Any], found: Expected, hash_files: bool,
                     rules: dict[str, Any], seen: dict[str, Expected]) -> dict[str, Any]:
    """A ModelPack manifest: its config and every layer blob, diffIds, and (with ``hash_files``)
    the files in its layers, which must be the image's files. A blob the image's own manifest
    holds (the weights) was checked there and is not read twice."""
    where = str(image)
    manifest = _check_json_blob(image, desc, OCI_MANIFEST)
    if manifest.get("artifactType") != modelpack.ARTIFACT_TYPE:
        raise _fail(where, f"manifest {desc.get('digest')}: artifactType {manifest.get('artifactType')!r}")
    config = _check_json_blob(image, manifest.get("config") or {}, modelpack.CONFIG_TYPE)
    diff_ids = (config.get("modelfs") or {}).get("diffIds") or []
    layers = manifest.get("layers") or []
    if len(diff_ids) != len(layers):
        raise _fail(where, f"ModelPack: {len(layers)} layers but {len(diff_ids)} diffIds in the config")
    for ldesc, diff_id in zip(layers, diff_ids, strict=True):
        kind = modelpack.compression_of(str(ldesc.get("mediaType")))
        got = seen.get(ldesc.get("digest", "")) if kind == "none" and ldesc.get("digest") == diff_id else None
        if got is None:
            got = _check_layer(image, ldesc, diff_id, rules, hash_files, kind=kind)
        path = "/" + str((ldesc.get("annotations") or {}).get(modelpack.FILEPATH, ""))
        if hash_files and list(got) != [path]:
            raise _fail(where, f"ModelPack layer {ldesc.get('digest')}: holds {sorted(got)}, its filepath says {path}")
        found.update(got)
    return manifest


def _annotations(image: Path, desc: dict[str, Any]) -> dict[str, Any]:
    """The annotations of the image manifest ``desc`` names (already checked against its digest)."""
    return dict(_check_json_blob(image, desc, OCI_MANIFEST).get("annotations") or {})


def verify_image(out_dir: Path, *, artifact_manifest: bytes | None = None,
                 vouched: Vouched | None = None) -> set[str]:
    """Check ``OUT/image`` completely; raise on the first problem.

    Args:
        out_dir: the output directory holding ``image/``.
        artifact_manifest: when given, the image's files must equal the artifact files
            listed in its ``files`` map and its ``manifest.json`` must equal these bytes.
        vouched: the build's own re-read of its weight layer blobs (:data:`Vouched`): such a
            blob, while it is the file that was read (:func:`~packer.util.fsutil.identity`), takes
            its digest from there; the file inside it, with ``artifact_manifest``, that read's
            sha256. Anything else is hashed here.

    Returns:
        The digests of the blobs whose content was checked (so callers need not hash them again).

    Raises:
        VerifyError: naming the blob or entry and what is wrong;
            ImageArtifactMismatchError: the image is sound but differs from ``artifact_manifest``.
    """
    image = Path(out_dir) / "image"
    checked: set[str] = set()
    marker = read_bytes(image / "oci-layout", OCI_DOC, error=VerifyError, where=f"{image}: not a readable OCI layout")
    if marker != OCI_LAYOUT:
        raise _fail(str(image / "oci-layout"), "not an OCI image layout 1.0.0 marker")
    index = read_json(image / "index.json", OCI_DOC, error=VerifyError, shape=INDEX,
                      where=f"{image / 'index.json'}: unreadable")
    if index.get("schemaVersion") != 2 or index.get("mediaType", OCI_INDEX) != OCI_INDEX:
        raise _fail(str(image / "index.json"), "not an OCI image index (schemaVersion 2)")
    manifests = index.get("manifests") or []
    if not manifests:
        raise _fail(str(image / "index.json"), "lists no manifest")
    # a signed build's provenance referrer is checked against the provenance (packer.oci.referrer)
    # a warm state's image is checked against its state (packer.oci.warm_layer)
    images = [d for d in manifests if d.get("artifactType") not in (modelpack.ARTIFACT_TYPE, REFERRER_TYPE)
              and not is_warm(d)]
    views = [d for d in manifests if d.get("artifactType") == modelpack.ARTIFACT_TYPE]
    if not images:
        raise _fail(str(image / "index.json"), "lists no image manifest (only artifacts)")
    ann: dict[str, Any] = {}
    rules: dict[str, Any] = {}
    seen: dict[str, Expected] = {}  # files of each image layer, by blob digest
    for desc in images + views:
        if not (desc.get("annotations") or {}).get(REF_NAME):
            where = str(image / "index.json")
            raise _fail(where, f"manifest {desc.get('digest')} has no {REF_NAME}")
        found: Expected = {}
        offsets: Offsets = {}
        hash_files = artifact_manifest is not None
        if desc in views:  # checked with the tar rules of the image it was written beside
            manifest = _check_modelpack(image, desc, found, hash_files, rules, seen)
            layer_blobs = [lay["digest"] for lay in manifest["layers"]]
        else:
            try:
                manifest = _check_manifest(image, desc, found, hash_files, seen, offsets, vouched)
            except BlobDigestError as e:
                if artifact_manifest is None:
                    raise
                raise _name_the_file(Path(out_dir), e, artifact_manifest, _annotations(image, desc)) from e
            ann = manifest.get("annotations") or {}
            rules = _rules(ann, _check_json_blob(image, manifest["config"], OCI_CONFIG).get("created", ""))
            layer_blobs = [lay["digest"] for lay in manifest["layers"]]
        if artifact_manifest is not None:
            try:
                _check_artifacts(found, artifact_manifest, ann, str(image), complete=desc not in views)
                if desc not in views:
                    _check_places(offsets, artifact_manifest, ann, str(image))
            except VerifyError as e:  # the image is sound; what it was compared with differs
                raise ImageArtifactMismatchError(str(e)) from e
        checked |= {desc["digest"], manifest["config"]["digest"], *layer_blobs}
    return checked

