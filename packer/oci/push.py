"""``packer push``: copy ``OUT/image``'s image and ModelPack view to a registry with skopeo (no daemon needed)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from packer.errors import ImageError
from packer.oci.base import OCI_INDEX, REF_NAME
from packer.oci.base_docs import INDEX, REFERRER
from packer.oci.layout import OCI_LAYOUT
from packer.oci.modelpack import ARTIFACT_TYPE, modelpack_tag
from packer.oci.referrer import is_referrer, referrers_tag
from packer.oci.registry_ref import check_ref
from packer.reading import OCI_DOC, blob_path, open_regular, read_json, read_text
from packer.util.fsutil import atomic_open, atomic_write_bytes, canonical_json
from packer.util.idents import digest_parts, shown


def _index(image: Path) -> list[dict[str, Any]]:
    """The descriptors ``image/index.json`` lists, each digest already of the digest grammar."""
    doc = read_json(image / "index.json", OCI_DOC, error=ImageError, shape=INDEX,
                    where=f"{image / 'index.json'}: cannot read the image index")
    return list(doc["manifests"])


def image_tags(out_dir: Path) -> tuple[str, str | None]:
    """The tags (``org.opencontainers.image.ref.name``) in ``OUT/image``: the image's and the
    ModelPack view's (None when the layout has none).

    Raises:
        ImageError: no readable layout, or not one tagged image (and at most one ModelPack view).
    """
    index_path = Path(out_dir) / "image" / "index.json"
    tags = {True: [], False: []}  # type: dict[bool, list[str | None]]
    for m in _index(index_path.parent):
        if not is_referrer(m):  # found by its subject, never by a tag (packer.oci.referrer)
            tags[m.get("artifactType") == ARTIFACT_TYPE].append((m.get("annotations") or {}).get(REF_NAME))
    images, views = tags[False], tags[True]
    if len(images) != 1 or not images[0] or len(views) > 1 or (views and not views[0]):
        raise ImageError(f"{index_path}: expected one tagged image and at most one ModelPack view, "
                         f"found {len(images)} and {len(views)}")
    return str(images[0]), (str(views[0]) if views else None)


TROUBLESHOOTING = "docs/troubleshooting.md#a-push-refused-with-400-or-401"


def _hint(stderr: str, *, tls_verify: bool) -> str:
    """The likely cause of a failed copy, from skopeo's message, and where it is explained."""
    if tls_verify and "HTTP response to HTTPS client" in stderr:
        return "; the registry answers in plain HTTP: for a local or test registry pass --no-tls-verify"
    if any(k in stderr for k in ("401 (Unauthorized)", "unauthorized", "authentication required")):
        return (f"; the registry asks for credentials: log in (skopeo login HOST, or an auth file in "
                f"REGISTRY_AUTH_FILE) or serve a test registry without an auth section (see {TROUBLESHOOTING})")
    if "400 (Bad Request)" in stderr:
        return ("; a registry with an auth section it cannot use answers 400 (Debian's docker-registry's default "
                f"config names an htpasswd file that does not exist): remove the auth section (see {TROUBLESHOOTING})")
    return ""


def _copy(skopeo: str, src: str, dest: str, *, tls_verify: bool, timeout: float, every: bool = False) -> str:
    with tempfile.TemporaryDirectory(prefix="packer-push-") as tmp:
        digest_file = Path(tmp) / "digest"
        cmd = [skopeo, "copy", "--quiet", "--preserve-digests", "--digestfile", str(digest_file),
               *(["--all"] if every else []),
               f"--dest-tls-verify={'true' if tls_verify else 'false'}", src, dest]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as e:
            raise ImageError(f"push to {dest}: skopeo timed out after {timeout:.0f} s") from e
        if proc.returncode != 0:
            msg = (proc.stderr.strip().splitlines() or ["no message"])[-1]
            raise ImageError(f"push to {dest}: skopeo failed: {msg}{_hint(proc.stderr, tls_verify=tls_verify)}")
        digest = read_text(digest_file, error=ImageError, where=f"push to {dest}: skopeo's digest file").strip()
        if digest_parts(digest) is None:
            raise ImageError(f"push to {dest}: skopeo reported {shown(digest)}, not a digest")
        return digest


def _referrers(image: Path) -> list[tuple[object, dict[str, Any], list[Path]]]:
    """Every referrer in ``image``: its subject's digest, its index entry and its blobs (the
    referrer manifest's, its config's, its layers'), every path made from a checked digest."""
    found = []
    for i, desc in enumerate(_index(image)):
        if not is_referrer(desc):
            continue
        blob = blob_path(image, desc["digest"], where=f"{image / 'index.json'}: manifests[{i}].digest",
                         error=ImageError)
        manifest = read_json(blob, OCI_DOC, error=ImageError, shape=REFERRER)
        named = [("config", manifest["config"]), *((f"layers[{j}]", d) for j, d in enumerate(manifest["layers"]))]
        blobs = [blob, *(blob_path(image, d["digest"], where=f"{blob}: {field}.digest", error=ImageError)
                         for field, d in named)]
        found.append(((manifest.get("subject") or {}).get("digest"), desc, blobs))
    return found


def _push_referrers(skopeo: str, referrers: list[tuple[object, dict[str, Any], list[Path]]], subject: str,
                    repo: str, *, tls_verify: bool, timeout: float) -> dict[str, str]:
    """Push the referrers of ``subject`` under the referrers tag schema's tag (``sha256-<hex>``).

    Registries without the referrers API (distribution 2.x, Debian's docker-registry) find a
    subject's referrers by that tag, which holds an image index listing them; skopeo (which
    knows no referrers API) copies the index and, with ``--all``, the referrer manifests and
    blobs. A registry with the API indexes the pushed manifests by their ``subject`` as well.
    ``referrers`` is :func:`_referrers` of the layout, read before anything was pushed.
    """
    found = [(desc, paths) for of, desc, paths in referrers if of == subject]
    if not found:
        return {}
    with tempfile.TemporaryDirectory(prefix="packer-referrers-") as tmp:
        layout = Path(tmp)
        blobs = layout / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        for _, paths in found:  # the referrer, its empty config and its one layer: small files
            for path in paths:
                with open_regular(path, ImageError) as src, atomic_open(blobs / path.name) as dst:
                    shutil.copyfileobj(src, dst)
        descs = [desc for desc, _ in found]
        tag = referrers_tag(subject)
        listed = [{k: v for k, v in d.items() if k != "artifactType"} for d in descs]
        raw = _go_order({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": listed})
        hexd = hashlib.sha256(raw).hexdigest()
        listing: dict[str, Any] = {"mediaType": OCI_INDEX, "digest": f"sha256:{hexd}", "size": len(raw)}
        atomic_write_bytes(blobs / hexd, raw)
        atomic_write_bytes(layout / "oci-layout", OCI_LAYOUT)
        atomic_write_bytes(layout / "index.json", canonical_json(
            {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [{**listing, "annotations": {REF_NAME: tag}}]}))
        dest = f"{repo}:{tag}"
        return {dest: _copy(skopeo, f"oci:{layout}:{tag}", f"docker://{dest}", tls_verify=tls_verify,
                            timeout=timeout, every=True)}


_GO_FIELDS = ("schemaVersion", "mediaType", "digest", "size", "manifests", "annotations")


def _go_order(index: dict[str, Any]) -> bytes:
    """``index`` with its keys in the order containers/image's structs write them.

    skopeo re-serializes an index it copies with ``--all`` and refuses (with
    ``--preserve-digests``) when the bytes differ, so the listing is written the way it
    writes it: struct field order, maps sorted, no spaces. skopeo before 1.11 also drops a
    descriptor's ``artifactType`` (image-spec 1.1), so the listing has none: its entries are
    told apart by their ``dev.sigstore.bundle.*`` annotations.
    """
    def ordered(d: dict[str, Any]) -> dict[str, Any]:
        return {k: d[k] for k in sorted(d, key=lambda k: (_GO_FIELDS.index(k) if k in _GO_FIELDS else 99, k))}

    body = {**ordered(index), "manifests": [
        {**ordered(m), "annotations": dict(sorted(m["annotations"].items()))} if m.get("annotations") else ordered(m)
        for m in index["manifests"]]}
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def _repository(dest: str) -> str:
    """``host/repo`` of ``host/repo[:tag][@digest]``."""
    name = dest.partition("@")[0]
    head, _, last = name.rpartition("/")
    return f"{head}/{last.partition(':')[0]}" if head else last.partition(":")[0]


def push(out_dir: Path, ref: str, *, tls_verify: bool = True, timeout: float = 3600) -> dict[str, str]:
    """Copy ``oci:OUT/image:TAG`` to ``docker://REF``, and the ModelPack view beside it.

    The manifests are pushed unchanged (``--preserve-digests``), so the registry's digests are
    the local ones; the ModelPack view goes to REF's tag with ``-modelpack`` appended
    (``repo:1.0`` -> ``repo:1.0-modelpack``) and shares the weight blobs already pushed. A
    signed build's provenance referrer goes under the referrers tag schema's tag of the image
    manifest (``repo:sha256-<hex>``, an index listing it; see :func:`_push_referrers`).

    Args:
        out_dir: the packer output directory.
        ref: registry reference, ``host[:port]/repo[:tag]`` (a ``docker://`` prefix is optional).
        tls_verify: verify the registry's TLS certificate (False for a local test registry).
        timeout: seconds before one copy is abandoned.

    Returns:
        ``{reference pushed: manifest digest}``, the image first (for the referrers tag: the
        digest of the index listing them).

    This copies; it does not verify OUT against its manifest (``packer push`` runs
    :func:`packer.pushing.push`, which does that first). Every digest it reads is checked against
    the digest grammar before it names a file, and before the first copy.

    Raises:
        UsageError: ``ref`` is not a registry reference (:func:`packer.oci.registry_ref.check_ref`).
        ImageError: an unreadable layout or a malformed digest in it, skopeo is not installed,
            or a copy failed (with skopeo's message).
    """
    dest = check_ref(ref)
    image = Path(out_dir).resolve() / "image"
    tag, view = image_tags(out_dir)  # the input first: every digest checked before the first copy
    referrers = _referrers(image)
    skopeo = shutil.which("skopeo")
    if skopeo is None:
        raise ImageError("push: skopeo is not installed; install it (apt-get install skopeo) "
                         "or push OUT/image with another OCI tool")
    pushed = {dest: _copy(skopeo, f"oci:{image}:{tag}", f"docker://{dest}", tls_verify=tls_verify,
                          timeout=timeout)}
    if view is not None:
        view_dest = modelpack_tag(dest)
        pushed[view_dest] = _copy(skopeo, f"oci:{image}:{view}", f"docker://{view_dest}",
                                  tls_verify=tls_verify, timeout=timeout)
    pushed.update(_push_referrers(skopeo, referrers, pushed[dest], _repository(dest), tls_verify=tls_verify,
                                  timeout=timeout))
    return pushed
