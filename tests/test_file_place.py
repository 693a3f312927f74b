"""Where a file's bytes are: one rule set, one value type per side, and nothing else parses it.

A manifest files entry may hold a weight file in its layer blob (``blob``, ``offset``).
:mod:`packer.runtime.place` is the one reading of such an entry (the runtime ships without the
build side) and :mod:`packer.place` the build side's door to it. Here both sides give the same
place, or the same one-line refusal, over a table of entries (hostile ones most of all); each
reader of a built OUT (``packer verify``, ``packer inspect``, the loader) refuses a malformed
entry with that same reason; and a scan of the source (``ast``, nothing imported, like
tests/test_one_way_in.py) fails on a second parser: ``["blob"]``, ``.get("offset")``,
``"blob" in entry``... or the blob folder spelled outside the two homes.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from packer import place as build_side
from packer.building import build
from packer.errors import VerifyError
from packer.manifest import held_in_blob
from packer.oci.plan import WEIGHT_ALIGN
from packer.recipe import demo_recipe
from packer.runtime import place as runtime_side
from packer.runtime.env import ArtifactMismatchError
from packer.util.fsutil import FileEntry, canonical_json
from packer.verifying import verify
from tests.built import open_build

HEX = "0123456789abcdef" * 4
BLOB = f"image/blobs/sha256/{HEX}"
GOOD: dict[str, Any] = {"size": 100, "sha256": HEX}
HELD: dict[str, Any] = {**GOOD, "blob": BLOB, "offset": 4096}
WEIGHTS = "weights/model.safetensors"

# (rel, entry, None for a place, else a fragment of the refusal's reason)
TABLE: list[tuple[Any, Any, str | None]] = [
    ("config.json", GOOD, None),
    (WEIGHTS, HELD, None),
    (WEIGHTS, {**HELD, "offset": 0}, None),
    (WEIGHTS, {**HELD, "size": 0}, None),
    (WEIGHTS, {**HELD, "extra": 1}, None),  # other keys are another reader's
    # the offset
    (WEIGHTS, {**HELD, "offset": True}, "offset True"),
    (WEIGHTS, {**HELD, "offset": False}, "offset False"),
    (WEIGHTS, {**HELD, "offset": -4096}, "offset -4096"),
    (WEIGHTS, {**HELD, "offset": "4096"}, "offset '4096'"),
    (WEIGHTS, {**HELD, "offset": 4096.0}, "offset 4096.0"),
    (WEIGHTS, {**HELD, "offset": None}, "offset None"),
    (WEIGHTS, {k: v for k, v in HELD.items() if k != "offset"}, "offset None"),
    (WEIGHTS, {**HELD, "offset": 100}, "not a page offset"),
    (WEIGHTS, {**HELD, "offset": 2**60}, "offset 1152921504606846976"),
    (WEIGHTS, {**HELD, "offset": 2**53 - 4096, "size": 4097}, "is past"),
    (WEIGHTS, {**GOOD, "offset": 4096}, "an offset without a blob"),
    # the blob
    (WEIGHTS, {**HELD, "blob": f"image/blobs/sha256/../../../etc/{HEX[:48]}"}, "blob"),
    (WEIGHTS, {**HELD, "blob": "image/blobs/sha256/../../manifest.json"}, "blob"),
    (WEIGHTS, {**HELD, "blob": f"image/blobs/sha256/{HEX.upper()}"}, "blob"),
    (WEIGHTS, {**HELD, "blob": f"image/blobs/sha512/{HEX}"}, "blob"),
    (WEIGHTS, {**HELD, "blob": f"image/unnamed/{WEIGHTS}"}, "blob"),
    (WEIGHTS, {**HELD, "blob": f"/image/blobs/sha256/{HEX}"}, "blob"),
    (WEIGHTS, {**HELD, "blob": f"image//blobs/sha256/{HEX}"}, "blob"),
    (WEIGHTS, {**HELD, "blob": f"image/blobs/sha256/{HEX}/x"}, "blob"),
    (WEIGHTS, {**HELD, "blob": f"image/blobs/sha256/{HEX[:63]}"}, "blob"),
    (WEIGHTS, {**HELD, "blob": f"image/blobs/sha256/{HEX}\n"}, "blob"),
    (WEIGHTS, {**HELD, "blob": f"sha256:{HEX}"}, "blob"),
    (WEIGHTS, {**HELD, "blob": ""}, "blob ''"),
    (WEIGHTS, {**HELD, "blob": None}, "blob None"),
    (WEIGHTS, {**HELD, "blob": ["image/blobs/sha256", HEX]}, "blob"),
    # size and sha256
    (WEIGHTS, {**HELD, "size": True}, "size True"),
    (WEIGHTS, {**HELD, "size": -1}, "size -1"),
    (WEIGHTS, {**HELD, "size": "100"}, "size '100'"),
    (WEIGHTS, {**HELD, "size": 2**53 + 1}, "size"),
    (WEIGHTS, {**GOOD, "sha256": HEX.upper()}, "sha256"),
    (WEIGHTS, {**GOOD, "sha256": "sha256:" + HEX}, "sha256"),
    (WEIGHTS, {"size": 100}, "sha256 None"),
    # the entry and its key
    (WEIGHTS, None, "not a record"),
    (WEIGHTS, [100, HEX], "not a record"),
    ("../weights/model.safetensors", HELD, "not a plain relative path"),
    ("/weights/model.safetensors", HELD, "not a plain relative path"),
    ("weights//model.safetensors", HELD, "not a plain relative path"),
    ("weights/./model.safetensors", HELD, "not a plain relative path"),
    ("weights\\model.safetensors", HELD, "not a plain relative path"),
    ("", HELD, "not a plain relative path"),
    (7, HELD, "not a plain relative path"),
]


def _outcome(read: Any, rel: Any, entry: Any) -> Any:
    try:
        return read(rel, entry)
    except (VerifyError, ArtifactMismatchError) as e:
        return str(e)


@pytest.mark.parametrize(("rel", "entry", "refused"), TABLE)
def test_both_sides_read_an_entry_alike(rel: Any, entry: Any, refused: str | None) -> None:
    build = _outcome(lambda r, e: build_side.place_of(r, e, where="M"), rel, entry)
    runtime = _outcome(lambda r, e: runtime_side.place_of(r, e, "M"), rel, entry)
    assert build == runtime
    if refused is None:
        assert isinstance(build, build_side.FilePlace)
        assert build.as_json() == {k: v for k, v in entry.items() if k != "extra"}
        assert build.in_blob == ("blob" in entry)
    else:
        assert isinstance(build, str) and "\n" not in build, build
        assert build.startswith(f"M: files[{rel!r}]: "), build
        assert refused in build.partition("]: ")[2], build


def test_a_place_says_where_the_bytes_are(tmp_path: Path) -> None:
    held = build_side.parse_place(WEIGHTS, HELD)
    assert (held.in_blob, held.blob_digest) == (True, "sha256:" + HEX)
    assert held.path(tmp_path) == (tmp_path / BLOB, 4096, 100)
    plain = build_side.parse_place("config.json", GOOD)
    assert (plain.in_blob, plain.blob_digest, plain.path(tmp_path)) == (False, None, (tmp_path / "config.json", 0, 100))
    assert build_side.blob_rel(HEX) == BLOB and build_side.blob_hex(BLOB) == HEX
    assert build_side.blob_hex(f"image/blobs/sha256/{HEX.upper()}") is None
    assert WEIGHT_ALIGN % build_side.PAGE == 0  # what the image writes is what its readers take
    assert build_side.FilePlace is runtime_side.FilePlace and build_side.BLOBS == runtime_side.BLOBS


def test_the_build_writes_no_entry_its_readers_refuse() -> None:
    assert FileEntry(WEIGHTS, 100, HEX, BLOB, 4096).as_json() == HELD
    assert FileEntry(WEIGHTS, 100, HEX, BLOB, 4096).place() == build_side.parse_place(WEIGHTS, HELD)
    assert FileEntry("config.json", 100, HEX).as_json() == GOOD
    for blob, offset in [(f"image/unnamed/{WEIGHTS}", 4096), (BLOB, 100), (BLOB, -4096)]:
        with pytest.raises(build_side.PlaceError, match=r"^files\['weights/model.safetensors'\]: "):
            FileEntry(WEIGHTS, 100, HEX, blob, offset).as_json()


# --- every reader of a built OUT refuses a malformed entry with the same reason ---


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("place") / "out"
    build(demo_recipe(), out)
    return out


@pytest.mark.parametrize("edit", [{"offset": True}, {"offset": "4096"}, {"offset": -4096}, {"offset": 4097},
                                  {"blob": f"image/blobs/sha256/../../{WEIGHTS}"}, {"blob": BLOB.upper()},
                                  {"size": True}], ids=str)
def test_every_reader_refuses_a_malformed_place_alike(built: Path, tmp_path: Path, edit: dict[str, Any]) -> None:
    out = tmp_path / "out"
    shutil.copytree(built, out, copy_function=os.link)  # hard links: only manifest.json is rewritten
    manifest = json.loads((built / "manifest.json").read_bytes())
    assert manifest["files"][WEIGHTS].get("blob"), "the demo build holds its weights in a layer blob"
    manifest["files"][WEIGHTS].update(edit)
    (out / "manifest.json").unlink()
    (out / "manifest.json").write_bytes(canonical_json(manifest))
    reasons = []
    for read, where in [(lambda: verify(out), out / "manifest.json"),  # packer verify
                        (lambda: held_in_blob(out / WEIGHTS), out / "manifest.json"),  # packer inspect
                        (lambda: open_build(out).locate(WEIGHTS), "the manifest")]:  # the loader, model_dir()
        with pytest.raises((VerifyError, ArtifactMismatchError)) as e:
            read()
        message = str(e.value)
        assert "\n" not in message and message.startswith(f"{where}: files['{WEIGHTS}']: "), message
        reasons.append(message.partition(f"files['{WEIGHTS}']: ")[2])
    assert reasons[0] and len(set(reasons)) == 1, reasons


# --- the source holds no second parser of the fact ---

PACKAGE = Path(__file__).resolve().parent.parent / "packer"
HOMES = {"packer/runtime/place.py", "packer/place.py"}
KEYS = {"blob", "offset"}
FOLDER = "image/blobs/sha256"

# (file, what the scan names) -> why it is not a reading of a manifest entry's place
ALLOWED: dict[tuple[str, str], str] = {
    ("packer/weights/sandbox.py", '.get("blob")'):
        "the sandboxed writer's reply names where it left an unnamed blob (image/unnamed/<path>); "
        "packer.oci.reread._checked_place checks it, and the build then names the blob by place.blob_rel",
    ("packer/weights/sandbox.py", '.get("offset")'): "the same reply's offset, checked by the same function",
    ("packer/checkpoint/dcp_meta.py", '.get("offset")'):
        "torch.distributed.checkpoint's own metadata (a tensor chunk's offset in its .distcp file, a chunk's "
        "index offset), no files entry of a build; checked there as ints >= 0 and against the file's size",
}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            found.add(id(body[0].value))
    return found


def _path_parts(node: ast.AST) -> list[str] | None:
    """The string parts of a ``a / "b" / "c"`` chain, or None for another expression."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        left, right = _path_parts(node.left), _path_parts(node.right)
        return [*(left or []), *(right or [])]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    return None


def parsers(path: Path, root: Path = PACKAGE.parent) -> list[tuple[str, int, str]]:
    """``(file, line, what)`` of every reading of an entry's place, or spelling of its folder."""
    tree = ast.parse(path.read_text(), str(path))
    rel, skip, found = path.relative_to(root).as_posix(), _docstrings(tree), []
    chains = {id(n.left) for n in ast.walk(tree) if isinstance(n, ast.BinOp)}  # inner links of a chain
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in KEYS:
            what = f'["{node.slice.value}"]'
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("get", "pop", "setdefault") and node.args \
                and isinstance(node.args[0], ast.Constant) and node.args[0].value in KEYS:
            what = f'.{node.func.attr}("{node.args[0].value}")'
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and node.left.value in KEYS \
                and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
            what = f'"{node.left.value}" in'
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip \
                and FOLDER in node.value:
            what = FOLDER
        elif isinstance(node, ast.BinOp) and id(node) not in chains \
                and FOLDER in "/".join(_path_parts(node) or []):
            what = f"/ {FOLDER}"
        if what is not None:
            found.append((rel, node.lineno, what))
    return found


def test_no_second_parser_of_where_a_file_is() -> None:
    found = [f for path in sorted(PACKAGE.rglob("*.py")) for f in parsers(path)]
    bad = [f"{f}:{line}: {what}" for f, line, what in found if f not in HOMES and (f, what) not in ALLOWED]
    assert not bad, ("a files entry's blob/offset is read, or the blob folder spelled, outside packer/place.py "
                     "and packer/runtime/place.py: take a FilePlace (place_of, places_of, Loader.held) or "
                     "BLOBS/blob_rel/blob_hex, or add a reviewed entry to ALLOWED:\n" + "\n".join(bad))
    stale = set(ALLOWED) - {(f, what) for f, _, what in found}
    assert not stale, f"ALLOWED names readings that no longer exist: {sorted(stale)}"
    assert "packer/runtime/place.py" in {f for f, _, _ in found}, "the rule must still live in its home"


def test_the_scan_sees_each_kind_of_reading(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        '"""A docstring may say image/blobs/sha256/<hex>."""\n'
        'e["blob"]\ne["offset"]\ne.get("blob")\ne.get("offset", 0)\ne.pop("blob")\n"blob" in e\n'
        '"offset" not in e\nf"image/blobs/sha256/{h}"\nout / "image" / "blobs" / "sha256" / h\n'
        # not readings: other keys, a descriptor written, the OCI layout's folder of any image
        'e["size"]\n{"blob": d}\nlayout / "blobs" / "sha256"\n')
    assert [w for _, _, w in sorted(parsers(src, tmp_path), key=lambda f: f[1])] == [
        '["blob"]', '["offset"]', '.get("blob")', '.get("offset")', '.pop("blob")', '"blob" in', '"offset" in',
        FOLDER, f"/ {FOLDER}"]
