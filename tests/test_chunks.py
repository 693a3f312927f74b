"""Chunk digests (packer/runtime/chunks.py, packer/chunks.py): proof at the size of a read.

The build hashes each weight file per chunk in the re-read it already makes and pins the table
(``weights/packer-chunks.json``) in the manifest and in ``model.sig``; ``packer verify`` checks
it and names the chunk of a changed byte; a tensor-parallel rank that verifies hashes only the
chunks of what it reads, and a changed byte is refused by the rank whose span holds it, only
there (real gloo ranks, as tests/test_tp.py runs them).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest
import torch

from packer.building import build
from packer.chunks import CHUNKS_REL
from packer.errors import ChunkMismatchError, VerifyError
from packer.hashing import sha256_chunked
from packer.recipe import demo_recipe, with_sign_key
from packer.runtime.chunks import TP_DEGREES, FileChunks, chunk_ends, parse_table, split
from packer.runtime.env import ArtifactMismatchError
from packer.runtime.proof import SpanCheck
from packer.runtime.signature import model_layout, require_signature
from packer.util.fsutil import canonical_json
from packer.verifying import verify
from tests.built import build_dir, open_build, weight_location
from tests.hf_fixtures import llama
from tests.sign_fixtures import make_keypair
from tests.test_tp import WIDE

REPO = Path(__file__).resolve().parents[1]
CHUNK = 32 * 1024  # the recipe's chunk_size here: many chunks per rank's span in a small model
WEIGHTS = "weights/model.safetensors"


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))


def _copy(out: Path, dest: Path) -> Path:
    shutil.copytree(out, dest, symlinks=True)  # real copies: a flip must not reach the original
    return dest


# --- the pieces ---


@pytest.mark.parametrize("chunk", [4096, 65536, 1 << 20, 3 << 20])
@pytest.mark.parametrize(("start", "cut"), [(0, 0), (4096, 5), (0, 2**20 * 3 + 17)])
@pytest.mark.parametrize("cuts", [(), (1, 4095, 2**20 + 3, 2**20 + 4)])
def test_one_read_gives_the_file_and_its_chunks(tmp_path: Path, chunk: int, start: int, cut: int,
                                                cuts: tuple[int, ...]) -> None:
    data = os.urandom(3 * 2**20 + 4096 + 777)
    (tmp_path / "f").write_bytes(data)
    end = len(data) - cut
    cuts = tuple(c for c in cuts if c < end - start)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        whole, chunks = sha256_chunked(fd, start, end, chunk, cuts)
    finally:
        os.close(fd)
    part = data[start:end]
    assert whole == hashlib.sha256(part).hexdigest()
    edges = [0, *chunk_ends(len(part), chunk, cuts)]  # the grid restarted at each cut
    assert set(cuts) <= set(edges) and all(0 < b - a <= chunk for a, b in pairwise(edges))
    assert list(chunks) == [hashlib.sha256(part[a:b]).hexdigest() for a, b in pairwise(edges)]


def _table(data: bytes, chunk: int) -> dict[str, FileChunks]:
    digests = "".join(hashlib.sha256(data[i:i + chunk]).hexdigest() for i in range(0, len(data), chunk))
    return {"w": FileChunks(chunk, len(data), hashlib.sha256(data).hexdigest(), digests)}


def test_a_span_check_hashes_the_chunks_it_covers_and_names_a_changed_one(tmp_path: Path) -> None:
    data = bytearray(os.urandom(10 * 4096 + 100))
    path = tmp_path / "blob"
    path.write_bytes(b"\0" * 8192 + bytes(data))  # the file at offset 8192 of a blob
    check = SpanCheck(_table(bytes(data), 4096), "rank 1 of 2")
    fd = os.open(path, os.O_RDONLY)
    try:
        check.check("w", fd, 8192, 5000, memoryview(data)[5000:13000])  # chunks 1..3
        assert (check.chunks, check.hashed) == (3, 3 * 4096)
        check.check("w", fd, 8192, 40960, memoryview(data)[40960:])  # the short last chunk
        assert (check.chunks, check.hashed) == (4, 3 * 4096 + 100)
    finally:
        os.close(fd)
    _flip(path, 8192 + 4096 * 7 + 3)  # in chunk 7, outside the span read next
    fd = os.open(path, os.O_RDONLY)
    try:
        check.check("w", fd, 8192, 0, memoryview(data)[:4096 * 6])  # chunks 0..5: untouched
        with pytest.raises(ArtifactMismatchError, match=r"^w: chunk 7 \(bytes \[28672, 32768\) of 41060\) has sha256 "
                                                        r"\w+\.\.\., the chunk table pins \w+\.\.\. on rank 1 of 2"):
            check.check("w", fd, 8192, 4096 * 7 + 10, memoryview(data)[4096 * 7 + 10: 4096 * 7 + 20])
    finally:
        os.close(fd)


@pytest.mark.parametrize(("edit", "reason"), [
    (lambda t: t.update(chunk_size=1000), "chunk_size 1000"),
    (lambda t: t.update(format="x"), "not a packer-chunks/v2 (or packer-chunks/v1) table"),
    (lambda t: t["files"][WEIGHTS].update(cuts=[100]), "a packer-chunks/v1 table has no cuts"),
    (lambda t: t["files"][WEIGHTS].update(chunks=t["files"][WEIGHTS]["chunks"][:-64]), "expected 2 chunk digests"),
    (lambda t: t["files"][WEIGHTS].update(chunks=t["files"][WEIGHTS]["chunks"].upper()), "expected 2 chunk"),
    (lambda t: t["files"][WEIGHTS].update(size=5000), "not what the manifest pins"),
    (lambda t: t["files"][WEIGHTS].update(size=9000), "expected 3 chunk digests"),
    (lambda t: t["files"][WEIGHTS].update(sha256="1" * 64), "not what the manifest pins"),
    (lambda t: t["files"].update({"../x": t["files"][WEIGHTS]}), "not a relative path inside"),
])
def test_a_malformed_table_is_refused_in_one_line(edit: Any, reason: str) -> None:
    data = os.urandom(6000)
    sha = hashlib.sha256(data).hexdigest()
    table = {"format": "packer-chunks/v1", "algorithm": "sha256", "chunk_size": 4096,
             "files": {WEIGHTS: {"size": 6000, "sha256": sha, "chunks": "a" * 128}}}
    pinned = {WEIGHTS: {"size": 6000, "sha256": sha}}
    assert parse_table(canonical_json(table), "T", pinned)[WEIGHTS].digest(1) == "a" * 64
    edit(table)
    with pytest.raises(ArtifactMismatchError) as e:
        parse_table(canonical_json(table), "T", pinned)
    assert "\n" not in str(e.value) and reason in str(e.value), str(e.value)


def _v2(size: int, chunk: int, cuts: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A v2 table of one file of ``size`` bytes cut at ``cuts`` (digests of no bytes: the
    parser checks shapes, counts and the pin), and the manifest's pin of that file."""
    n = len(chunk_ends(size, chunk, cuts))
    sha = hashlib.sha256(str(size).encode()).hexdigest()
    table = {"format": "packer-chunks/v2", "algorithm": "sha256", "chunk_size": chunk,
             "files": {WEIGHTS: {"size": size, "sha256": sha, "cuts": cuts, "chunks": "b" * 64 * n}}}
    return table, {WEIGHTS: {"size": size, "sha256": sha}}


@pytest.mark.parametrize(("cuts", "reason"), [
    ([300, 200], "cut 200 is not an offset after 300"),
    ([200, 200], "cut 200 is not an offset after 200"),
    ([0], "cut 0 is not an offset after 0"),
    ([20000], "cut 20000 is not an offset after 0 inside its 20000 bytes"),
    ([-5], "cut -5"),
    ([1.5], "cut 1.5"),
    (["7"], "cut 7"),
    ([True], "cut True"),
    ("1,2", "cuts is not a list"),
    (list(range(1, 40)), "at most one offset per chunk digest"),  # more cuts than the digests it claims
])
def test_a_v2_tables_cuts_are_checked_before_use(cuts: Any, reason: str) -> None:
    table, pinned = _v2(20000, 4096, [100, 5000])
    assert parse_table(canonical_json(table), "T", pinned)[WEIGHTS].bounds(1) == (100, 4196)
    table["files"][WEIGHTS]["cuts"] = cuts
    if isinstance(cuts, list) and len(cuts) > 8:
        table["files"][WEIGHTS]["chunks"] = "b" * 64 * 8
    with pytest.raises(ArtifactMismatchError) as e:
        parse_table(canonical_json(table), "T", pinned)
    assert "\n" not in str(e.value) and reason in str(e.value), str(e.value)


def test_a_v2_table_with_a_digest_too_few_or_too_many_is_refused() -> None:
    table, pinned = _v2(20000, 4096, [100, 5000])  # chunks: [0,100) [100,4196) [4196,5000) then 4 to 20000
    assert parse_table(canonical_json(table), "T", pinned)[WEIGHTS].total == 7
    for hexes in ("b" * 64 * 6, "b" * 64 * 8):
        table["files"][WEIGHTS]["chunks"] = hexes
        with pytest.raises(ArtifactMismatchError, match="expected 7 chunk digests .* cut at 2 offsets"):
            parse_table(canonical_json(table), "T", pinned)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(size=st.integers(0, 1 << 24), chunk=st.sampled_from([4096, 65536, 1 << 20]), data=st.data())
def test_a_v2_table_tiles_its_file_and_finds_every_byte(size: int, chunk: int, data: st.DataObject) -> None:
    """Any sorted cuts inside the file parse; the chunks tile the file, none over the chunk
    size, every cut a chunk's start; ``cover`` of any span is exactly the chunks it touches."""
    inside = st.integers(1, size - 1) if size > 1 else st.nothing()
    cuts = sorted(data.draw(st.sets(inside, max_size=50))) if size > 1 else []
    table, pinned = _v2(size, chunk, cuts)
    fc = parse_table(canonical_json(table), "T", pinned)[WEIGHTS]
    edges = [fc.bounds(i)[0] for i in range(fc.total)] + [size]
    assert edges[0] == 0 and all(0 < b - a <= chunk for a, b in pairwise(edges))
    assert set(cuts) <= set(edges)
    if size:
        lo = data.draw(st.integers(0, size - 1))
        hi = data.draw(st.integers(lo + 1, size))
        got = fc.cover(lo, hi)
        assert fc.bounds(got.start)[0] <= lo < fc.bounds(got.start)[1]
        assert fc.bounds(got.stop - 1)[0] < hi <= fc.bounds(got.stop - 1)[1]


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(cuts=st.one_of(st.lists(st.one_of(st.integers(-10, 30000), st.floats(), st.text(max_size=3),
                                                     st.booleans(), st.none()), max_size=12),
                                 st.integers(), st.text(max_size=5), st.none()),
                  digests=st.integers(0, 12))
def test_any_v2_record_parses_or_is_refused_in_one_line(cuts: Any, digests: int) -> None:
    """Whatever the cuts and however many digests, the parser answers a table or one line."""
    table, pinned = _v2(20000, 4096, [])
    table["files"][WEIGHTS].update(cuts=cuts, chunks="c" * 64 * digests)
    try:
        fc = parse_table(canonical_json(table), "T", pinned)[WEIGHTS]
    except ArtifactMismatchError as e:
        assert "\n" not in str(e)
        return
    assert fc.total == digests and fc.cuts == (0, *cuts)


def test_a_v1_table_of_an_older_build_still_loads_on_the_fixed_grid() -> None:
    data = os.urandom(10000)
    sha = hashlib.sha256(data).hexdigest()
    table = {"format": "packer-chunks/v1", "algorithm": "sha256", "chunk_size": 4096,
             "files": {WEIGHTS: {"size": 10000, "sha256": sha, "chunks": "d" * 64 * 3}}}
    fc = parse_table(canonical_json(table), "T", {WEIGHTS: {"size": 10000, "sha256": sha}})[WEIGHTS]
    assert [fc.bounds(i) for i in range(fc.total)] == [(0, 4096), (4096, 8192), (8192, 10000)]
    assert fc.cover(4095, 4097) == range(0, 2) and fc.cover(9000, 10000) == range(2, 3)


# --- the build ---


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama built with 32 KiB chunks (its one weight file in its layer blob)."""
    tmp = tmp_path_factory.mktemp("chunks")
    llama(tmp / "hf", **{**WIDE, "tied": False})
    build_dir(tmp / "hf", tmp / "out", weights={"chunk_size": "32KiB"})
    return tmp / "out"


def test_the_build_pins_a_table_of_its_bytes_that_the_signature_lists(built: Path) -> None:
    manifest = json.loads((built / "manifest.json").read_bytes())
    data = (built / CHUNKS_REL).read_bytes()
    assert manifest["weights"]["chunks"] == CHUNKS_REL
    assert manifest["files"][CHUNKS_REL] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    table = parse_table(data, "t", manifest["files"])
    path, offset, size = weight_location(built, WEIGHTS)
    weights = path.read_bytes()[offset: offset + size]
    fc = table[WEIGHTS]
    assert fc.chunk == CHUNK and fc.size == size and data.startswith(b'{"algorithm":"sha256",')
    assert json.loads(data)["format"] == "packer-chunks/v2"
    assert fc.digests == tuple(hashlib.sha256(weights[a:b]).hexdigest() for a, b in map(fc.bounds, range(fc.total)))
    # a file of the model directory: what model.sig lists, model_dir() links and the image holds
    assert model_layout(manifest)["packer-chunks.json"] == (CHUNKS_REL, manifest["files"][CHUNKS_REL]["sha256"])
    assert (open_build(built).span_check() or SpanCheck({})).covers(WEIGHTS)


def test_every_ranks_span_starts_and_ends_on_a_chunk_edge(built: Path) -> None:
    """At TP 2, 4 and 8 each rank's rows of every tensor (the runtime's split), each tensor and
    the header are whole chunks: a verified rank hashes nothing of its neighbour's."""
    manifest = json.loads((built / "manifest.json").read_bytes())
    fc = open_build(built).chunk_table()[WEIGHTS]
    edges = {fc.bounds(i)[0] for i in range(fc.total)} | {fc.size}
    path, offset, _ = weight_location(built, WEIGHTS)
    with open(path, "rb") as f:
        f.seek(offset)
        head = 8 + int.from_bytes(f.read(8), "little")
    assert head in edges
    spans = 0
    for rec in manifest["weights"]["tensors"].values():
        begin, end = (head + x for x in rec["data_offsets"])
        rows = rec["shape"][0]
        assert {begin, end} <= edges
        for world in TP_DEGREES:
            for r in range(world):
                n, at = split(rows, world, r)
                row = (end - begin) // rows
                assert {begin + at * row, begin + (at + n) * row} <= edges, (rec, world, r)
                spans += 1
    assert spans > 100
    assert all(b - a <= CHUNK for a, b in map(fc.bounds, range(fc.total)))


def test_same_inputs_same_table(built: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    build_dir(built.parent / "hf", again, weights={"chunk_size": "32KiB"})
    assert (again / CHUNKS_REL).read_bytes() == (built / CHUNKS_REL).read_bytes()


def test_verify_names_the_chunk_of_a_flipped_byte(built: Path, tmp_path: Path) -> None:
    bad = _copy(built, tmp_path / "bad")
    path, offset, size = weight_location(bad, WEIGHTS)
    at = size - 3 * CHUNK + 123
    _flip(path, offset + at)
    fc = open_build(built).chunk_table()[WEIGHTS]
    c = fc.holding(at)
    a, b = fc.bounds(c)
    # the image walk blames the blob; the chunk table says where in the file
    blob = r"bad/image/blobs/sha256/\w+"
    with pytest.raises(VerifyError, match=rf"{blob}: .*; \S+{blob} \({WEIGHTS} at offset {offset}\): chunk {c} "
                                          rf"\(bytes \[{a}, {b}\) of {size}\) has sha256"):
        verify(bad)


def test_verify_checks_the_table_against_the_bytes(built: Path, tmp_path: Path) -> None:
    from packer.chunks import verify_chunks
    from packer.place import places_of

    bad = _copy(built, tmp_path / "bad")
    manifest = json.loads((bad / "manifest.json").read_bytes())
    table = json.loads((bad / CHUNKS_REL).read_bytes())
    table["files"][WEIGHTS]["chunks"] = table["files"][WEIGHTS]["chunks"][:64 * 5] + "0" * 64 \
        + table["files"][WEIGHTS]["chunks"][64 * 6:]  # chunk 5 forged, the table pinned anew
    data = canonical_json(table)
    (bad / CHUNKS_REL).write_bytes(data)
    manifest["files"][CHUNKS_REL] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    places = places_of(manifest["files"], where="m")
    assert verify_chunks(built, json.loads((built / "manifest.json").read_bytes()), places) > 0  # read, hashed: ok
    five = open_build(built).chunk_table()[WEIGHTS].bounds(5)[0]
    with pytest.raises(ChunkMismatchError, match=rf"\({WEIGHTS} at offset \d+\): chunk 5 \(bytes \[{five}, "):
        verify_chunks(bad, manifest, places)


def test_a_tampered_table_is_refused_by_verify_and_the_loader(built: Path, tmp_path: Path) -> None:
    bad = _copy(built, tmp_path / "bad")
    table = json.loads((bad / CHUNKS_REL).read_bytes())
    hexes = table["files"][WEIGHTS]["chunks"]
    table["files"][WEIGHTS]["chunks"] = "0" * 64 + hexes[64:]  # a forger's digest for chunk 0
    (bad / CHUNKS_REL).write_bytes(canonical_json(table))
    with pytest.raises(VerifyError, match=rf"{CHUNKS_REL}: sha256 \w+… differs from the manifest's"):
        verify(bad)
    with pytest.raises(ArtifactMismatchError, match=rf"{CHUNKS_REL}: sha256 \w+\.\.\., the manifest says"):
        open_build(bad).chunk_table()


def test_a_table_pinned_anew_is_refused_by_the_signature(tmp_path: Path) -> None:
    key, pub = make_keypair(tmp_path / "keys")
    out = tmp_path / "signed"
    build(with_sign_key(demo_recipe(), key), out)
    manifest = json.loads((out / "manifest.json").read_bytes())
    require_signature(out, str(pub), manifest=manifest)
    # a forger who rewrites the table and the manifest's pin of it: model.sig still signs the old digest
    manifest["files"][CHUNKS_REL] = {**manifest["files"][CHUNKS_REL], "sha256": "0" * 64}
    with pytest.raises(ArtifactMismatchError, match=r"model.sig: signs packer-chunks.json with sha256 \w+\.\.\., "
                                                    r"this loader's manifest pins 0000000000000000\.\.\."):
        require_signature(out, str(pub), manifest=manifest)


@pytest.fixture(scope="module")
def default_built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same Llama built with the default chunk size (1 MiB)."""
    tmp = tmp_path_factory.mktemp("default")
    llama(tmp / "hf", **{**WIDE, "tied": False})
    build_dir(tmp / "hf", tmp / "out")
    return tmp / "out"


@pytest.fixture(scope="module", params=["external", "single_layer"])
def plain_built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same Llama with its weight file kept as a plain file: weights mounted at run time
    (``image.weights = "external"``) or in the image's one layer (``image.single_layer``)."""
    tmp = tmp_path_factory.mktemp(request.param)
    llama(tmp / "hf", **{**WIDE, "tied": False})
    image = {"weights": "external"} if request.param == "external" else {"single_layer": True}
    build_dir(tmp / "hf", tmp / "out", weights={"chunk_size": "32KiB"}, image=image)
    return tmp / "out"


def test_a_plain_weight_file_gets_the_table_a_layer_blob_gets(built: Path, plain_built: Path) -> None:
    manifest = json.loads((plain_built / "manifest.json").read_bytes())
    assert "blob" not in manifest["files"][WEIGHTS] and manifest["weights"]["chunks"] == CHUNKS_REL
    assert (plain_built / CHUNKS_REL).read_bytes() == (built / CHUNKS_REL).read_bytes()
    assert model_layout(manifest)["packer-chunks.json"] == (CHUNKS_REL, manifest["files"][CHUNKS_REL]["sha256"])


def test_the_build_reads_a_plain_weight_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The re-read that takes its sha256 and its chunks' is the build's only read of the file:
    the final verification takes both from it (the file not written since)."""
    import packer.chunks
    import packer.hashing
    import packer.verifying

    llama(tmp_path / "hf", **{**WIDE, "tied": False})
    reads: list[str] = []
    real_chunked, real_file = packer.hashing.sha256_chunked, packer.hashing.sha256_file

    def chunked(fd: int, *args: Any) -> Any:
        reads.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_chunked(fd, *args)

    def whole(path: Any, *args: Any) -> Any:
        reads.append(str(path))
        return real_file(path, *args)

    real_hashed = packer.chunks._hashed

    def verified(out: Path, place: Any, fc: Any) -> Any:  # verify_chunks' read: its chunks by hash_span
        reads.append(str(place.path(out)[0]))
        return real_hashed(out, place, fc)

    monkeypatch.setattr("packer.oci.reread.sha256_chunked", chunked)
    monkeypatch.setattr("packer.chunks._hashed", verified)
    monkeypatch.setattr(packer.verifying, "sha256_file", whole)
    monkeypatch.setattr(packer.verifying, "sha256_file_or_none", lambda path, stop: whole(path, stop))
    build_dir(tmp_path / "hf", tmp_path / "out", weights={"chunk_size": "32KiB"}, image={"weights": "external"})
    assert len([r for r in reads if r.endswith(f"/{WEIGHTS}")]) == 1, reads  # in the staging directory


def test_verify_names_the_chunk_of_a_flipped_byte_in_a_plain_file(plain_built: Path, tmp_path: Path) -> None:
    bad = _copy(plain_built, tmp_path / "bad")
    path, offset, size = weight_location(bad, WEIGHTS)
    assert offset == 0 and path == bad / WEIGHTS
    at = size - 3 * CHUNK + 123
    _flip(path, at)
    fc = open_build(plain_built).chunk_table()[WEIGHTS]
    c = fc.holding(at)
    a, b = fc.bounds(c)
    with pytest.raises(VerifyError, match=rf"bad/{WEIGHTS}: .*chunk {c} \(bytes \[{a}, {b}\) "
                                          rf"of {size}\) has sha256"):
        verify(bad)


def test_verify_of_a_missing_weight_file_says_it_is_missing(plain_built: Path, tmp_path: Path) -> None:
    """The chunk table's look for the differing chunk, after a refusal, never replaces the refusal."""
    bad = _copy(plain_built, tmp_path / "bad")
    (bad / WEIGHTS).unlink()
    with pytest.raises(VerifyError, match=rf"bad/{WEIGHTS}: listed in the manifest but missing"):
        verify(bad)


# --- tensor parallel ranks that verify what they read ---


def _ranks(work: Path, world: int = 2) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": str(REPO),
               "PACKER_BUNDLE_CACHE": str(work / f"cache{r}"), "OMP_NUM_THREADS": "1", "PACKER_STARTUP_LOG": "off",
               "TMPDIR": str(work)}  # the worker ends in os._exit: what a streamed load made stays in work
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.tp_verify_worker", str(work)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    return [torch.load(work / f"verify-{r}.pt", weights_only=True) for r in range(world)]


def _per_rank(built: Path, work: Path, world: int = 2) -> Path:
    for r in range(world):
        _copy(built, work / f"rank{r}" / "out")
    return work


def _rank1_offset(built: Path, name: str) -> int:
    """The file offset of a byte 3/4 into tensor ``name``: rank 1's under a row split in two, and
    far (> a chunk) from its span's edges, whose chunks the neighbouring spans share."""
    path, offset, _ = weight_location(built, WEIGHTS)
    begin, end = json.loads((built / "manifest.json").read_bytes())["weights"]["tensors"][name]["data_offsets"]
    assert (end - begin) // 4 > 2 * CHUNK
    with open(path, "rb") as f:
        f.seek(offset)
        head = 8 + int.from_bytes(f.read(8), "little")  # the data section starts after the header
    return head + begin + 3 * (end - begin) // 4


def _rank1_first(built: Path, name: str) -> int:
    """The file offset of the first byte of rank 1's rows of tensor ``name`` under TP 2 (the
    runtime's split): the byte a chunk of the fixed grid shared with rank 0's span."""
    path, offset, _ = weight_location(built, WEIGHTS)
    rec = json.loads((built / "manifest.json").read_bytes())["weights"]["tensors"][name]
    begin, end = rec["data_offsets"]
    with open(path, "rb") as f:
        f.seek(offset)
        head = 8 + int.from_bytes(f.read(8), "little")
    rows = rec["shape"][0]
    return head + begin + split(rows, 2, 1)[1] * ((end - begin) // rows)


@pytest.mark.slow
def test_two_verified_ranks_hash_their_share_and_match_an_unverified_load(built: Path, tmp_path: Path) -> None:
    _share_bound(built, tmp_path)


@pytest.mark.slow
def test_two_verified_ranks_hash_their_share_of_a_plain_weight_file(plain_built: Path, tmp_path: Path) -> None:
    """The bound holds wherever the build keeps the weight file: a plain file too (weights
    mounted at run time, or an image of one layer)."""
    _share_bound(plain_built, tmp_path)


@pytest.mark.slow
def test_two_verified_ranks_read_their_share_at_the_default_chunk_size(default_built: Path, tmp_path: Path) -> None:
    """The issue's case: 1 MiB chunks over tensors of 0.5-1 MiB, where a grid chunk per span edge
    doubled what a rank hashed; cut at the ranks' splits, a rank reads its share."""
    _share_bound(default_built, tmp_path, 1 << 20)


def _share_bound(built: Path, tmp_path: Path, chunk: int = CHUNK) -> None:
    ours = _ranks(_per_rank(built, tmp_path))
    table = open_build(built).chunk_table()[WEIGHTS]
    for r in range(2):
        assert ours[r]["error"] == "", ours[r]["error"]
        share = ours[r]["sharded"] / 2 + ours[r]["replicated"]
        # issue 51: the rank's share, its header's chunk and the small files; nothing of its neighbour's
        assert share <= ours[r]["hashed"] <= 1.05 * share + 2 * chunk, (r, ours[r]["hashed"], share)
        assert 0 < ours[r]["disk"] <= 1.05 * share + 2 * chunk, (r, ours[r]["disk"], share)
        print(f"rank {r}: hashed {ours[r]['hashed']} bytes in {ours[r]['chunks']} chunks, read {ours[r]['disk']} "
              f"from the disk; share {share:.0f} ({ours[r]['hashed'] / share:.3f}x, {ours[r]['disk'] / share:.3f}x), "
              f"file {table.size}")
    assert torch.equal(ours[0]["logits"], ours[1]["logits"])


@pytest.mark.slow
def test_a_flipped_byte_is_refused_by_the_rank_that_reads_it_only(built: Path, tmp_path: Path) -> None:
    work = _per_rank(built, tmp_path)
    # colwise: rows split; rank 1's first byte, which rank 0's span ends just before
    at = _rank1_first(built, "model.layers.3.mlp.gate_proj.weight")
    for r in range(2):  # the same flipped file under both ranks: only rank 1 reads that byte
        path, offset, _ = weight_location(work / f"rank{r}" / "out", WEIGHTS)
        _flip(path, offset + at)
    ours = _ranks(work)
    fc = open_build(built).chunk_table()[WEIGHTS]
    chunk = fc.holding(at)
    assert ours[1]["error"].startswith("mismatch: "), ours[1]
    assert fc.bounds(chunk)[0] == at  # the chunk starts at the split: rank 0 hashes nothing of it
    assert f"rank1/out/{WEIGHTS}: chunk {chunk} (bytes [{at}, " in ours[1]["error"], ours[1]
    assert "on rank 1 of 2; the file is corrupt" in ours[1]["error"]
    assert not ours[0]["error"].startswith("mismatch"), ours[0]["error"]  # rank 0 saw its peer leave, no more


def test_an_older_builds_v1_table_still_proves_its_chunks(built: Path, tmp_path: Path) -> None:
    """A build made before the cuts (its table ``packer-chunks/v1``, a fixed grid) loads and
    verifies as it did, and a changed byte is named by its grid chunk."""
    old = _copy(built, tmp_path / "old")
    path, offset, size = weight_location(old, WEIGHTS)
    data = path.read_bytes()[offset: offset + size]
    table = json.loads((old / CHUNKS_REL).read_bytes())
    rec = table["files"][WEIGHTS]
    del rec["cuts"]
    rec["chunks"] = "".join(hashlib.sha256(data[i:i + CHUNK]).hexdigest() for i in range(0, size, CHUNK))
    table["format"] = "packer-chunks/v1"
    raw = canonical_json(table)
    (old / CHUNKS_REL).write_bytes(raw)
    manifest = json.loads((old / "manifest.json").read_bytes())
    manifest["files"][CHUNKS_REL] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (old / "manifest.json").write_bytes(canonical_json(manifest))
    loader = open_build(old)
    assert loader.chunk_table()[WEIGHTS].cuts == (0,)
    loader.load_weights("cpu", verify=True)
    assert [s["chunks"] for s in loader.report() if s["stage"] == "verify chunks"] == [-(-size // CHUNK)]
    at = size // 2
    _flip(path, offset + at)
    c = at // CHUNK
    grid = rf"old/{WEIGHTS}: chunk {c} \(bytes \[{c * CHUNK}, {c * CHUNK + CHUNK}\)"
    with pytest.raises(ArtifactMismatchError, match=grid):
        open_build(old).load_weights("cpu", verify=True)


def test_a_build_without_a_table_verifies_whole_files(built: Path, tmp_path: Path) -> None:
    manifest = json.loads((built / "manifest.json").read_bytes())
    del manifest["weights"]["chunks"]
    loader = open_build(built)
    loader.manifest = manifest
    assert loader.span_check() is None


# --- mapped views proven on first use (the vLLM load format under TP: vLLM's loaders narrow) ---


def test_mapped_views_prove_the_chunks_of_what_is_used(built: Path, tmp_path: Path) -> None:
    from packer.runtime import proven

    bad = _copy(built, tmp_path / "bad")
    name = "model.layers.3.mlp.gate_proj.weight"
    at = _rank1_offset(built, name)  # 3/4 into the tensor: in its second half of rows
    path, offset, _ = weight_location(bad, WEIGHTS)
    _flip(path, offset + at)
    with open(path, "rb") as f:
        f.seek(offset)
        head = 8 + int.from_bytes(f.read(8), "little")
    loader = open_build(bad)
    t = loader.load_weights("cpu", verify=True, proven=True)[name]
    assert type(t).__name__ == "Proven" and t.dtype == torch.bfloat16 and t.stride() == (t.shape[1], 1)
    fc = loader.chunk_table()[WEIGHTS]
    assert proven.release() == (head, len(fc.cover(0, head)))  # the header alone (its own chunks): metadata reads none
    t = loader.load_weights("cpu", verify=True, proven=True)[name]
    rows, half = t.shape[0], t.shape[0] // 2
    first = torch.empty(half, t.shape[1], dtype=t.dtype)
    first.copy_(t.narrow(0, 0, half))  # as vLLM's loader copies rank 0's rows: untouched, proven
    hashed, _ = proven.release()
    assert hashed == head + half * t.shape[1] * 2, hashed  # the header and rank 0's rows: cut at the TP 2 split
    t = loader.load_weights("cpu", verify=True, proven=True)[name]
    chunk = fc.holding(at)
    with pytest.raises(ArtifactMismatchError, match=rf"bad/{WEIGHTS}: chunk {chunk} \(bytes \[{fc.bounds(chunk)[0]}, "):
        torch.empty(rows - half, t.shape[1], dtype=t.dtype).copy_(t.narrow(0, half, rows - half))  # rank 1's
    with pytest.raises(ArtifactMismatchError, match=rf"chunk {chunk} "):
        t.float()  # any use of the bytes proves them first
    proven.release()


def test_a_whole_verified_load_names_the_chunk(built: Path, tmp_path: Path) -> None:
    bad = _copy(built, tmp_path / "bad")
    path, offset, size = weight_location(bad, WEIGHTS)
    at = size // 2
    _flip(path, offset + at)
    fc = open_build(built).chunk_table()[WEIGHTS]
    with pytest.raises(ArtifactMismatchError, match=rf"bad/{WEIGHTS}: chunk {fc.holding(at)} \(bytes "):
        open_build(bad).load_weights("cpu", verify=True)
    loader = open_build(built)
    loader.load_weights("cpu", verify=True)
    stage = [s for s in loader.report() if s["stage"] == "verify chunks"]
    assert stage and stage[-1]["bytes"] == size and stage[-1]["chunks"] == fc.total
