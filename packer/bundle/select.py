"""Bundle selection: which files of a model directory go into the bundle, as a :class:`BundlePlan`.

:func:`plan_bundle` is the one place that decides: it walks the source (every path proven
inside its allowed root first), applies the default rules and the recipe's globs, and checks
the result against what the runtime reader accepts. It reads metadata only.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from packer.bundle.plan import BundleMember, BundlePlan
from packer.bundle.remote_code import remote_code
from packer.bundle.tar import tar_size
from packer.components import named_folders
from packer.errors import BundleError, WeightsError
from packer.reading import file_kind
from packer.recipe import BundleConfig
from packer.runtime import bundle_reader as reader
from packer.util.formats import WEIGHT_SUFFIXES
from packer.util.idents import confined, link_roots

TEXT_SUFFIXES = frozenset({".json", ".txt", ".model", ".jinja", ".tiktoken", ".vocab", ".spm", ".bpe", ".yaml", ".yml"})
NEVER = {
    "weights": frozenset({*WEIGHT_SUFFIXES, ".distcp", ".gguf", ".ggml", ".onnx", ".onnx_data",
                          ".h5", ".hdf5", ".keras", ".msgpack", ".npz", ".npy", ".tflite", ".pb", ".ot", ".pdparams",
                          ".mlmodel", ".engine", ".plan", ".trt"}),
    "code": frozenset({".py", ".pyc", ".pyo", ".pyd", ".pyx", ".so", ".dylib", ".dll", ".exe", ".sh", ".ipynb"}),
    "pickle": frozenset({".pkl", ".pickle", ".joblib", ".dill"}),
}
# a variant's index too (model.safetensors.index.fp16.json, as save_pretrained(variant=...) names it)
_WEIGHTS_INDEX = re.compile(r"\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf|onnx)\.index(\.\w+)?\.json$", re.I)
_VERSIONED_MODEL = re.compile(r"\.model\.v\d+$")  # Mistral's tokenizer.model.v3
# sentence-transformers modules (1_Pooling, 2_Normalize, 2_Dense...) and diffusers components
_MODULE_DIR = re.compile(r"^\d+_[A-Za-z]\w*$")
_Globs = list[tuple[str, re.Pattern[str]]]
KNOWN_DIRS = frozenset({"tokenizer", "tokenizer_2", "tokenizer_3", "text_encoder", "text_encoder_2",
                        "text_encoder_3", "scheduler", "feature_extractor", "image_processor", "processor",
                        "unet", "vae", "transformer", "prior", "decoder",
                        # more diffusers pipeline components (model_index.json names them)
                        "image_encoder", "safety_checker", "controlnet", "transformer_2", "vqvae", "movq",
                        # transformers' named chat templates (chat_template={"tool_use": ...}): <name>.jinja
                        "additional_chat_templates"})
FOLDER = "a folder the default rules do not enter"  # the reason a sub-folder is named, not walked


def glob_regex(pattern: str) -> re.Pattern[str]:
    """Compile a recipe glob: ``*`` and ``?`` stay within a path component, ``**`` spans any.

    A pattern without ``/`` matches the file name at any depth; one with ``/`` matches the
    whole path relative to the source.
    """
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:[^/]*/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        else:
            c = pattern[i]
            out.append("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c))
            i += 1
    prefix = "" if "/" in pattern else "(?:.*/)?"
    return re.compile(prefix + "".join(out) + r"\Z")


def _never(name: str) -> str | None:
    if Path(name).name == ".metadata":  # a torch.distributed.checkpoint's index of its .distcp weights
        return "weights"
    suffix = Path(name).suffix.lower()
    return next((kind for kind, suffixes in NEVER.items() if suffix in suffixes), None)


def _default(rel: str, folders: frozenset[str]) -> str | None:
    """None when the default rules take ``rel``, else the reason it is skipped."""
    parts = rel.split("/")
    if len(parts) > 2 or (len(parts) == 2 and not _sub_folder(parts[0], folders)):
        return "not in the model root or a known sub-folder"
    if _WEIGHTS_INDEX.search(rel):
        return "weights index (the weights stage writes its own)"
    if Path(rel).suffix.lower() in TEXT_SUFFIXES or _VERSIONED_MODEL.search(rel):
        return None
    return "not a tokenizer/config file type"


def _sub_folder(name: str, folders: frozenset[str]) -> bool:
    return bool(_MODULE_DIR.match(name)) or name in KNOWN_DIRS or name in folders


def _select(rel: str, include: _Globs, exclude: _Globs, folders: frozenset[str],
            code: frozenset[str] = frozenset()) -> str | None:
    if rel in code:  # named by auto_map: carried as data, like a config file
        return None
    if kind := _never(rel):
        return f"{kind} (never bundled)"
    if glob := next((g for g, rx in exclude if rx.match(rel)), None):
        return f"excluded by {glob!r}"
    if any(rx.match(rel) for _, rx in include):
        return None
    if any(p.startswith(".") for p in rel.split("/")):
        return "hidden"
    return _default(rel, folders)


def _inside(path: Path, roots: tuple[Path, ...], rel: str) -> Path:
    return confined(path, roots, error=BundleError, what=f"symlink {rel!r}")


def _walk(src: Path, roots: tuple[Path, ...], deep: bool,
          folders: frozenset[str]) -> Iterator[tuple[str, Path | None]]:
    """Yield (relative name, path) of non-directories; descend into sub-folders as the rules need,
    and yield ``("<folder>/", None)`` for each other (not hidden) one."""
    stack, seen = [("", src)], set()
    while stack:
        rel_dir, path = stack.pop()
        real = _inside(path, roots, rel_dir or ".")
        if real in seen or rel_dir.count("/") >= reader.DEFAULT_MAX_DEPTH:
            continue  # a symlink loop, or deeper than the reader would accept
        seen.add(real)
        with os.scandir(path) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
            if not e.is_dir():
                yield rel, Path(e.path)
            elif deep or (not rel_dir and _sub_folder(e.name, folders)):
                if deep and e.name.startswith("."):
                    continue
                stack.append((rel, Path(e.path)))
            elif not e.name.startswith("."):  # named, so that what a library might read is not dropped unsaid
                yield rel + "/", None


def plan_bundle(src: Path, cfg: BundleConfig, *, allowed_root: Path | None = None) -> BundlePlan:
    """Choose the bundle members of a model directory (pure: reads metadata only).

    Default: json, txt, model, jinja, tiktoken, vocab, spm, bpe and yaml files at the root and
    in known sub-folders (sentence-transformers ``N_Name/``, diffusers components, and every
    folder ``model_index.json`` or ``modules.json`` names), minus
    weights indexes, hidden files, and never weights, code or pickles. ``cfg.exclude`` globs
    remove files; ``cfg.include`` globs add any other file except weights, code and pickles.
    The code files ``auto_map`` names (:mod:`packer.bundle.remote_code`) are members too, unless
    ``cfg.remote_code`` is false; packer never imports or runs them.

    Args:
        src: the model directory.
        cfg: the recipe's ``[bundle]`` section.
        allowed_root: where symlinks may lead; default :func:`packer.util.idents.link_roots` (``src``;
            for a Hugging Face cache snapshot, the snapshot and its own repository's ``blobs/``).

    Returns:
        the plan, members sorted by name.

    Raises:
        BundleError: a symlink leading outside ``allowed_root``, a selected entry that is not a
            regular file, names that collide or the reader would refuse, or reader caps exceeded.
    """
    src = Path(src)
    roots = (Path(allowed_root),) if allowed_root is not None else link_roots(src)
    include = [(g, glob_regex(g)) for g in cfg.include]
    exclude = [(g, glob_regex(g)) for g in cfg.exclude]
    members, skipped = [], []
    try:
        folders = named_folders(src)  # the layout file's own list, beyond the folder names known here
    except WeightsError as e:
        raise BundleError(str(e)) from e
    wanted = remote_code(src, roots=roots) if src.is_dir() else None
    code = frozenset(wanted.files) if wanted and cfg.remote_code else frozenset()
    for rel, path in _walk(src, roots, deep=bool(include), folders=folders):
        if path is None:
            skipped.append((rel, FOLDER))
            continue
        if reason := _select(rel, include, exclude, folders, code):
            skipped.append((rel, reason))
            continue
        real = _inside(path, roots, rel)
        try:
            st = os.stat(real)
        except FileNotFoundError:
            raise BundleError(f"{path}: broken symlink") from None
        if not stat.S_ISREG(st.st_mode):
            raise BundleError(f"{path}: is {file_kind(st.st_mode)}, not a regular file; "
                              "exclude it with [bundle] exclude")
        members.append(BundleMember(rel, real, st.st_size))
    members.sort(key=lambda m: m.name)
    plan = BundlePlan(src, tuple(members), tuple(sorted(skipped)), tuple(sorted(code)),
                      wanted.elsewhere if wanted else (), bool(wanted and wanted.files and not cfg.remote_code))
    _check_plan(plan)
    return plan


def _check_plan(plan: BundlePlan) -> None:
    """Refuse what the runtime reader would refuse, naming the source file."""
    seen: dict[str, str] = {}
    for name in (*plan.dirs, *(m.name for m in plan.members)):
        try:
            reader.check_name(name)
        except reader.BundleFormatError as e:
            raise BundleError(f"{plan.src}: {e}") from e
        key = reader.member_key(name)
        if key in seen:
            raise BundleError(f"{plan.src}: {name!r} and {seen[key]!r} collide after case folding or "
                              "Unicode normalisation; exclude one")
        seen[key] = name
    if len(seen) > reader.DEFAULT_MAX_MEMBERS:
        raise BundleError(f"{plan.src}: {len(seen)} bundle entries, over the reader's cap of "
                          f"{reader.DEFAULT_MAX_MEMBERS}; narrow it with [bundle] exclude")
    size = tar_size(plan)
    if size > reader.DEFAULT_MAX_BYTES:
        raise BundleError(f"{plan.src}: bundle of {size} bytes, over the reader's cap of "
                          f"{reader.DEFAULT_MAX_BYTES}; narrow it with [bundle] exclude")
