"""A source as a set of components: a plain model, a diffusers pipeline, a sentence-transformers
stack of modules, or a PEFT adapter; detected from the files each library writes.

* **diffusers**: ``model_index.json`` names the components; each folder that holds a
  checkpoint is one (``unet``, ``vae``, ``text_encoder``...). Folders without weights
  (``scheduler``, ``tokenizer``) travel in the bundle only.
* **sentence-transformers**: ``modules.json`` lists the modules; each module folder that holds
  a checkpoint is one (the root transformer, ``2_Dense``...). A ``Router`` module's
  ``router_config.json`` lists its routes' module folders (``query_0_StaticEmbedding``,
  ``document_0_Transformer``...): each of those that holds a checkpoint is one too.
* **PEFT**: ``adapter_config.json`` beside ``adapter_model.*``: the adapter is a component, and
  so is every sub-folder with its own ``adapter_config.json`` and weights (the further adapters
  ``PeftModel.save_pretrained`` writes under their names).
* **a lone diffusers model** (``config.json`` with ``_class_name`` and ``_diffusers_version``, as
  ``UNet2DConditionModel.save_pretrained`` writes it): one diffusers component at the root.
* **model**: anything else, one component at the root (``weights.files`` chooses its files).

Each component is converted on its own into ``weights/<path>/`` (its own shards, index and
ties); components are never merged. :func:`model_tree` gives the model directory a library
reads: each component's weights at ``<path>/<library file name>`` (``unet/
diffusion_pytorch_model.safetensors``, ``text_encoder/model.safetensors``,
``adapter_model.safetensors``), the same list for the loader's ``model_dir()`` and the image.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packer.errors import WeightsError
from packer.reading import JSON_DOC, MARKER, parse_json, read_bytes, read_json
from packer.util.formats import (
    BIN_SUFFIX,
    SAFETENSORS_SUFFIX,
    WEIGHT_SUFFIXES,
    foreign_weights,
    variant_of,
    with_variant,
)
from packer.util.idents import check_rel_name, confined, link_roots, shown

MARKERS = (("diffusers", "model_index.json"), ("sentence-transformers", "modules.json"),
           ("peft", "adapter_config.json"))
STEMS = {"transformers": "model", "diffusers": "diffusion_pytorch_model", "peft": "adapter_model"}
ROOT_NAME = "model"  # the root component's name (sentence-transformers' transformer, a plain model)
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")
_SEARCH_DEPTH = 3  # how deep a left-out checkpoint is looked for


@dataclass(frozen=True)
class Component:
    """One part of a source converted on its own.

    Attributes:
        name: how the loader addresses it (``"unet"``, ``"2_Dense"``, ``"model"``).
        path: its folder relative to the source (``""``: the root).
        library: whose file names it gets (``transformers``, ``diffusers``, ``peft``).
        files: the checkpoint file (or index) of the folder, relative to it.
    """

    name: str
    path: str
    library: str
    files: tuple[str, ...]
    own_stem: str | None = None  # a variant (weights.variants) keeps its own name: "model.int8"

    @property
    def stem(self) -> str:
        """The weight file's stem in the model directory (``diffusion_pytorch_model``)."""
        return self.own_stem or STEMS.get(self.library, "model")

    @property
    def out(self) -> str:
        """Its folder under ``weights/`` in OUT (a variant's own, beside its folder's model)."""
        if self.own_stem is None:
            return self.path
        return f"{self.path}/variants/{self.own_stem}" if self.path else f"variants/{self.own_stem}"


@dataclass(frozen=True)
class SourceLayout:
    """What a source is: its layout name and its components (one for a plain model)."""

    kind: str
    components: tuple[Component, ...]

    @property
    def multi(self) -> bool:
        """True unless it is one plain model at the root (today's single conversion)."""
        return self.kind != "model" or len(self.components) > 1

    def describe(self) -> str:
        """One line for the build's notes and ``--dry-run``."""
        parts = ", ".join(f"{c.name} ({c.path or '.'}, {c.library}"
                          f"{f', as {c.stem}{SAFETENSORS_SUFFIX}' if c.own_stem else ''})" for c in self.components)
        return f"source layout: {self.kind}; components: {parts}"


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(f"the key {shown(key)} appears twice")
        out[key] = value
    return out


class _Duplicate(Exception):  # noqa: N818 - not a ValueError: it passes the parser's own handling
    pass


def _read_json(path: Path) -> Any:
    raw = read_bytes(path, MARKER, error=WeightsError)
    try:
        return parse_json(raw, MARKER, where=str(path), error=WeightsError, object_pairs_hook=_no_duplicates)
    except _Duplicate as e:
        raise WeightsError(f"{path}: {e}; each component folder is named once") from None


def _once(marker: Path, names: list[str]) -> list[str]:
    """``names``, refusing one listed twice (two components would convert into one folder)."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise WeightsError(f"{marker}: the folder {shown(name or '.')} is listed twice; "
                               "each component folder is named once")
        seen.add(name)
    return names


def _checked_name(marker: Path, name: Any) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or name in (".", ".."):
        raise WeightsError(f"{marker}: component {shown(name)} is not a plain folder name; "
                           "fix the file or set weights.layout = \"model\"")
    return name


def checkpoint_of(folder: Path, stem: str) -> tuple[str, ...]:
    """The checkpoint a library would read in ``folder`` (index first, safetensors first), or ()."""
    pickle_stem = "pytorch_model" if stem == "model" else stem  # transformers' pickles: pytorch_model.bin
    for base, suffix in ((stem, SAFETENSORS_SUFFIX), (pickle_stem, BIN_SUFFIX)):  # safetensors first, as they do
        for name in (f"{base}{suffix}.index.json", base + suffix):
            if (folder / name).is_file():
                return (name,)
    for base in dict.fromkeys((stem, pickle_stem)):  # a sharded variant alone: its index (one only)
        indexes = sorted(p.name for p in folder.glob(f"{base}.*.index.*.json")
                         if p.is_file() and variant_of(p.name, (base,))) if folder.is_dir() else []
        if len(indexes) == 1:
            return (indexes[0],)
    found = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES) \
        if folder.is_dir() else []
    return (found[0],) if len(found) == 1 else ()


def _diffusers_entries(root: Path) -> list[tuple[str, str]]:
    """``(folder, library)`` of each component ``model_index.json`` names, weights or not."""
    marker = root / "model_index.json"
    index = _read_json(marker)
    if not isinstance(index, dict):
        raise WeightsError(f"{marker}: not an object")
    entries = [(_checked_name(marker, key), "diffusers" if value[0] == "diffusers" else "transformers")
               for key, value in sorted(index.items())
               if not key.startswith("_") and isinstance(value, list) and len(value) == 2]
    _once(marker, [name for name, _ in entries])
    return entries


def _module_paths(root: Path) -> list[str]:
    """The folder of each module ``modules.json`` lists (``""`` for the root), weights or not."""
    marker = root / "modules.json"
    modules = _read_json(marker)
    if not isinstance(modules, list):
        raise WeightsError(f"{marker}: not a list of modules")
    out = []
    for m in modules:
        path = m.get("path", "") if isinstance(m, dict) else None
        if path is None or not isinstance(path, str):
            raise WeightsError(f"{marker}: a module without a path: {str(m)[:80]!r}")
        path = path.strip("/")
        out.append(_checked_name(marker, path) if path else path)
    return _once(marker, out)


def lone_diffusers_model(root: Path) -> bool:
    """True when ``root`` is one diffusers model on its own (no ``model_index.json``): its
    ``config.json`` carries ``_class_name`` and ``_diffusers_version``."""
    config = root / "config.json"
    if (root / "model_index.json").exists() or not config.is_file():
        return False
    doc = read_json(config, JSON_DOC, error=WeightsError)  # a model's config, not a small layout file
    return isinstance(doc, dict) and isinstance(doc.get("_class_name"), str) and "_diffusers_version" in doc


def _diffusers(root: Path) -> list[Component]:
    if not (root / "model_index.json").exists():  # forced, or detected: a lone model (a FIFO is refused below)
        files = checkpoint_of(root, STEMS["diffusers"]) if lone_diffusers_model(root) else ()
        return [Component(ROOT_NAME, "", "diffusers", files)] if files else []
    out = []
    for name, library in _diffusers_entries(root):
        if files := checkpoint_of(root / name, STEMS[library]):
            out.append(Component(name, name, library, files))
    return out


def _router_paths(root: Path, module: str) -> list[str]:
    """The route module folders a sentence-transformers ``Router`` at ``module`` lists in its
    ``router_config.json`` (``structure``: route -> folder names), relative to ``root``; [] if none."""
    marker = root / module / "router_config.json"
    if not marker.is_file():
        return []
    config = _read_json(marker)
    structure = config.get("structure") if isinstance(config, dict) else None
    if not isinstance(structure, dict) or not all(isinstance(v, list) for v in structure.values()):
        raise WeightsError(f"{marker}: structure is not an object of folder lists")
    names = dict.fromkeys(_checked_name(marker, n) for folders in structure.values() for n in folders)
    return [f"{module}/{n}" if module else n for n in names]


def _sentence_transformers(root: Path) -> list[Component]:
    out = []
    for path in _module_paths(root):
        for sub in [path, *_router_paths(root, path)]:
            if files := checkpoint_of(root / sub, "model"):
                out.append(Component(sub or ROOT_NAME, sub, "transformers", files))
    return out


def _adapter_folders(root: Path) -> list[str]:
    """The sub-folders holding a further PEFT adapter (``adapter_config.json``), weights or not."""
    try:
        entries = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []
    return [p.name for p in entries if (p / "adapter_config.json").is_file() and _NAME.match(p.name)]


def _peft(root: Path) -> list[Component]:
    out = []
    if files := checkpoint_of(root, STEMS["peft"]):
        out.append(Component("adapter", "", "peft", files))
    for name in _adapter_folders(root):
        if name != "adapter" and (files := checkpoint_of(root / name, STEMS["peft"])):
            out.append(Component(name, name, "peft", files))
    return out


def named_folders(root: Path) -> frozenset[str]:
    """The sub-folders ``root``'s layout file names: each diffusers component and
    sentence-transformers module, with or without weights (a scheduler, a tokenizer, 1_Pooling).

    Raises:
        WeightsError: a marker file that is unreadable or names a folder that is not a plain name.
    """
    folders: set[str] = set()
    if (root / "model_index.json").is_file():
        folders.update(name for name, _ in _diffusers_entries(root))
    if (root / "modules.json").is_file():
        for path in _module_paths(root):
            folders.update(p for p in [path, *_router_paths(root, path)] if p)
    if (root / "adapter_config.json").is_file():
        folders.update(_adapter_folders(root))
    return frozenset(folders)


def detect_layout(root: Path, layout: str = "auto", only: tuple[str, ...] = ()) -> SourceLayout:
    """The components of the source directory ``root``.

    Args:
        root: the source directory (a single file is always a plain model).
        layout: recipe ``weights.layout``: ``auto`` (by the marker files), or one forced.
        only: recipe ``weights.components``: build these components only (empty: all).

    Returns:
        the layout; ``kind == "model"`` for a plain model (one root component).

    Raises:
        WeightsError: a marker file that cannot be read, a component name that is no plain
            folder name, a requested component that does not exist, or a layout with no weights.
    """
    if layout == "auto":
        layout = next((kind for kind, marker in MARKERS if root.is_dir() and (root / marker).is_file()), "model")
        if layout == "model" and root.is_dir() and lone_diffusers_model(root):
            layout = "diffusers"
    if layout == "model":
        return SourceLayout("model", (Component(ROOT_NAME, "", "transformers", ()),))
    if layout == "diffusers":
        comps = _diffusers(root)
    elif layout == "sentence-transformers":
        comps = _sentence_transformers(root)
    else:
        comps = _peft(root)
    if only:
        unknown = sorted(set(only) - {c.name for c in comps})
        if unknown:
            raise WeightsError(f"{root}: weights.components names {unknown[0]!r}, not a {layout} component "
                               f"with weights here (found: {', '.join(c.name for c in comps) or 'none'})")
        comps = [c for c in comps if c.name in only]
    if not comps:
        marker = "config.json" if layout == "diffusers" and not (root / "model_index.json").is_file() \
            else dict(MARKERS)[layout]
        at_root = any(p.suffix in WEIGHT_SUFFIXES for p in _checkpoints(root, _SEARCH_DEPTH))
        way = ("set weights.layout = \"model\" to convert the root alone" if at_root
               else "nor does the root: there are no weights here to build")
        raise WeightsError(f"{root}: a {layout} layout ({marker}) but no component holds a checkpoint; {way}")
    _confine_folders(root, comps)
    return SourceLayout(layout, tuple(comps))


def _confine_folders(root: Path, comps: list[Component]) -> None:
    """Refuse a component folder that is a link leading out of the source: each stage confines a
    component's files to where its folder resolves, so a folder that is itself such a link would
    make the folder's target the root (the rule of :func:`packer.util.idents.link_roots`)."""
    roots = link_roots(root)
    for c in comps:
        if c.path:
            confined(root / c.path, roots, error=WeightsError, what=f"component folder {shown(c.path)}",
                     hint="copy the folder into the model directory")


def with_variants(layout: SourceLayout, root: Path, variants: tuple[str, ...]) -> SourceLayout:
    """``layout`` plus one component per ``weights.variants`` file, written under its own name.

    A library may load a second weight file by name beside the model's (``model.int8.safetensors``
    next to ``model.safetensors``); each variant is converted on its own, as one file named
    ``<its stem>.safetensors`` in its folder of the model directory. A sharded safetensors variant
    is named by its index (``model.safetensors.index.fp16.json``) and becomes one file
    (``model.fp16.safetensors``), which the libraries' ``variant=`` finds first.

    Raises:
        WeightsError: a name that is no relative file name, not a checkpoint file, missing, or
            that is also another component's name.
    """
    comps = list(layout.components)
    for rel in variants:
        where = "weights.variants"
        name = check_rel_name(rel, where=where, error=WeightsError)
        stem, suffix = name.name[: -len(name.suffix)] if name.suffix else name.name, name.suffix
        if (index := _variant_index_stem(name.name)) is not None:  # a sharded variant: one file, its name
            stem, suffix = index, SAFETENSORS_SUFFIX
        if suffix not in WEIGHT_SUFFIXES or not _NAME.match(stem) or not (root / rel).is_file():
            raise WeightsError(f"{where}: {rel!r} is not a checkpoint file in {root} "
                               f"({'/'.join(WEIGHT_SUFFIXES)})")
        folder = str(name.parent) if str(name.parent) != "." else ""
        label = f"{folder}/{stem}" if folder else stem  # unet/diffusion_pytorch_model.fp16 beside vae's
        if any(c.name == label for c in comps):
            raise WeightsError(f"{where}: {rel!r} would be named {label!r}, as another component is")
        comps.append(Component(label, folder, "transformers", (name.name,), own_stem=stem))
    return SourceLayout(layout.kind, tuple(comps))


def _variant_index_stem(name: str) -> str | None:
    """``model.fp16`` for the index of a sharded safetensors variant (``model.safetensors.index.fp16.json``)."""
    for stem in dict.fromkeys(STEMS.values()):
        if name.startswith(f"{stem}{SAFETENSORS_SUFFIX}.index.") and (v := variant_of(name, (stem,))):
            return f"{stem}.{v}"
    return None


def _checkpoints(root: Path, depth: int = 0) -> Iterator[Path]:
    """Checkpoint files under ``root`` (hidden folders skipped, a few levels deep), other
    frameworks' weight files (GGUF, ONNX, TensorFlow, Flax) included."""
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return
    for p in entries:
        if p.name.startswith("."):
            continue
        if p.is_dir() and not p.is_symlink() and depth < _SEARCH_DEPTH:
            yield from _checkpoints(p, depth + 1)
        elif p.is_file() and (p.suffix in WEIGHT_SUFFIXES or foreign_weights(p.name)):
            yield p


def left_out(root: Path, used: set[str]) -> list[str]:
    """Checkpoint files of the source directory ``root`` the build did not read (relative paths)."""
    if not root.is_dir():
        return []
    return [rel for p in _checkpoints(root) if (rel := p.relative_to(root).as_posix()) not in used]


def source_variant(section: dict[str, Any], library: str = "transformers") -> str | None:
    """The variant a component's source was published as alone (its index or single file named
    ``<stem>.<variant>...``, as ``save_pretrained(variant=...)`` writes it), or None."""
    stem = STEMS.get(library, "model")
    stems = (stem, "pytorch_model") if stem == "model" else (stem,)
    inputs = section.get("inputs", [])
    named = [i for i in inputs if i.get("format") == "index"] or inputs
    found = {variant_of(Path(i["path"]).name, stems) for i in named}
    return found.pop() if len(found) == 1 and None not in found else None


def _renamed(name: str, stem: str) -> str:
    """A shard or index name under the library's stem: ``model.safetensors`` -> ``<stem>.safetensors``."""
    return stem + name[len("model"):] if name.startswith("model.") else name


def model_tree(section: dict[str, Any]) -> list[list[str]]:
    """The model directory of a build: ``[path in the model directory, artifact path in OUT]`` pairs.

    Args:
        section: the manifest's weights section.

    Returns:
        sorted pairs; shards keep their names (the index names them), the single file and the
        index take the component library's stem and the source's variant (``variant``:
        ``model.fp16.safetensors``, ``model.safetensors.index.fp16.json``).
    """
    if "tree" in section:
        return [list(p) for p in section["tree"]]
    pairs = []
    for comp in components_of(section):
        base = comp.get("path", "")
        stem = comp.get("stem") or STEMS.get(comp.get("library", "transformers"), "model")
        variant = comp.get("variant")
        for rel in [*comp["files"], *([comp["index"]] if comp.get("index") else [])]:
            name = _renamed(Path(rel).name, stem)
            if variant and (rel == comp.get("index") or len(comp["files"]) == 1):  # shards: the index names them
                name = with_variant(name, variant)
            pairs.append([f"{base}/{name}" if base else name, rel])
    return sorted(pairs)


def components_of(section: dict[str, Any]) -> list[dict[str, Any]]:
    """The component sections of a weights section (the section itself for a plain model)."""
    comps = section.get("components")
    return list(comps.values()) if comps else [section]


def artifact_files(section: dict[str, Any]) -> list[str]:
    """Every weight file and index of every component, as OUT paths."""
    return [rel for c in components_of(section) for rel in [*c["files"], *([c["index"]] if c.get("index") else [])]]
