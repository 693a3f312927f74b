"""Join the ``packer/runtime`` modules into the text of one module: the loader template.

Every module in ``packer/runtime/`` is joined (a new one is picked up without a list), except
the package marker and the bundle reader, which :mod:`packer.stub` embeds as source. The text
is the entry module's docstring, one ``from __future__`` line, the standard-library imports
merged and sorted, each body in dependency order with the imports between runtime modules
dropped, and last the entry's ``if __name__ == "__main__":`` block.

Dropping those imports is sound only when every name means in the one file what it means in
the package, so the join checks that and raises :class:`StubError` otherwise:

* packer code is imported only at the top, as ``from packer.runtime.<module> import <names>``,
  without ``as`` or ``*``, and only names that module binds;
* each global name a module reads is bound or imported by that module, or is a builtin that
  no runtime module rebinds;
* a module-level name is bound by one module only (inside ``if``/``try``/``with``/``for``
  blocks and through ``global`` too), unless each binds it by the same import;
* a name is imported one way only (``import datetime`` beside ``from datetime import
  datetime`` is refused), in blocks such as ``if TYPE_CHECKING:`` too;
* only the entry module has an ``if __name__ == "__main__":`` block.
"""

from __future__ import annotations

import ast
import builtins
import symtable
import sys
from dataclasses import dataclass
from pathlib import Path

from packer.errors import StubError

RUNTIME = Path(__file__).parent / "runtime"
ENTRY = "loader"  # the module whose docstring and API the emitted file carries
PREFIX = "packer.runtime."
NOT_JOINED = ("__init__", "bundle_reader")  # the package marker; the reader is embedded as source
IMPORT_LINE = 120  # ruff's line length: longer merged imports are wrapped as isort does
_IMPLICIT = frozenset(dir(builtins)) | {"__file__", "__spec__", "__loader__", "__package__", "__builtins__"}


@dataclass(frozen=True)
class RuntimeModule:
    """One runtime module taken apart for the join."""

    name: str  # e.g. "ring" for packer/runtime/ring.py
    doc: str  # its docstring ("" when none)
    doc_source: str  # the docstring as written (quotes included)
    deps: tuple[str, ...]  # runtime modules it imports, in source order
    imports: tuple[tuple[str, str], ...]  # standard library: ("", "os") or ("typing", "Any")
    defines: tuple[str, ...]  # module-level names its own code binds (blocks and `global` too)
    body: str  # the source without docstring, top-level imports and `__main__` block
    from_runtime: tuple[tuple[str, str], ...] = ()  # (module, name) imported from the runtime
    uses: tuple[str, ...] = ()  # global names it reads and does not bind itself
    main: str = ""  # its `if __name__ == "__main__":` block ("" when none)
    block_imports: tuple[tuple[str, str], ...] = ()  # imports in module-level blocks, kept in the body


def _stdlib_import(node: ast.Import | ast.ImportFrom, where: str) -> list[tuple[str, str]]:
    """The ``(from, name)`` pairs of a top-level standard-library import, else StubError."""
    mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    for mod in mods:
        if mod.split(".")[0] not in sys.stdlib_module_names:
            raise StubError(f"{where}: top-level import of {mod!r}: the runtime modules may import "
                            "only the standard library and packer.runtime modules at the top "
                            "(import torch inside functions)")
    if any(a.name == "*" for a in node.names):
        raise StubError(f"{where}: line {node.lineno}: 'import *' hides which names the emitted file binds")
    spell = [a.name + (f" as {a.asname}" if a.asname else "") for a in node.names]
    if isinstance(node, ast.Import):
        return [("", x) for x in spell]
    return [(node.module or "", x) for x in spell]


def _is_packer(node: ast.AST) -> bool:
    """Whether ``node`` is an import of packer code (relative imports included)."""
    if isinstance(node, ast.ImportFrom):
        mod = node.module or ""
        return bool(node.level) or mod == "packer" or mod.startswith("packer.")
    if isinstance(node, ast.Import):
        return any(a.name == "packer" or a.name.startswith("packer.") for a in node.names)
    return False


def _runtime_import(node: ast.Import | ast.ImportFrom, where: str) -> tuple[str, list[str]]:
    """``(module, names)`` of a top-level ``from packer.runtime.<module> import <names>``."""
    mod = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
    if isinstance(node, ast.Import) or node.level or not mod.startswith(PREFIX) or "." in mod[len(PREFIX):]:
        raise StubError(f"{where}: line {node.lineno}: only 'from packer.runtime.<module> "
                        "import <names>' may import packer code in the runtime")
    for a in node.names:
        if a.asname or a.name == "*":
            spelled = a.name + (f" as {a.asname}" if a.asname else "")
            raise StubError(f"{where}: line {node.lineno}: 'from {mod} import {spelled}': the emitted file "
                            "drops this line, so import each name as it is (no 'as', no '*')")
    return mod[len(PREFIX):], [a.name for a in node.names]


def _block_imports(tree: ast.Module) -> list[tuple[str, str]]:
    """``(from, name)`` of the imports inside module-level blocks (``if TYPE_CHECKING:``, ``try:``)."""
    found: list[tuple[int, str, str]] = []
    todo: list[ast.AST] = [n for n in tree.body if not isinstance(n, ast.Import | ast.ImportFrom)]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            mod = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
            found += [(node.lineno, mod, a.name + (f" as {a.asname}" if a.asname else "")) for a in node.names]
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            todo += ast.iter_child_nodes(node)
    return [(mod, x) for _, mod, x in sorted(found)]


def _is_main_guard(node: ast.stmt) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators))


def _scope_names(text: str, where: str) -> tuple[set[str], set[str]]:
    """``(bound, read)``: the module-level names ``text`` binds, and the global names it reads."""
    top = symtable.symtable(text, where, "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_local()}
    read = {s.get_name() for s in top.get_symbols() if s.is_referenced()}
    tables = list(top.get_children())
    while tables:
        table = tables.pop()
        tables += table.get_children()
        for s in table.get_symbols():
            if s.is_declared_global() and s.is_assigned():
                bound.add(s.get_name())
            if s.is_global() and s.is_referenced():
                read.add(s.get_name())
    return bound, read


def parse_runtime_module(name: str, source: str) -> RuntimeModule:
    """Split one runtime module into docstring, imports, intra-runtime dependencies and body.

    Raises:
        StubError: a syntax error, a relative import, a top-level import of a third-party
            package, ``import *``, or an import of packer code other than a plain top-level
            ``from packer.runtime.<module> import <names>``.
    """
    where = f"packer/runtime/{name}.py"
    try:
        tree = ast.parse(source, where)
    except SyntaxError as e:
        raise StubError(f"{where}: line {e.lineno}: {e.msg}") from e
    doc, doc_source = ast.get_docstring(tree, clean=False) or "", ""
    drop: set[int] = set()
    main: set[int] = set()
    deps: list[str] = []
    from_runtime: list[tuple[str, str]] = []
    imports: list[tuple[str, str]] = []
    for i, node in enumerate(tree.body):
        lines = range(node.lineno, (node.end_lineno or node.lineno) + 1)
        if i == 0 and doc and isinstance(node, ast.Expr):
            doc_source = ast.get_source_segment(source, node) or ""
            drop.update(lines)
        elif isinstance(node, ast.Import | ast.ImportFrom) and _is_packer(node):
            dep, names = _runtime_import(node, where)
            deps.append(dep)
            from_runtime += [(dep, n) for n in names]
            drop.update(lines)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            if not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                imports += _stdlib_import(node, where)
            drop.update(lines)
        elif _is_main_guard(node):
            main.update(lines)
    top = {id(n) for n in tree.body}
    for inner in ast.walk(tree):
        if _is_packer(inner) and id(inner) not in top:
            raise StubError(f"{where}: line {getattr(inner, 'lineno', 0)}: imports packer code inside a "
                            "function or block; the emitted file has no packer package to import from (it "
                            "would load an installed one): use a top-level 'from packer.runtime.<module> "
                            "import <names>'")
    text = source.splitlines()
    defines, read = _scope_names("\n".join("" if n in drop else x for n, x in enumerate(text, 1)), where)
    blocks = _block_imports(tree)  # the same import in two modules' blocks binds one object
    defines -= {_bound_name(mod, x) for mod, x in blocks}
    imported = {_bound_name(mod, x) for mod, x in (*imports, *blocks)} | {n for _, n in from_runtime}
    body = "\n".join(x for n, x in enumerate(text, 1) if n not in drop and n not in main).strip("\n") + "\n"
    return RuntimeModule(name, doc, doc_source, tuple(dict.fromkeys(deps)), tuple(imports), tuple(sorted(defines)),
                         body, tuple(from_runtime), tuple(sorted(read - defines - imported)),
                         "\n".join(text[n - 1] for n in sorted(main)), tuple(blocks))


def _bound_name(mod: str, spelled: str) -> str:
    """The name an import binds: ``os`` for ``import os.path``, ``p`` for ``import os.path as p``."""
    name, _, alias = spelled.partition(" as ")
    return alias or (name if mod else name.split(".")[0])


def _target(mod: str, spelled: str) -> str:
    """What that name is bound to: ``os`` for ``import os.path``, ``os.path`` for ``from os import path``."""
    name, _, alias = spelled.partition(" as ")
    return f"{mod}.{name}" if mod else name if alias else name.split(".")[0]


def _spell(mod: str, spelled: str) -> str:
    return f"from {mod} import {spelled}" if mod else f"import {spelled}"


def _order(runtime: Path, entry: str) -> list[RuntimeModule]:
    """Every runtime module, dependencies first; the entry last unless a module imports from it."""
    nested = sorted(p for p in runtime.glob("*/**/*.py") if "__pycache__" not in p.parts)
    if nested:
        raise StubError(f"{nested[0]}: the emitted loader joins only the modules directly in {runtime}")
    parsed: dict[str, RuntimeModule] = {}
    order: list[RuntimeModule] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            raise StubError(f"packer/runtime: import cycle {' -> '.join((*path, name))}")
        if name in parsed:
            return
        file = runtime / f"{name}.py"
        if name in NOT_JOINED or not file.is_file():
            raise StubError(f"{file}: not a runtime module the loader can inline")
        parsed[name] = mod = parse_runtime_module(name, file.read_text())
        for dep in mod.deps:
            visit(dep, (*path, name))
        order.append(mod)

    visit(entry, ())  # first, so that what the loader needs keeps its order
    for path in sorted(runtime.glob("*.py")):
        if path.stem not in NOT_JOINED:
            visit(path.stem, ())
    after: set[str] = {entry}
    for mod in order[order.index(parsed[entry]) + 1:]:
        if after & set(mod.deps):
            after.add(mod.name)
    rest = [m for m in order if m.name not in after]
    return rest + [parsed[entry]] + [m for m in order if m.name in after - {entry}]


def _check_names(mods: list[RuntimeModule], entry: str) -> None:
    """Refuse a join in which a name would mean something else than in the package."""
    target: dict[str, tuple[str, str]] = {}
    owner: dict[str, str] = {}
    for m in mods:
        for mod, x in (*m.imports, *m.block_imports):
            n, spelled = _bound_name(mod, x), _spell(mod, x)
            first = target.setdefault(n, (_target(mod, x), f"'{spelled}' in {m.name}.py"))
            if first[0] != _target(mod, x):
                raise StubError(f"packer/runtime: {n!r} is bound by {first[1]} and by '{spelled}' in "
                                f"{m.name}.py; they share one emitted file: import it one way")
            owner[n] = "a standard-library import" if (mod, x) in m.imports else f"an import in {m.name}.py"
    for i, m in enumerate(mods):
        if m.main and m.name != entry:
            raise StubError(f"packer/runtime/{m.name}.py: only {entry}.py may have an "
                            "'if __name__ == \"__main__\"' block")
        for n in m.defines:
            if n == "__all__" and (m.name == entry or i < [x.name for x in mods].index(entry)):
                continue  # the entry's __all__ comes last and is the emitted file's
            if owner.setdefault(n, f"{m.name}.py") != f"{m.name}.py":
                raise StubError(f"packer/runtime: {n!r} is bound by both {owner[n]} and {m.name}.py; "
                                "top-level names must be unique (they share one emitted file)")
    binds = {m.name: {*m.defines, *(_bound_name(*p) for p in (*m.imports, *m.block_imports)),
                      *(n for _, n in m.from_runtime)} for m in mods}
    for m in mods:
        for dep, n in m.from_runtime:
            if n not in binds[dep]:
                raise StubError(f"packer/runtime/{m.name}.py: imports {n!r} from {dep}.py, which does not bind it")
        for n in m.uses:
            if n not in _IMPLICIT:
                raise StubError(f"packer/runtime/{m.name}.py: uses {n!r} but neither binds nor imports it "
                                "(in the emitted file it would resolve to another module's name)")
            if n in owner:
                raise StubError(f"packer/runtime/{m.name}.py: uses the builtin {n!r}, which {owner[n]} rebinds "
                                "in the shared emitted file: rename that one")


def runtime_modules(runtime: Path = RUNTIME, entry: str = ENTRY) -> list[RuntimeModule]:
    """Every runtime module, dependencies first (the entry last unless a module imports it).

    Raises:
        StubError: a module :func:`parse_runtime_module` refuses, a missing module, an import
            cycle, a name bound by two modules or imported two ways, a name a module reads
            without binding or importing it, or an imported name its module does not bind.
    """
    mods = _order(runtime, entry)
    _check_names(mods, entry)
    return mods


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
        standard-library imports, each module's body (dependencies first), then the entry's
        ``__main__`` block.

    Raises:
        StubError: see :func:`runtime_modules`.
    """
    mods = runtime_modules(runtime, entry)
    top = next(m for m in mods if m.name == entry)
    head = f"{top.doc_source}\n\nfrom __future__ import annotations\n\n"
    parts = [head + import_block([p for m in mods for p in m.imports])]
    for m in mods:
        title = m.doc.strip().splitlines()[0] if m.doc.strip() else ""
        title = f"# {title}\n" if title and m is not top and len(title) <= IMPORT_LINE - 2 else ""
        parts.append(f"# --- packer/runtime/{m.name}.py\n{title}{m.body}")
    if top.main:
        parts.append(top.main + "\n")
    return "\n\n".join(parts)
