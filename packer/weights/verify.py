"""Check written safetensors: re-parsed by the safetensors library, bytes against the sources.

Two entry points: :func:`verify_written` runs right after a conversion (it has the plan and
the open inputs, and compares tensor bytes bytewise, streaming), :func:`verify_weights` runs
from ``packer verify`` with only the output and its manifest section (structure only; the
manifest's sha256s pin the bytes).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from packer.errors import VerifyError, missing_dependency
from packer.place import FilePlace
from packer.reading import JSON_DOC, check_regular, map_readonly, open_regular, parse_json, read_json
from packer.safetensors_header import MAX_HEADER_BYTES, read_header_file
from packer.weights.plan import ALIASES_KEY, ShardPlan, WeightsPlan
from packer.weights.writer import CHUNK, Sources, pieced_chunks, tensor_chunks


def library_table(path: Path, *, offset: int = 0,
                  size: int | None = None) -> tuple[dict[str, tuple[str, list[int]]], dict[str, str]]:
    """Open ``path`` with the safetensors library: ``({name: (dtype, shape)}, metadata)``.

    With ``size`` the file is the ``size`` bytes at ``offset`` of ``path`` (a weight file inside
    its layer blob): the library, which opens whole files only, is shown its header in a
    sparse file of that size (it checks the header against the size and reads no data).

    Raises:
        VerifyError: the library rejects the file.
        DependencyError: safetensors or numpy cannot be imported.
    """
    if size is not None:
        with tempfile.TemporaryDirectory(prefix="packer-header-") as tmp:
            shown = Path(tmp) / path.name
            _header_copy(path, offset, size, shown)
            try:
                return library_table(shown)
            except VerifyError as e:
                raise VerifyError(str(e).replace(str(shown), f"{path} (at offset {offset})", 1)) from e
    try:
        from safetensors import safe_open

        check_regular(path, VerifyError)  # the library opens the path itself: never a FIFO
        with safe_open(str(path), framework="numpy") as f:
            table = {}
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                part = f.get_slice(name)
                table[name] = (part.get_dtype(), list(part.get_shape()))
            return table, dict(f.metadata() or {})
    except ImportError as e:  # safetensors or numpy missing: the environment, not the file
        raise missing_dependency(e) from e
    except Exception as e:  # the library raises its own untyped errors about the file
        raise VerifyError(f"{path}: the safetensors library rejects it: {e}") from e


def _header_copy(path: Path, offset: int, size: int, dest: Path) -> None:
    """``dest``: the safetensors header at ``offset`` of ``path``, then a hole up to ``size``."""
    with open_regular(path, VerifyError) as f:
        head = os.pread(f.fileno(), 8, offset)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 <= n <= min(size - 8, MAX_HEADER_BYTES):
            raise VerifyError(f"{path}: safetensors header at offset {offset}: declares {n} bytes "
                              f"(file {size}, cap {MAX_HEADER_BYTES})")
        raw = head + os.pread(f.fileno(), n, offset + 8)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, raw)
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _first_difference(got: Mapping[str, Any], want: Mapping[str, Any]) -> str:
    return sorted(n for n in set(got) | set(want) if got.get(n) != want.get(n))[0]


def _check_table(path: Path, shard: ShardPlan, label: Path, base: int) -> None:
    try:
        table, _ = library_table(path, offset=base, size=shard.size) if base else library_table(path)
    except VerifyError as e:
        raise VerifyError(str(e).replace(str(path), str(label), 1)) from e
    want = {t.name: (t.dtype, list(t.shape)) for t in shard.tensors}
    if table != want:
        first = _first_difference(table, want)
        raise VerifyError(f"{label}: tensor {first!r} differs from the plan: "
                          f"{table.get(first)} != {want.get(first)}")
    header, _ = read_header_file(path, error=VerifyError, offset=base, size=shard.size)
    for t in shard.tensors:
        if header[t.name]["data_offsets"] != [t.begin, t.end]:
            raise VerifyError(f"{label}: tensor {t.name!r}: data_offsets differ from the plan")


def _compare_bytes(
    path: Path, shard: ShardPlan, sources: Sources, skip: Collection[str], label: Path, base: int
) -> None:
    fd, mm, size = map_readonly(path, VerifyError)
    with os.fdopen(fd, "rb"):
        if size != shard.size if not base else size < base + shard.size:
            raise VerifyError(f"{label}: size {size - base} != planned {shard.size}")
        if not shard.data_size or mm is None:
            if mm is not None:
                mm.close()
            return
        data = memoryview(mm)[base + len(shard.header):base + shard.size]
        for t in shard.tensors:
            if t.name not in skip:
                _compare_tensor(label, t, data, sources)
        data.release()
        mm.close()  # on errors the traceback holds views; the mmap goes with it


def _compare_tensor(path: Path, t: Any, out: memoryview, sources: Sources) -> None:
    pos = t.begin
    expected: Iterable[bytes | memoryview]
    if t.record.pieces:  # assembled from a distributed checkpoint's shards
        expected = pieced_chunks(t, sources)
    elif t.contiguous and not t.cast:
        _, data = sources.get(t.record.storage.path)
        src = t.source_offset
        expected = (data[src + i:src + min(i + CHUNK, t.end - t.begin)]
                    for i in range(0, t.end - t.begin, CHUNK))
    else:
        expected = tensor_chunks(t, sources.get(t.record.storage.path)[1])
    for chunk in expected:
        want = memoryview(chunk)
        if bytearray(out[pos:pos + len(want)]) != want:  # memcmp: NaN payloads compare too
            raise VerifyError(f"{path}: tensor {t.name!r}: bytes at data offset {pos} differ "
                              f"from {t.record.storage.path.name}:{t.record.name}")
        pos += len(want)
    if pos != t.end:
        raise VerifyError(f"{path}: tensor {t.name!r}: {pos - t.begin} bytes, planned "
                          f"{t.end - t.begin}")


def verify_written(
    plan: WeightsPlan, paths: Mapping[str, Path], sources: Sources, *, skip: Collection[str] = (),
    bases: Mapping[str, int] | None = None,
) -> None:
    """Re-parse each written shard with the safetensors library and compare its bytes.

    Args:
        plan: the plan the shards were written from.
        paths: shard filename -> where it was written (temporary names are fine).
        sources: the open input files.
        skip: tensors whose bytes were already compared while writing.
        bases: shard filename -> the offset of the shard in its file (a layer blob, whose tar
            framing comes first); 0 where not given.

    Raises:
        VerifyError: naming the file, the tensor and the first difference.
    """
    for shard in plan.shards:
        path, base = paths[shard.filename], (bases or {}).get(shard.filename, 0)
        label = path.parent / shard.filename  # name the file as it will be, not the temp
        _check_table(path, shard, label, base)
        _compare_bytes(path, shard, sources, skip, label, base)


def located(out_dir: Path, rel: str, places: Mapping[str, FilePlace]) -> tuple[Path, int, int | None]:
    """Where the weight file ``rel``'s bytes are: ``(path, offset, size)``; a file of its own is
    ``(out_dir/rel, 0, None)``, one held in its layer blob the blob, the offset and its size.

    ``places`` are the manifest's files entries as the caller read them (``packer.verifying``)."""
    place = places.get(rel)
    if place is not None and place.in_blob:
        return place.path(out_dir)
    return out_dir / rel, 0, None


def verify_weights(out_dir: Path, section: dict[str, Any], places: Mapping[str, FilePlace] | None = None) -> None:
    """Check shards and index under ``out_dir`` against a manifest ``weights`` section.

    Reads the headers only (the caller hashes the bytes).

    Args:
        out_dir: the directory the section's relative paths start from (OUT).
        section: the manifest's weights section, as :func:`packer.weights.convert` wrote it.
        places: the manifest's files entries, read (:func:`packer.place.places_of`): a weight
            file held in a layer blob is read there.

    Raises:
        VerifyError: a header the library rejects, or a table or index that differs.
    """
    tensors: dict[str, Any] = section.get("tensors", {})
    aliases = section.get("aliases", {})
    seen: set[str] = set()
    for rel in section.get("files", []):
        where, offset, size = located(out_dir, rel, places or {})
        path = out_dir / rel if size is None else Path(f"{out_dir / rel} (in {where}, at offset {offset})")
        table, meta = library_table(where, offset=offset, size=size) if size is not None else library_table(where)
        header, start = read_header_file(where, error=VerifyError, offset=offset, size=size)
        mine = {n: v for n, v in tensors.items() if v["file"] == rel}
        want = {n: (v["dtype"], list(v["shape"])) for n, v in mine.items()}
        if table != want:
            first = _first_difference(table, want)
            raise VerifyError(f"{path}: tensor {first!r} differs from the manifest: "
                              f"{table.get(first)} != {want.get(first)}")
        for n, v in mine.items():
            if header[n]["data_offsets"] != list(v["data_offsets"]):
                raise VerifyError(f"{path}: tensor {n!r}: data_offsets differ from the manifest")
        file_aliases = {a: k for a, k in aliases.items() if k in mine}
        if parse_json(meta.get(ALIASES_KEY, "{}"), JSON_DOC, where=f"{path}: metadata {ALIASES_KEY}",
                      error=VerifyError) != file_aliases:
            raise VerifyError(f"{path}: metadata {ALIASES_KEY} differs from the manifest")
        end = max((v["data_offsets"][1] for v in mine.values()), default=0)
        got = where.stat().st_size if size is None else size
        if got != start + end:
            raise VerifyError(f"{path}: size {got} != {start + end} expected")
        seen.update(mine)
    if seen != set(tensors):
        raise VerifyError(f"{out_dir}: tensor {sorted(set(tensors) - seen)[0]!r} is in no file")
    _verify_index(out_dir, section)


def _verify_index(out_dir: Path, section: dict[str, Any]) -> None:
    rel = section.get("index")
    if rel is None:
        if len(section.get("files", [])) != 1:
            raise VerifyError(f"{out_dir}: {len(section.get('files', []))} shards but no index")
        return
    path = out_dir / rel
    index = read_json(path, JSON_DOC, error=VerifyError, where=f"{path}: cannot read index")
    base = str(Path(rel).parent)
    want_map = {n: str(Path(v["file"]).relative_to(base) if base != "." else v["file"])
                for n, v in section["tensors"].items()}
    if not isinstance(index, dict) or index.get("weight_map") != want_map:
        raise VerifyError(f"{path}: weight_map differs from the manifest")
    meta = index.get("metadata") or {}
    if meta.get("total_size") != section.get("total_size"):
        raise VerifyError(f"{path}: metadata.total_size {meta.get('total_size')} != "
                          f"{section.get('total_size')}")
    if meta.get(ALIASES_KEY, {}) != section.get("aliases", {}):
        raise VerifyError(f"{path}: metadata {ALIASES_KEY} differs from the manifest")
