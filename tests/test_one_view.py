"""One view of a build, one prover: where a build's bytes come from is decided in one place,
and a chunk is proven, a span hashed, by one function each.

Read from the source with ``ast`` (nothing imported), as ``tests/test_layers.py`` does:

* only the view's implementations (:mod:`packer.runtime.view_open` and the kinds it opens) name
  what tells a registry from local files (an ``oci://`` root, ``packer-stream.json``, the
  registry's image and files) or branch on a descriptor being an ``int``; the few other uses
  are listed below with why, and the list may not go stale;
* only :mod:`packer.runtime.proof` compares a chunk's digest with the table's or words the
  refusal, and the runtime hashes bytes only there (or where it hashes something else, listed);
* the build side hashes a file or a span through :mod:`packer.hashing`, whose every function but
  the chunk table's one-read hasher is :func:`~packer.runtime.proof.hash_span`: a module that feeds
  a running sha256 itself hashes bytes as it writes or parses them, and says so below.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "packer"

VIEW = {"runtime/view.py", "runtime/view_open.py", "runtime/view_local.py", "runtime/view_registry.py",
        "runtime/remote.py", "runtime/registry.py", "runtime/blob_reader.py",
        "runtime/env.py"}  # the view, its kinds, their definitions
# names that tell a registry from local files
SOURCE_NAMES = {"is_ref", "STREAM_FILE", "STREAM_SCHEME", "RemoteImage", "RemoteFile", "WholeBlob", "stream_ref",
                "RegistryView", "Registry"}
ALLOWED_NAMES = {  # (module, name): why it is not a decision of where bytes come from
    ("cli.py", "is_ref"): "the argument's grammar: a reference kept as text, a path as a path",
    ("stream.py", "is_ref"): "`packer stream` takes a reference only: a usage error before anything is opened",
    ("verifying.py", "STREAM_FILE"): "`packer verify DIR` of a streamed directory: refused with a hint",
    ("adapters/gate.py", "STREAM_FILE"): "the gate's list of the loader's own files, which engines never read",
}
ALLOWED_INT_CHECKS = {  # modules that ask whether a source is a descriptor
    "runtime/reading.py": "read_at: the one read of a span, preadv for a descriptor",
    "runtime/shards.py": "Shard.close: a descriptor is closed, a source holds none",
}
PROOF = "runtime/proof.py"
HASHERS = {  # runtime modules that hash something other than a build's spans, and what
    "runtime/registry.py": "a registry document's or blob's digest as it is fetched (its name)",
    "runtime/signature.py": "a public key's fingerprint; the trust root's digest",
    "runtime/bundle_reader.py": "the bundle archive's digest as it is extracted",
    "runtime/dirtree.py": "the key of a model directory's links (names, not bytes)",
    "runtime/reading.py": "sha256_regular: a served directory's files (below proof.py, which imports it)",
    "runtime/ring.py": "types only: the ring feeds the hashers proof.running_sha256 makes",
}

BUILD_HASHING = "hashing.py"
SPAN_HASHERS = {"sha256_file", "sha256_range"}  # packer.hashing's functions that hash a file or a span
STREAM_HASHERS = {  # build-side modules that feed a running sha256 themselves, and what they hash
    "hashing.py": "sha256_chunked: a chunk table written, the span's and each chunk's sha256 from one read",
    "bundle/tar.py": "a bundle member as it is copied into the archive being written",
    "oci/layer.py": "a layer blob (and its diff_id) as it is written",
    "oci/verify.py": "an image's blobs and their tar members as the image walk parses them",
    "oci/warm_layer.py": "the tar stream of a warm layer as it is composed (its digest before it is written)",
    "warm/pins.py": "a warm state's pinned file as one read copies it and checks its pin",
}


def _modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def _names(tree: ast.Module) -> set[str]:
    """Every name a module uses or imports (attributes included: ``env.is_ref``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            out.update(a.name for a in node.names)
    return out


def _int_checks(tree: ast.Module) -> int:
    """``isinstance(x, int)`` calls: asking whether a source is a descriptor."""
    return sum(1 for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
               and node.func.id == "isinstance" and len(node.args) == 2 and isinstance(node.args[1], ast.Name)
               and node.args[1].id == "int" and "fd" in ast.unparse(node.args[0]))


def test_only_the_view_decides_where_the_bytes_come_from() -> None:
    used: set[tuple[str, str]] = set()
    wrong = []
    for rel, tree in _modules().items():
        if rel in VIEW:
            continue
        for name in sorted(_names(tree) & SOURCE_NAMES):
            if (rel, name) in ALLOWED_NAMES:
                used.add((rel, name))
            else:
                wrong.append(f"packer/{rel} names {name}: open the build with view_open.open_view and ask its view")
        if "remote" in {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}:
            wrong.append(f"packer/{rel} reads a .remote flag: ask the view (proves_reads, open_weight, fetched)")
        if _int_checks(tree) and rel not in ALLOWED_INT_CHECKS:
            wrong.append(f"packer/{rel} asks isinstance(fd, int): let the view or reading.read_at decide")
    assert not wrong, "\n".join(wrong)
    assert used == set(ALLOWED_NAMES), f"stale exceptions: {sorted(set(ALLOWED_NAMES) - used)}"


def _chunk_digest_reads(tree: ast.Module) -> list[int]:
    """Lines reading a chunk's pinned digest: ``fc.digest(i)``, ``.hexes`` (a build's own ``digests``,
    written, not proven, are its business)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "digest" \
                and len(node.args) == 1 or isinstance(node, ast.Attribute) and node.attr == "hexes" \
                and not isinstance(node.ctx, ast.Store):
            lines.append(node.lineno)
    return lines


def _refusal_words(tree: ast.Module) -> list[int]:
    """Lines of a message that refuses a chunk: a formatted string with ``chunk`` and ``has sha256``."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
            and "chunk " in "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(
                v.value, str)) and any("has sha256" in str(getattr(v, "value", "")) for v in node.values)]


def test_one_prover_and_one_span_hasher() -> None:
    wrong = []
    for rel, tree in _modules().items():
        if rel == PROOF:
            continue
        reads = [] if rel == "runtime/chunks.py" else _chunk_digest_reads(tree)  # the table's own type
        wrong += [f"packer/{rel}:{line}: reads a chunk's digest: prove it with proof.prove_chunk" for line in reads]
        wrong += [f"packer/{rel}:{line}: words a chunk's refusal: proof.prove_chunk has the one message"
                  for line in _refusal_words(tree)]
        hashes = any(isinstance(n, (ast.Import, ast.ImportFrom)) and "hashlib" in ast.unparse(n)
                     for n in ast.walk(tree))
        if rel.startswith("runtime/") and hashes and rel not in HASHERS:
            wrong.append(f"packer/{rel} imports hashlib: hash a span with proof.hash_span")
    assert not wrong, "\n".join(wrong)
    assert all((PACKAGE / rel).is_file() for rel in HASHERS), "a listed hasher is gone: drop it from HASHERS"


def _running_hashers(tree: ast.Module) -> list[int]:
    """Lines making a running sha256 (``hashlib.sha256()`` with nothing to hash yet): bytes fed in a loop."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and not node.args
            and isinstance(node.func, ast.Attribute) and node.func.attr == "sha256"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "hashlib"]


def _calls(fn: ast.FunctionDef) -> set[str]:
    return {n.func.id if isinstance(n.func, ast.Name) else n.func.attr for n in ast.walk(fn)
            if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}


def test_the_build_side_hashes_a_span_through_the_one_helper() -> None:
    modules = _modules()
    wrong, used = [], set()
    for rel, tree in modules.items():
        if rel.startswith("runtime/") or not _running_hashers(tree):
            continue
        if rel in STREAM_HASHERS:
            used.add(rel)
        else:
            wrong.append(f"packer/{rel}:{_running_hashers(tree)[0]}: feeds a sha256 itself: hash a file or a span "
                         "with packer.hashing (proof.hash_span), or list what it hashes in STREAM_HASHERS")
    functions = {f.name: f for f in modules[BUILD_HASHING].body if isinstance(f, ast.FunctionDef)}
    wrong += [f"packer/{BUILD_HASHING}: {name} does not hash through proof.hash_span" for name in sorted(SPAN_HASHERS)
              if name not in functions or "hash_span" not in _calls(functions[name])]
    assert not wrong, "\n".join(wrong)
    assert used == set(STREAM_HASHERS), f"stale exceptions: {sorted(set(STREAM_HASHERS) - used)}"


def test_the_prover_names_file_chunk_span_and_rank() -> None:
    import pytest

    from packer.runtime.chunks import FileChunks
    from packer.runtime.env import ArtifactMismatchError
    from packer.runtime.proof import hash_span, prove_chunk

    data = bytes(range(256)) * 40  # 10240 bytes: chunks of 4096, 4096, 2048
    digests = [hash_span(data, a, min(4096, len(data) - a), "w") for a in range(0, len(data), 4096)]
    fc = FileChunks(4096, len(data), hash_span(data, 0, len(data), "w"), "".join(digests))
    prove_chunk("w", fc, 2, digests[2])
    with pytest.raises(ArtifactMismatchError, match=r"^w: chunk 2 \(bytes \[8192, 10240\) of 10240\) from blob x "
                                                    r"has sha256 \w+\.\.\., the chunk table pins \w+\.\.\. on rank 1 "
                                                    r"of 2; why$"):
        prove_chunk("w", fc, 2, digests[1], rank="rank 1 of 2", source=" from blob x", why="why")
    known = memoryview(data)[5000:6000]
    assert hash_span(data, 4096, 4096, "w", known=(904, known)) == digests[1]  # the rest read from the source
