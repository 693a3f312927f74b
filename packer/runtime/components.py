"""A build's components (diffusers' ``unet``, sentence-transformers' ``2_Dense``, a PEFT adapter).

A multi-component build's manifest ``weights`` section carries ``components``: each one's own
weights section (``files``, ``index``, ``tensors``, ``aliases``, its ``path`` and ``library``),
and ``tree``: ``[path in the model directory, artifact path]`` pairs. A component is loaded by a
:class:`Loader` of its own whose manifest's ``weights`` is that component's section; the root
component (when there is one) is the section's top level too, so ``component=None`` loads it.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .loading import Loader


def component_names(manifest: dict[str, Any]) -> list[str]:
    """The component names of a build, sorted (empty for a plain, single-model build)."""
    return sorted(manifest["weights"].get("components") or {})


def component_loader(loader: Loader, name: str | None) -> Loader:
    """The loader of component ``name`` of ``loader``'s build (None: the root or only model).

    Raises:
        ValueError: no such component, or ``None`` where the build has no root component.
    """
    comps = loader.manifest["weights"].get("components") or {}
    if name is None:
        if comps and not loader.manifest["weights"]["files"]:
            raise ValueError(f"packer_loader: this build has components {', '.join(sorted(comps))} and no root "
                             "model; pass component=NAME")
        return loader
    if name not in comps:
        have = ", ".join(sorted(comps)) or "none (a single model: leave component out)"
        raise ValueError(f"packer_loader: no component {name!r} in this build; its components: {have}")
    cache = loader.component_loaders
    if name not in cache:
        table = {"chunks": w["chunks"]} if "chunks" in (w := loader.manifest["weights"]) else {}  # build-wide
        cache[name] = type(loader)({**loader.manifest, "weights": {**comps[name], **table}}, loader.root,
                                   timeline=loader.timeline, settings=loader.settings,
                                   view=loader.view)  # the build's view: its files, chunk table and source
    return cache[name]


def all_loaders(loader: Loader) -> list[tuple[str, Loader]]:
    """``(label, loader)`` for every component (the build itself when it has none)."""
    names = component_names(loader.manifest)
    return [(f"{n}: ", component_loader(loader, n)) for n in names] if names else [("", loader)]


def model_tree(weights: dict[str, Any]) -> list[tuple[str, str]]:
    """``(path in the model directory, artifact path)`` pairs of a weights section.

    A build records them (``tree``); without it (a single model) each weight file and the
    index go to the top of the model directory under their own names.

    Raises:
        ValueError: a recorded path that is absolute or climbs out with ``..``.
    """
    pairs = weights.get("tree")
    if pairs is None:
        rels = [*weights["files"], *([weights["index"]] if weights.get("index") else [])]
        pairs = [(PurePosixPath(r).name, r) for r in rels]
    out = []
    for dst, rel in pairs:
        p = PurePosixPath(dst)
        if p.is_absolute() or ".." in p.parts or not p.parts:
            raise ValueError(f"packer_loader: model directory entry {dst!r} is not a relative path inside it")
        out.append((str(p), str(rel)))
    return out


def component_dir(weights: dict[str, Any]) -> str:
    """Where a component's config lives in the bundle (``""``: the root)."""
    return str(weights.get("path") or "")
