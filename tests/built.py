"""Build a source directory with ``packer build`` and open the result with the runtime loader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from packer.building import BuildResult, build
from packer.recipe import recipe_from_dict
from packer.runtime.loading import Loader
from packer.runtime.timeline import Timeline


def build_dir(src: Path, out: Path, *, dry_run: bool = False, **recipe: Any) -> BuildResult:
    """``packer build`` of ``src`` (no sandbox: the tests' fixtures are their own) into ``out``.

    ``recipe``: more recipe sections, e.g. ``weights={"layout": "model"}``.
    """
    return build(recipe_from_dict({"name": "m", "version": "1", "source": str(src), **recipe}), out,
                 sandbox=False, dry_run=dry_run)


def open_build(out: Path) -> Loader:
    """The runtime :class:`Loader` of a build output, with a private timeline."""
    return Loader(json.loads((out / "manifest.json").read_bytes()), out, timeline=Timeline())


def save_pickle(state: dict[str, Any], out: Path, name: str = "pytorch_model.bin") -> None:
    """A state dict as transformers 4.x wrote it: a torch pickle (transformers 5 writes safetensors only)."""
    out.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.contiguous() for k, v in state.items()}, out / name)


def weight_location(out: Path, rel: str) -> tuple[Path, int, int]:
    """Where the weight file ``rel`` (a manifest path, ``weights/model.safetensors``) of the build
    ``out`` is: ``(file, offset, size)``; inside its image layer blob unless the build kept a
    plain file (``image.weights = "external"``, ``image.single_layer``)."""
    entry = json.loads((out / "manifest.json").read_bytes())["files"][rel]
    if entry.get("blob"):
        return out / entry["blob"], entry["offset"], entry["size"]
    return out / rel, 0, entry["size"]


def weight_bytes(out: Path, rel: str = "weights/model.safetensors") -> bytes:
    """The bytes of the artifact ``rel`` (a weight file, or any other) of the build ``out``,
    wherever the build keeps them."""
    path, offset, size = weight_location(out, rel)
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read(size)
    assert len(data) == size, f"{path}: short at offset {offset}"
    return data


def held_in_blobs(out: Path) -> list[str]:
    """The manifest paths of the files the build ``out`` holds inside its layer blobs."""
    files = json.loads((out / "manifest.json").read_bytes())["files"]
    return sorted(rel for rel, entry in files.items() if entry.get("blob"))


def weights_copy(out: Path, dest: Path) -> Path:
    """``dest/weights``: every weight file of the build ``out`` (and the index) as a plain file, as
    OUT's ``weights/`` held them before the layer blobs became their one copy; returns it."""
    manifest = json.loads((out / "manifest.json").read_bytes())
    for rel in manifest["files"]:
        if rel.startswith("weights/"):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(weight_bytes(out, rel))
    return dest / "weights"
