"""Build a source directory with ``packer build`` and open the result with the runtime loader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from packer.build import BuildResult, build
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
