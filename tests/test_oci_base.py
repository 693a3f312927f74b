"""A hostile base image through `packer build`: documents checked in shape, blobs kept inside.

Every fault is one line naming the file, the JSON path and what was expected, exit 1, and no
write lands outside OUT (nor OUT itself) at any moment of the build.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from packer.cli import main
from packer.errors import ImageError
from packer.oci.base import BaseImage, link_blobs
from tests.oci_validate import edit_base, make_base, validate_layout

ESCAPES = ["sha256:../../../../canary", "sha256:../../../canary/x", "sha256:/tmp/canary", "sha256:" + "0" * 63]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch = pytest.importorskip("torch")
    src = tmp_path_factory.mktemp("model")
    torch.save({"w": torch.arange(4.0)}, src / "pytorch_model.bin")
    (src / "config.json").write_text("{}")
    return src


def _build(tmp_path: Path, model: Path, base: Path) -> tuple[int, str, Path]:
    recipe = tmp_path / "r.toml"
    text = f'name = "m"\nversion = "1"\nsource = "{model}"\n[image]\nbase = "oci:{base}:v1"\n'
    if not recipe.exists() or recipe.read_text() != text:
        recipe.write_text(text)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", "--no-sandbox", "-q", "-o", str(out), str(recipe)])
    return result.exit_code, result.output, out


def _one_line(text: str, *parts: str) -> str:
    lines = [line for line in text.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    assert "Traceback" not in text and all(p in lines[0] for p in parts), (parts, text)
    return lines[0]


def _set(path: str, value: Any) -> Any:
    """An edit that sets a dotted path (``manifests.0.digest``); ``None`` value deletes it."""
    def edit(doc: Any) -> Any:
        *parents, last = path.split(".")
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is None:
            del node[last]
        else:
            node[int(last) if isinstance(node, list) else last] = value
        return doc
    return edit


DEEP = b"[" * 100_000 + b"]" * 100_000
# (part edited, edit, file named, JSON path named, what was expected)
SHAPES = {
    "index is a list": ("index", lambda d: [d], "index.json", "top level", "an image index"),
    "no digest": ("index", _set("manifests.0.digest", None), "index.json", "manifests[0].digest",
                  "a digest like sha256:<64 hex digits> (required)"),
    "no mediaType": ("index", _set("manifests.0.mediaType", None), "index.json", "manifests[0].mediaType",
                     "a string (required)"),
    "number for a string": ("index", _set("manifests.0.mediaType", 7), "index.json", "manifests[0].mediaType",
                            "a string, got the number 7"),
    "string size": ("index", _set("manifests.0.size", "12"), "index.json", "manifests[0].size", "a size in bytes"),
    "annotation not a string": ("index", _set("manifests.0.annotations", {"org.opencontainers.image.ref.name": 1}),
                                "index.json", 'manifests[0].annotations["org.opencontainers.image.ref.name"]',
                                "a string"),
    "string platform": ("nested", _set("manifests.0.platform", "linux/amd64"), "(index)",
                        "manifests[0].platform", 'an object like {"os"'),
    "layers not an array": ("manifest", _set("layers", {}), "(manifest)", "layers", "an array, got an object"),
    "no config": ("manifest", _set("config", None), "(manifest)", "config", "a descriptor"),
    "config is a list": ("config", lambda d: [d], "(config)", "top level", "an image config"),
    "non-string Env": ("config", _set("config.Env", ["PATH=/bin", 3]), "(config)", "config.Env[1]",
                       "a string, got the number 3"),
    "labels not strings": ("config", _set("config.Labels", {"a": ["b"]}), "(config)", "config.Labels.a",
                           "a string, got an array"),
    "bad diff_id": ("config", _set("rootfs.diff_ids", ["sha256:xyz"]), "(config)", "rootfs.diff_ids[0]",
                    "a digest"),
    "history of strings": ("config", _set("history", ["x"]), "(config)", "history[0]", "an object"),
    "deep index": ("index", lambda d: DEEP, "index.json", "nested deeper than 32", ""),
    "deep config": ("config", lambda d: b'{"config": {"x": ' + DEEP + b"}}", "(config)", "nested deeper than 32", ""),
}


@pytest.mark.parametrize("case", list(SHAPES))
def test_malformed_documents_are_one_line(tmp_path: Path, model: Path, case: str) -> None:
    part, edit, file, path, expected = SHAPES[case]
    base = tmp_path / "base"
    make_base(base, tag="v1", platforms=("linux/amd64",) if part == "nested" else ())
    edit_base(base, part, edit)
    code, output, out = _build(tmp_path, model, base)
    assert code == 1, output
    line = _one_line(output, f"image.base 'oci:{base}:v1'", file, path, expected)
    assert f"{path}: expected" in line or "nested deeper" in line
    assert not out.exists() and not [p for p in tmp_path.iterdir() if "staging" in p.name]


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(root).as_posix(): (p.stat().st_ino, p.stat().st_size)
            for p in sorted(root.rglob("*")) if not p.is_symlink()}


class WriteSpy:
    """Every path the build links, copies or renames into place, while it runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.targets: list[Path] = []
        for mod, name in ((os, "link"), (os, "replace"), (os, "rename"), (shutil, "copyfile")):
            real = getattr(mod, name)
            monkeypatch.setattr(mod, name, self._wrap(real))

    def _wrap(self, real: Any) -> Any:
        def spy(src: Any, dst: Any, *args: Any, **kw: Any) -> Any:
            self.targets.append(Path(os.path.abspath(dst)))
            return real(src, dst, *args, **kw)
        return spy


@pytest.mark.parametrize("where", ["layers.0.digest", "config.digest", "manifests.0.digest"])
@pytest.mark.parametrize("digest", ESCAPES)
def test_descriptor_digests_never_write_outside_out(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch,
                                                     where: str, digest: str) -> None:
    """The round-2 escape: a digest joined onto both layouts hard-linked a file outside OUT."""
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "canary").mkdir()
    (tmp_path / "canary" / "x").write_bytes(b"secret")
    base = work / "base"
    make_base(base, tag="v1")
    edit_base(base, "index" if where.startswith("manifests") else "manifest", _set(where, digest))
    _build(work, model, base)  # once, to write the recipe and see the build fail the same way
    before = _tree(tmp_path)
    spy = WriteSpy(monkeypatch)
    code, output, out = _build(work, model, base)
    monkeypatch.undo()
    assert code == 1, output
    _one_line(output, where.replace(".0.", "[0]."), "expected a digest like sha256:<64 hex digits>")
    assert _tree(tmp_path) == before and not out.exists()  # nothing left anywhere, canary untouched
    # every write of the build went into its staging directory, which lies beside OUT
    assert spy.targets and all(p.is_relative_to(work) and p.relative_to(work).parts[0].startswith(
        ".out.packer-staging") for p in spy.targets), spy.targets


def test_a_valid_base_writes_only_into_the_staging_directory(tmp_path: Path, model: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The spy above sees the build's writes: with a sound base, each lands in the staging dir beside OUT."""
    base = tmp_path / "base"
    make_base(base, tag="v1")
    spy = WriteSpy(monkeypatch)
    code, output, out = _build(tmp_path, model, base)
    monkeypatch.undo()
    assert code == 0, output
    stagings = {p.relative_to(tmp_path).parts[0] for p in spy.targets if p != out}
    assert len(stagings) == 1 and next(iter(stagings)).startswith(".out.packer-staging"), spy.targets
    assert any(p.parent.name == "sha256" for p in spy.targets)  # the base's blobs were linked
    validate_layout(out / "image", packer=True)


def _bazel_links(base: Path, store: Path) -> None:
    """Replace every blob with a relative symlink to a copy in ``store``, as bazel lays them out."""
    store.mkdir(parents=True, exist_ok=True)
    for blob in sorted((base / "blobs" / "sha256").iterdir()):
        os.rename(blob, store / blob.name)
        os.symlink(os.path.relpath(store / blob.name, blob.parent), blob)


def test_blobs_linking_out_of_the_layout_say_what_to_do(tmp_path: Path, model: Path) -> None:
    base = tmp_path / "base"
    make_base(base, tag="v1")
    _bazel_links(base, tmp_path / "bazel-out" / "blobs")
    code, output, out = _build(tmp_path, model, base)
    assert code == 1, output
    line = _one_line(output, f"{base}/blobs/sha256/", "symlink leads outside", f"cp -rL {base} COPY")
    assert "staging" not in line  # the old message blamed a file in the staging directory
    shutil.copytree(base, tmp_path / "copy", symlinks=False)  # the way out the message gives
    code, output, _ = _build(tmp_path, model, tmp_path / "copy")
    assert code == 0, output


def test_blobs_linking_inside_the_layout_are_followed(tmp_path: Path, model: Path) -> None:
    """Links that stay in the layout's own blobs/ are accepted; OUT gets the file, never the link."""
    base = tmp_path / "base"
    make_base(base, tag="v1")
    _bazel_links(base, base / "blobs" / "store")
    code, output, out = _build(tmp_path, model, base)
    assert code == 0, output
    layout = validate_layout(out / "image", packer=True)
    blob = out / "image" / "blobs" / "sha256" / layout.layers[0].descriptor["digest"][7:]
    assert not blob.is_symlink() and blob.stat().st_ino == (base / "blobs" / "store" / blob.name).stat().st_ino


def test_link_blobs_refuses_before_creating_anything(tmp_path: Path) -> None:
    """The last line of defence: a BaseImage built by hand with an escaping digest."""
    base = tmp_path / "base"
    make_base(base, tag="v1")
    blobs = tmp_path / "out" / "image" / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    for digest in ESCAPES:
        image = BaseImage("oci:x", base, "sha256:" + "0" * 64, ({"digest": digest, "size": 6},), {})
        with pytest.raises(ImageError, match="is not a digest"):
            link_blobs(image, blobs)
    sha512 = "sha512:" + hashlib.sha512(b"").hexdigest()
    with pytest.raises(ImageError, match="only sha256 blobs are supported"):
        link_blobs(BaseImage("oci:x", base, "sha256:" + "0" * 64, ({"digest": sha512, "size": 0},), {}), blobs)
    assert not list((tmp_path / "out").rglob("*.tmp")) and not list(blobs.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "out"]


def test_document_bytes_must_match_their_digest(tmp_path: Path, model: Path) -> None:
    base = tmp_path / "base"
    make_base(base, tag="v1")
    blobs = base / "blobs" / "sha256"
    index = json.loads((base / "index.json").read_bytes())
    manifest = json.loads((blobs / index["manifests"][0]["digest"][7:]).read_bytes())
    config = blobs / manifest["config"]["digest"][7:]
    config.write_bytes(config.read_bytes().replace(b'"1000"', b'"1001"'))  # same size, other bytes
    code, output, _ = _build(tmp_path, model, base)
    assert code == 1
    _one_line(output, f"{config} (config): its bytes do not match its digest")
