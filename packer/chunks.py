"""The build side's door to :mod:`packer.runtime.chunks`: the chunk table written and checked.

The build hashes each weight file's chunks in the read it already makes of the file
(:func:`packer.oci.reread.reread_blobs`, one buffer feeding the file's sha256 and its chunk's);
:func:`chunk_table` turns those digests into the bytes of ``weights/packer-chunks.json``, which
the manifest pins and ``model.sig`` signs (:func:`packer.runtime.signature.model_layout`).
:func:`verify_chunks` is ``packer verify``'s check of the table against the bytes: for the
build's own final verification the table must equal what the re-read hashed (nothing is read
again); otherwise every chunk is read and hashed, and the first that differs is named by the
runtime's one prover (:func:`packer.runtime.proof.prove_chunk`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from packer.errors import ChunkMismatchError, VerifyError
from packer.hashing import HASH_READ
from packer.place import FilePlace
from packer.reading import JSON_DOC, open_regular, read_bytes
from packer.runtime.chunks import CHUNKS_NAME, CHUNKS_REL, MAX_CHUNK, MIN_CHUNK, FileChunks, parse_table, table_doc
from packer.runtime.env import ArtifactMismatchError
from packer.runtime.proof import hash_span, prove_chunk
from packer.util.formats import MANIFEST_NAME, SAFETENSORS_SUFFIX
from packer.util.fsutil import FileEntry, canonical_json

__all__ = ["CHUNKS_NAME", "CHUNKS_REL", "DEFAULT_CHUNK", "MAX_CHUNK", "MIN_CHUNK", "chunk_difference", "chunk_table",
           "verify_chunks"]

DEFAULT_CHUNK = 1 << 20  # 1 MiB: benchmarks/RESULTS.md ("Chunk size") gives the numbers


Hashed = tuple[int, tuple[str, ...], tuple[int, ...]]  # (chunk size, chunk digests, cuts) of one file


def chunk_table(files: tuple[FileEntry, ...], digests: Mapping[str, Hashed]) -> bytes | None:
    """The bytes of ``packer-chunks.json`` (``packer-chunks/v2``) for the weight files hashed in chunks.

    Args:
        files: the weights stage's files (each file's final size and sha256).
        digests: ``{path in OUT: (chunk size, chunk digests, cuts)}`` from the build's read of
            the bytes (:func:`packer.hashing.sha256_chunked`).

    Returns:
        canonical JSON (same digests, same bytes), or None when no file was hashed in chunks.

    Raises:
        ValueError: files hashed with different chunk sizes (a bug in the build).
    """
    sizes = {chunk for chunk, _, _ in digests.values()}
    if not sizes:
        return None
    if len(sizes) != 1:
        raise ValueError(f"chunk_table: one chunk size per build, got {sorted(sizes)}")
    by_path = {f.path: f for f in files}
    table = {rel: (by_path[rel].size, by_path[rel].sha256, chunks, cuts) for rel, (_, chunks, cuts) in digests.items()}
    return canonical_json(table_doc(sizes.pop(), table))


def _read_table(out: Path, manifest: Mapping[str, Any]) -> dict[str, FileChunks] | None:
    rel = (manifest.get("weights") or {}).get("chunks")
    if rel is None:
        return None
    if rel != CHUNKS_REL or rel not in manifest["files"]:
        raise VerifyError(f"{out / MANIFEST_NAME}: weights.chunks {str(rel)[:80]!r} is not {CHUNKS_REL}, "
                          "pinned in files")
    data = read_bytes(out / rel, JSON_DOC, error=VerifyError)
    pinned = manifest["files"][rel].get("sha256") if isinstance(manifest["files"][rel], dict) else None
    got = hash_span(data, 0, len(data), str(out / rel))
    if got != pinned:  # before its digests are believed
        raise VerifyError(f"{out / rel}: sha256 {got[:16]}... differs from the manifest's {str(pinned)[:16]}...")
    try:
        return parse_table(data, str(out / rel), manifest["files"])
    except ArtifactMismatchError as e:
        raise VerifyError(str(e)) from None


def _hashed(out: Path, place: FilePlace, fc: FileChunks) -> tuple[str, ...]:
    path, offset, _ = place.path(out)
    try:  # each chunk by the one span hasher: every byte read once, in reads of HASH_READ
        with open_regular(path, VerifyError) as f:
            return tuple(hash_span(f.fileno(), offset + a, b - a, str(path), buffer=HASH_READ)
                         for a, b in map(fc.bounds, range(fc.total)))
    except (OSError, ArtifactMismatchError) as e:  # missing or unreadable: a VerifyError, as any
        raise VerifyError(f"{path}: cannot read {place.rel} to check its chunks ({e})") from e


def verify_chunks(out: Path, manifest: Mapping[str, Any], places: Mapping[str, FilePlace],
                  vouched: Mapping[str, Hashed] | None = None) -> int:
    """Check the build's chunk table against the weight files' bytes.

    Args:
        out: the build directory.
        manifest: its manifest (``weights.chunks`` names the table; absent: nothing to check).
        places: every files entry, read (:func:`packer.place.places_of`).
        vouched: ``{path in OUT: (chunk size, digests, cuts)}`` the build's own re-read hashed,
            for its final verification: those files are not read again.

    Returns:
        the bytes hashed here (0 when everything was vouched for or there is no table).

    Raises:
        VerifyError: a malformed table, one that leaves out a weight file, or (its subclass
            :class:`~packer.errors.ChunkMismatchError`) a chunk whose bytes differ, naming the
            file and the chunk (index and byte range).
    """
    table = _read_table(out, manifest)
    if table is None:
        return 0
    weights = [rel for rel in places if rel.endswith(SAFETENSORS_SUFFIX) and rel.startswith("weights/")]
    missing = sorted(set(weights) - set(table))
    if missing:
        raise VerifyError(f"{out / CHUNKS_REL}: holds no chunk digests of {missing[0]}")
    hashed = 0
    for rel, fc in sorted(table.items()):
        mine = (vouched or {}).get(rel)
        if mine is not None and (mine[0], (0, *mine[2])) == (fc.chunk, fc.cuts):
            got = mine[1]
        else:
            got, hashed = _hashed(out, places[rel], fc), hashed + fc.size
        if len(got) != fc.total:  # the table's own count: a digest missing is a chunk unproven
            raise VerifyError(f"{out / CHUNKS_REL}: {len(got)} chunks of {rel} hashed, the table holds {fc.total}")
        try:
            for i, digest in enumerate(got):  # the runtime's one prover, its one message
                prove_chunk(_where(out, places[rel]), fc, i, digest, table=CHUNKS_REL)
        except ArtifactMismatchError as e:
            raise ChunkMismatchError(str(e)) from None
    return hashed


def _where(out: Path, place: FilePlace) -> str:
    """The file as found: a file of its own, or its bytes in a layer blob."""
    path, offset, _ = place.path(out)
    return f"{path} ({place.rel} at offset {offset})" if place.in_blob else str(path)


def chunk_difference(out: Path, manifest: Mapping[str, Any], places: Mapping[str, FilePlace]) -> str | None:
    """Where the chunk table places a difference in the weight files (the first chunk that
    differs, in words), for a refusal that blamed a whole blob; None when it finds none or
    cannot tell (no table, a table that is itself wrong)."""
    try:
        verify_chunks(out, manifest, places)
    except ChunkMismatchError as e:
        return str(e)
    except VerifyError:
        return None
    return None
