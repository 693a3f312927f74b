"""The weights stage over a source's components: each converted on its own, none merged.

A plain model is converted as before (one call, the same manifest section). A diffusers
pipeline, a sentence-transformers stack or a PEFT adapter (:mod:`packer.components`) is
converted component by component into ``weights/<path>/``, each with its own shards, index,
ties and inputs; the stage's section then carries ``layout``, ``components`` (each one's own
weights section with its ``path`` and ``library``) and ``tree`` (the model directory the
loader and the image lay out). The root component, when there is one, is also the section's
top level, so a loader that knows nothing of components loads it as before. Every checkpoint of
the source that no component read is named in a note and in the section's ``left_out``.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from packer.checkpoint.training import further_model, training_state
from packer.components import (
    STEMS,
    Component,
    SourceLayout,
    detect_layout,
    left_out,
    model_tree,
    source_variant,
    with_variants,
)
from packer.errors import WeightsError
from packer.recipe import WeightsConfig
from packer.stage import StageOutput
from packer.util.formats import SAFETENSORS_SUFFIX, foreign_weights, variant_of
from packer.weights.inputs import find_inputs
from packer.weights.options import ConvertOptions

_SHARD = re.compile(r"-\d{5}-of-\d{5}")  # a shard: carried through its variant's index, or named left out
_EMPTY: dict[str, Any] = {"files": [], "index": None, "total_size": 0, "tensors": {}, "aliases": {}}


def convert_layout(src: Path, staging: Path, cfg: WeightsConfig, options: ConvertOptions, *,
                   single_file: bool) -> StageOutput:
    """Convert every component of the source ``src`` into ``staging/weights``.

    Args:
        src: the source directory (or single checkpoint file: always a plain model).
        staging: the build's staging directory (paths in the result are relative to it).
        cfg: the recipe's weights section (``layout`` and ``components`` choose the parts;
            ``files`` given with ``layout = "auto"`` means one plain model).
        options: how each component's conversion runs (:class:`~packer.weights.options.ConvertOptions`),
            the same for every component.
        single_file: ``src`` is one checkpoint file.

    Returns:
        the files of every component, the section described in this module's docstring,
        and notes (each component's, prefixed with its name).

    Raises:
        PackerError: from the layout detection or any component's conversion.
    """
    from packer.weights.sandbox import convert_cli

    layout = _layout(src, cfg, single_file)
    if not layout.multi:  # one plain model: its layout is said too, so every build shows one
        out = convert_cli(src, staging / "weights", cfg, options, rel_root=staging)
        out = replace(out, section=_with_variant(out.section), notes=(layout.describe(), *out.notes))
        return out if single_file else _with_left_out(src, out)
    outs = [(c, convert_cli(src / c.path, staging / "weights" / c.out, _component_cfg(cfg, c), options,
                            rel_root=staging)) for c in layout.components]
    section = _merged(layout, outs)
    notes = [layout.describe()]
    carried = [f"{c.path}/{c.files[0]}" if c.path else c.files[0] for c in layout.components
               if c.own_stem is not None and (f"{c.path}/{c.files[0]}" if c.path else c.files[0]) not in cfg.variants]
    if carried:
        notes.append(f"carried under their own names, as a library may load them beside the weights: "
                     f"{', '.join(carried)} (weights.leave_out = [...] leaves one out)")
    notes += [f"{c.name}: {n}" for c, out in outs for n in out.notes]
    merged = StageOutput(files=tuple(f for _, out in outs for f in out.files), section=section,
                         bytes_processed=sum(out.bytes_processed for _, out in outs), notes=tuple(notes),
                         digests={k: v for _, out in outs for k, v in out.digests.items()})
    return _with_left_out(src, merged)


def _layout(src: Path, cfg: WeightsConfig, single_file: bool) -> SourceLayout:
    if single_file:
        return detect_layout(src, "model")
    layout = detect_layout(src, "model") if cfg.files and cfg.layout == "auto" else \
        detect_layout(src, cfg.layout, cfg.components)
    variants = (*cfg.variants, *siblings(layout, src, cfg))
    return with_variants(layout, src, variants) if variants else layout


def siblings(layout: SourceLayout, src: Path, cfg: WeightsConfig) -> list[str]:
    """The safetensors files beside each component's weights that no component reads
    (``model.int8.safetensors`` beside ``model.safetensors``; the index of a sharded variant,
    ``model.safetensors.index.fp16.json``), as paths relative to ``src``: each is carried under its
    own name, as a library may load it by default. Left out: those ``weights.leave_out`` names, a
    further model accelerate wrote (``model_1.safetensors``: named in a note of its own),
    shards no variant index names and hidden files; pickles beside safetensors stay out as before.

    Raises:
        WeightsError: a ``weights.leave_out`` name that is no such file; as :func:`find_inputs`.
    """
    found, named, further = [], set(cfg.variants), set()
    for c in layout.components:
        folder = src / c.path
        if c.own_stem is not None or not folder.is_dir():
            continue
        inputs = find_inputs(folder, c.files or cfg.files)
        used = {p.name for p in (*inputs.files, *([inputs.index] if inputs.index else []))}
        indexes = [p for p in folder.glob(f"*{SAFETENSORS_SUFFIX}.index.*.json")
                   if variant_of(p.name, (p.name.split(".")[0],))]
        for p in sorted([*folder.glob(f"*{SAFETENSORS_SUFFIX}"), *indexes]):
            rel = f"{c.path}/{p.name}" if c.path else p.name
            own = p.name == STEMS.get(c.library, "model") + SAFETENSORS_SUFFIX  # the model's own name, not chosen
            if further_model(p.name) is not None:  # accelerate's model_1: a model of its own, no variant
                further.add(rel)  # left out anyway; naming it in weights.leave_out is no error
            elif p.name not in used and rel not in named and not p.name.startswith(".") \
                    and not _SHARD.search(p.name) and not own and p.is_file():
                found.append(rel)
    unknown = sorted(set(cfg.leave_out) - set(found) - further)
    if unknown:
        raise WeightsError(f"weights.leave_out: {unknown[0]!r} is not a safetensors file beside a component's "
                           f"weights in {src} (those the build carries: {', '.join(found) or 'none'})")
    return [rel for rel in found if rel not in cfg.leave_out]


def _component_cfg(cfg: WeightsConfig, c: Component) -> WeightsConfig:
    if c.own_stem is not None:  # a variant: one file under its own name (shards would clash with the model's)
        return replace(cfg, files=c.files, max_shard_size=2**62)
    return replace(cfg, files=c.files or cfg.files)  # a plain root model keeps the recipe's files


def _with_variant(section: dict[str, Any]) -> dict[str, Any]:
    """A plain model's section, with the model directory's names of a model published only as a
    variant (``variant`` and its ``tree``: ``model.fp16.safetensors``), so ``variant=`` finds it."""
    if not (variant := source_variant(section)):
        return section
    section = {**section, "variant": variant}
    return {**section, "tree": model_tree(section)}


def _component_section(c: Component, section: dict[str, Any]) -> dict[str, Any]:
    prefix = f"{c.path}/" if c.path else ""
    inputs = [{**i, "path": prefix + i["path"]} for i in section.get("inputs", [])]
    variant = None if c.own_stem else source_variant(section, c.library)
    return {**section, "inputs": inputs, "name": c.name, "path": c.path, "library": c.library,
            **({"stem": c.own_stem} if c.own_stem else {}), **({"variant": variant} if variant else {})}


def _merged(layout: SourceLayout, outs: list[tuple[Component, StageOutput]]) -> dict[str, Any]:
    comps = {c.name: _component_section(c, out.section) for c, out in outs}
    root = next((s for s in comps.values() if s["path"] == "" and "stem" not in s), None)
    top = {k: root[k] for k in _EMPTY} if root is not None else dict(_EMPTY)
    section: dict[str, Any] = {
        **top, "layout": layout.kind, "components": comps,
        "inputs": [i for s in comps.values() for i in s["inputs"]],
        "skipped": sorted({k for s in comps.values() for k in s.get("skipped", [])}),
    }
    section["tree"] = model_tree({"components": comps})
    return section


def _with_left_out(src: Path, out: StageOutput) -> StageOutput:
    """``out`` with every checkpoint of ``src`` it did not read named (note and ``left_out``);
    other frameworks' weight files (GGUF, ONNX...) get a note of their own, saying what they are."""
    used = {i["path"] for i in out.section.get("inputs", [])}
    missed = left_out(src, used)
    if not missed:
        return out
    notes = list(out.notes)
    state = [m for m in missed if training_state(Path(m).name)]
    if state:
        notes.append(f"left out as training state (optimizer, scheduler, RNG and run state; not model weights): "
                     f"{', '.join(state[:8])}{f', ... ({len(state)} in all)' if len(state) > 8 else ''}")
    for m in [m for m in missed if further_model(Path(m).name)][:8]:
        notes.append(f"left out: {m}: {further_model(Path(m).name)}")
    ours = [m for m in missed if not foreign_weights(Path(m).name) and not training_state(Path(m).name)
            and not further_model(Path(m).name)]
    if ours:
        shown = ", ".join(ours[:8]) + (f", ... ({len(ours)} in all)" if len(ours) > 8 else "")
        notes.append(f"checkpoints in the source that this build leaves out: {shown} (name them in "
                     "weights.files, or check weights.layout / weights.components)")
    for m in [m for m in missed if foreign_weights(Path(m).name)][:8]:
        what = (foreign_weights(Path(m).name) or "").split(", which", 1)[0]
        notes.append(f"left out: {m}: {what}, which packer does not convert")
    return replace(out, section={**out.section, "left_out": missed}, notes=tuple(notes))
