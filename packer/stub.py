"""Emit ``packer_loader.py``: the runtime loader with the build's manifest embedded.

The runtime loader is a handful of small modules under ``packer/runtime/`` that import each
other only through top-level ``from packer.runtime.<module> import <names>`` lines.
:func:`amalgamate` joins them into one self-contained module: the entry module's docstring,
one ``from __future__`` line, their standard-library imports merged and sorted, then each
body in dependency order with the intra-runtime imports dropped. :func:`render` replaces the
marked block in that text with the canonical JSON of the embedded manifest and the source of
the bundle reader (run at first use of ``bundle_dir()``). Same inputs, same bytes.
"""

from __future__ import annotations

import ast
import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packer.errors import PackerError
from packer.fsutil import atomic_write_bytes, canonical_json, file_entry
from packer.stage import StageOutput

LOADER_NAME = "packer_loader.py"
BEGIN = "# >>> packer:embedded (replaced by packer.stub when the loader is emitted)\n"
END = "# <<< packer:embedded\n"
LINE = 88  # longest string literal line we write (ruff's limit is 100)
IMPORT_LINE = 120  # ruff's line length: longer merged imports are wrapped as isort does
RUNTIME = Path(__file__).parent / "runtime"
ENTRY = "loader"  # the module whose docstring and API the emitted file carries
PREFIX = "packer.runtime."


class StubError(PackerError):
    """The loader template or the bundle reader cannot be embedded."""


def _escape(ch: str) -> str:
    o = ord(ch)
    if ch in "\\'":
        return "\\" + ch
    if 32 <= o < 127:
        return ch
    return f"\\x{o:02x}" if o < 256 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def _literal_lines(text: str, indent: str = "    ") -> list[str]:
    """``text`` as adjacent single-quoted ASCII literals, each line at most ``LINE`` chars."""
    out: list[str] = []
    parts: list[str] = []
    width = len(indent) + 2
    for ch in text:
        piece = _escape(ch)
        if width + len(piece) > LINE and parts:
            out.append(f"{indent}'{''.join(parts)}'")
            parts, width = [], len(indent) + 2
        parts.append(piece)
        width += len(piece)
    out.append(f"{indent}'{''.join(parts)}'")
    return out


def _source_literal(source: str) -> str:
    """A raw triple-quoted literal when the source allows one (readable), else literals."""
    lines = source.splitlines()
    if ("'''" not in source and not source.endswith("\\") and "\r" not in source
            and all(len(x) <= 100 and x == x.rstrip() for x in lines)):  # fmt: skip
        return "r'''\\\n" + source + ("" if source.endswith("\n") else "\n") + "'''"
    return "(\n" + "\n".join(_literal_lines(source)) + "\n)"


@dataclass(frozen=True)
class RuntimeModule:
    """One runtime module taken apart for amalgamation."""

    name: str  # e.g. "ring" for packer/runtime/ring.py
    doc: str  # its docstring ("" when none)
    doc_source: str  # the docstring as written (quotes included)
    deps: tuple[str, ...]  # runtime modules it imports, in source order
    imports: tuple[tuple[str, str], ...]  # standard library: ("", "os") or ("typing", "Any")
    defines: tuple[str, ...]  # top-level names it binds
    body: str  # the source without docstring and top-level imports


def _bound_names(node: ast.stmt) -> list[str]:
    """Top-level names a statement binds (definitions and assignments, not inside blocks)."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign | ast.AugAssign):
        targets = [node.target]
    else:
        return []
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def _stdlib_import(node: ast.Import | ast.ImportFrom, where: str) -> list[tuple[str, str]]:
    """The ``(from, name)`` pairs of a top-level standard-library import, else StubError."""
    mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    for mod in mods:
        if mod.split(".")[0] not in sys.stdlib_module_names:
            raise StubError(f"{where}: top-level import of {mod!r}: the runtime modules may import "
                            "only the standard library and packer.runtime modules at the top "
                            "(import torch inside functions)")  # fmt: skip
    spell = [a.name + (f" as {a.asname}" if a.asname else "") for a in node.names]
    if isinstance(node, ast.Import):
        return [("", x) for x in spell]
    return [(node.module or "", x) for x in spell]


def parse_runtime_module(name: str, source: str) -> RuntimeModule:
    """Split one runtime module into docstring, imports, intra-runtime dependencies and body.

    Raises:
        StubError: a relative import, a top-level import of a third-party package, or an
            import of a packer module outside ``packer.runtime``.
    """
    where = f"packer/runtime/{name}.py"
    tree = ast.parse(source, where)
    doc, doc_source = ast.get_docstring(tree, clean=False) or "", ""
    drop: set[int] = set()
    deps: list[str] = []
    imports: list[tuple[str, str]] = []
    defines: list[str] = []
    for i, node in enumerate(tree.body):
        end = node.end_lineno or node.lineno
        if i == 0 and doc and isinstance(node, ast.Expr):
            doc_source = ast.get_source_segment(source, node) or ""
            drop.update(range(node.lineno, end + 1))
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("packer")):
            mod = node.module or ""
            if node.level or not mod.startswith(PREFIX) or "." in mod[len(PREFIX):]:
                raise StubError(f"{where}: line {node.lineno}: only 'from packer.runtime.<module> "
                                "import <names>' may import packer code in the runtime")  # fmt: skip
            deps.append(mod[len(PREFIX):])
            drop.update(range(node.lineno, end + 1))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            if not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                imports += _stdlib_import(node, where)
            drop.update(range(node.lineno, end + 1))
        else:
            defines += _bound_names(node)
    lines = [x for n, x in enumerate(source.splitlines(), 1) if n not in drop]
    body = "\n".join(lines).strip("\n") + "\n"
    return RuntimeModule(name, doc, doc_source, tuple(dict.fromkeys(deps)), tuple(imports), tuple(defines), body)


def runtime_modules(runtime: Path = RUNTIME, entry: str = ENTRY) -> list[RuntimeModule]:
    """The entry module and every runtime module it needs, dependencies first.

    Raises:
        StubError: a missing module, an import cycle, or a name bound by two modules.
    """
    parsed: dict[str, RuntimeModule] = {}
    order: list[RuntimeModule] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            raise StubError(f"packer/runtime: import cycle {' -> '.join((*path, name))}")
        if name in parsed:
            return
        file = runtime / f"{name}.py"
        if name == "bundle_reader" or not file.is_file():
            raise StubError(f"{file}: not a runtime module the loader can inline")
        parsed[name] = mod = parse_runtime_module(name, file.read_text())
        for dep in mod.deps:
            visit(dep, (*path, name))
        order.append(mod)

    visit(entry, ())
    owner = {x.split(" as ")[-1].split(".")[0]: "a standard-library import" for m in order for _, x in m.imports}
    for mod in order:
        for n in mod.defines:
            if owner.setdefault(n, mod.name) != mod.name and n != "__all__":
                first = owner[n] if " " in owner[n] else f"{owner[n]}.py"
                raise StubError(f"packer/runtime: {n!r} is bound by both {first} and {mod.name}.py; "
                                "top-level names must be unique (they share one emitted file)")  # fmt: skip
    return order


def _member_key(spelled: str) -> tuple[int, str]:
    """isort's order by type: CONSTANTS, then Classes, then everything else."""
    name = spelled.split(" as ")[0]
    kind = 0 if name.isupper() and len(name) > 1 else 1 if name[:1].isupper() else 2
    return kind, name


def import_block(pairs: list[tuple[str, str]]) -> str:
    """Standard-library imports merged and sorted as ruff's isort wants them."""
    plain = sorted({x for mod, x in pairs if not mod}, key=str.lower)
    froms: dict[str, set[str]] = {}
    for mod, x in pairs:
        if mod:
            froms.setdefault(mod, set()).add(x)
    lines = [f"import {x}" for x in plain]
    for mod in sorted(froms, key=str.lower):
        names = sorted(froms[mod], key=_member_key)
        line = f"from {mod} import {', '.join(names)}"
        if len(line) > IMPORT_LINE:
            line = f"from {mod} import (\n" + "".join(f"    {n},\n" for n in names) + ")"
        lines.append(line)
    return "\n".join(lines) + "\n"


def amalgamate(runtime: Path = RUNTIME, entry: str = ENTRY) -> str:
    """The runtime modules joined into the text of one module (the loader template).

    Returns:
        the entry module's docstring, ``from __future__ import annotations``, the merged
        standard-library imports, then each module's body, dependencies first.

    Raises:
        StubError: see :func:`runtime_modules`.
    """
    mods = runtime_modules(runtime, entry)
    head = f"{mods[-1].doc_source}\n\nfrom __future__ import annotations\n\n"
    parts = [head + import_block([p for m in mods for p in m.imports])]
    for m in mods:
        title = m.doc.strip().splitlines()[0] if m.doc.strip() else ""
        title = f"# {title}\n" if title and m is not mods[-1] and len(title) <= IMPORT_LINE - 2 else ""
        parts.append(f"# --- packer/runtime/{m.name}.py\n{title}{m.body}")
    return "\n\n".join(parts)


def render(embedded: dict[str, Any], *, loader_source: str | None = None,
           reader_source: str | None = None) -> tuple[bytes, str]:  # fmt: skip
    """Render the loader for ``embedded``.

    Args:
        embedded: the manifest the loader pins (JSON-able).
        loader_source: template text (default: the runtime modules, :func:`amalgamate`).
        reader_source: bundle reader text (default: ``packer/runtime/bundle_reader.py``).

    Returns:
        ``(file bytes, sha256 of the canonical embedded JSON)``.

    Raises:
        StubError: the runtime modules cannot be joined, the template lacks its marked block,
            or the bundle reader is missing.
    """
    template = loader_source if loader_source is not None else amalgamate()
    if reader_source is None:
        path = RUNTIME / "bundle_reader.py"
        if not path.is_file():
            raise StubError(f"{path}: missing; the emitted loader inlines the bundle reader")
        reader_source = path.read_text()
    if template.count(BEGIN) != 1 or template.count(END) != 1:
        raise StubError("packer/runtime: the '# >>> packer:embedded' block is missing or repeated")
    data = canonical_json(embedded)
    text = data.decode().rstrip("\n")
    block = (BEGIN + "_EMBEDDED_JSON: str | None = (\n" + "\n".join(_literal_lines(text))
             + "\n)\n_BUNDLE_READER_SOURCE: str | None = " + _source_literal(reader_source)
             + "\n" + END)  # fmt: skip
    head, rest = template.split(BEGIN)
    _, tail = rest.split(END)
    name, version = str(embedded.get("name", "")), str(embedded.get("version", ""))
    banner = "#!/usr/bin/env python3\n" + f"# Emitted by packer for {ascii(name)} {ascii(version)}; do not edit.\n"
    return (banner + head + block + tail).encode(), hashlib.sha256(data).hexdigest()


def emit_loader(out_dir: Path, embedded: dict[str, Any], *,
                rel_root: Path | None = None) -> StageOutput:  # fmt: skip
    """Write ``out_dir/packer_loader.py`` atomically.

    Args:
        out_dir: the build's output (staging) directory.
        embedded: the manifest to embed (files, weights, bundle, runtime).
        rel_root: directory the returned file entry is relative to (default ``out_dir``).

    Returns:
        the stage output: one file, section ``{"file", "embedded_sha256"}``.

    Raises:
        StubError: the template or the bundle reader cannot be embedded.
    """
    out_dir = Path(out_dir)
    body, digest = render(embedded)
    try:
        compile(body, LOADER_NAME, "exec")
    except SyntaxError as e:
        raise StubError(f"{LOADER_NAME}: the rendered loader does not compile: {e}") from e
    target = out_dir / LOADER_NAME
    atomic_write_bytes(target, body, mode=0o777)
    entry = file_entry(Path(rel_root) if rel_root else out_dir, target)
    return StageOutput(files=(entry,), section={"file": LOADER_NAME, "embedded_sha256": digest},
                       bytes_processed=len(body))  # fmt: skip
