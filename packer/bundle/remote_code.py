"""The code files a model's ``auto_map`` names: carried into the bundle, never imported or run.

A ``trust_remote_code`` model says in ``config.json`` (and ``tokenizer_config.json``, the
processor configs) which classes load it: ``"AutoModel": "modeling_x.XModel"``, or
``"repo--modeling_x.XModel"`` for code kept in another repository. transformers imports
``modeling_x.py`` from the model directory, and with it every file that module imports
relatively (``from .configuration_x import XConfig``), refusing the directory when one is
missing. So packer carries the named files and their relative imports, found by the same
line rules transformers applies (text read, never parsed as code, never imported), and pins
them like every other member. Only plain file names at the model root qualify
(:mod:`packer.util.idents`); code in another repository is named, not fetched.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packer.errors import BundleError
from packer.reading import JSON_DOC, Kind, member, read_bytes, read_json
from packer.util.idents import check_rel_name, link_roots, shown
from packer.util.show import show

# where transformers looks for auto_map (model, tokenizer, processors)
CONFIG_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json",
                "image_processor_config.json", "feature_extractor_config.json", "video_preprocessor_config.json")
CODE = Kind("code file", 8 << 20, 0)  # one modeling file; real ones are tens of kB
MAX_FILES = 64
# transformers' own rules (dynamic_module_utils.get_relative_imports), applied to one line at a
# time: over the whole text with re.M, ``^\s*`` spans blank lines and backtracks at every line
# start, quadratic in the file (a 300,000-line file stalled the build); within one line each
# pattern is anchored and linear
_FROM = re.compile(r"\s*from\s+\.(\S+)\s+import")
_IMPORT = re.compile(r"\s*import\s+\.(\S+)\s*")


@dataclass(frozen=True)
class RemoteCode:
    """What ``auto_map`` asks for: local files to carry, and references to other repositories."""

    files: tuple[str, ...] = ()  # ``modeling_x.py`` ..., sorted
    elsewhere: tuple[str, ...] = ()  # ``org/repo--modeling_x.XModel`` ..., sorted


def _references(auto_map: Any) -> Iterator[str]:
    """Every class reference of an ``auto_map`` (values are strings, or [slow, fast] lists)."""
    if not isinstance(auto_map, dict):
        return
    for value in auto_map.values():
        for ref in value if isinstance(value, list) else [value]:
            if isinstance(ref, str):
                yield ref


def _module_file(ref: str, where: str) -> str:
    """``modeling_x.py`` of the reference ``modeling_x.XModel``, its name checked."""
    module, dot, cls = ref.rpartition(".")
    if not dot or not module.isidentifier() or not cls.isidentifier():
        raise BundleError(f"{where}: auto_map names {shown(ref)}, not a 'module.Class' of a file in the "
                          "model directory; fix the config or set bundle.remote_code = false")
    return str(check_rel_name(f"{module}.py", where=f"{where}: auto_map", error=BundleError))


def _inside(src: Path, rel: str, roots: Sequence[Path], where: str) -> Path:
    """``src / rel``, links resolved and proven inside ``roots`` before anything reads it."""
    return member(src, rel, where=where, error=BundleError, roots=roots)


def _named(src: Path, roots: Sequence[Path]) -> tuple[dict[str, str], list[str]]:
    files: dict[str, str] = {}  # file -> the config that named it
    elsewhere: list[str] = []
    for name in CONFIG_FILES:
        path = _inside(src, name, roots, str(src))
        if not path.is_file():
            continue
        doc = read_json(path, JSON_DOC, error=BundleError, where=str(src / name))
        for ref in _references(doc.get("auto_map") if isinstance(doc, dict) else None):
            if "--" in ref:
                elsewhere.append(show(ref))  # shown in a note: text from the input, escaped
            else:
                files.setdefault(_module_file(ref, str(src / name)), name)
    return files, elsewhere


def relative_imports(text: str) -> Iterator[str]:
    """The modules ``text`` imports relatively (``from .x import``, ``import .x``), by
    transformers' rules applied line by line: linear time in ``len(text)``, whatever it holds."""
    for line in text.split("\n"):
        m = _FROM.match(line) or _IMPORT.fullmatch(line)
        if m:
            yield m.group(1)


def remote_code(src: Path, *, roots: Sequence[Path] | None = None) -> RemoteCode:
    """The code files the model directory ``src`` needs for ``trust_remote_code``.

    Every file is proven inside ``roots`` (links followed) before it is read: a link leading
    elsewhere is refused, its target never opened.

    Args:
        src: the model directory.
        roots: where links may lead; default :func:`packer.util.idents.link_roots` of ``src``.

    Returns:
        The named module files and, transitively, the files they import relatively (all at
        the root of ``src``), and the references to code in other repositories (escaped).

    Raises:
        BundleError: a config or code file that is a link leading outside ``roots``, a config
            that is not JSON or too large (:data:`packer.reading.JSON_DOC`), a code file over
            8 MiB, a reference that is no ``module.Class``, a named or imported file that is
            missing, more than 64 files.
    """
    roots = link_roots(src) if roots is None else roots
    named, elsewhere = _named(src, roots)
    found: dict[str, str] = {}
    queue = sorted(named.items())
    while queue:
        rel, why = queue.pop()
        if rel in found:
            continue
        path = _inside(src, rel, roots, f"{src / why}: auto_map")
        if not path.is_file():
            raise BundleError(f"{src / why}: names code in {show(rel)}, which the model directory does not hold; "
                              "add the file, or set bundle.remote_code = false to build without it")
        found[rel] = why
        if len(found) > MAX_FILES:
            raise BundleError(f"{src}: auto_map needs more than {MAX_FILES} code files")
        text = read_bytes(path, CODE, error=BundleError, where=str(src / rel)).decode("utf-8", "replace")
        imported = {f"{module}.py" for module in relative_imports(text) if module.isidentifier()}
        # a sub-package (".sub.mod") is no file transformers copies
        queue.extend((name, rel) for name in sorted(imported - found.keys()))
    return RemoteCode(tuple(sorted(found)), tuple(sorted(set(elsewhere))))
