"""The package's import graph: no circles, and imports only run down the declared layers.

The graph is read from the source with ``ast`` (nothing is imported): every ``import`` and
``from ... import`` anywhere in a module (at the top, inside functions, under
``TYPE_CHECKING``), relative imports resolved against the importing module's package. A name
imported from a package counts as an import of its submodule when there is one
(``from packer.util import tarfmt`` is ``packer.util.tarfmt``), else of the package's ``__init__``.

:data:`LAYERS` is the one declaration of the order. A new module belongs to a layer before
the test passes: add its name, or a pattern covering it, to the layer it belongs to.
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "packer"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # (layer name, fnmatch patterns of module names); a module may import its own layer and
    # those below it, never one above. "packer.oci.*" covers every module inside packer.oci.
    # the package itself declares the public surface (its __all__ names orchestration's functions)
    ("entry points", ("packer", "packer.__main__", "packer.cli")),
    ("orchestration", ("packer.building", "packer.build_stages", "packer.publish", "packer.verifying",
                       "packer.profiling", "packer.pushing", "packer.stream", "packer.warm_step")),
    # every stage in a folder of its own (test_each_stage_has_its_own_folder)
    ("stages", ("packer.weights", "packer.weights.*", "packer.bundle", "packer.bundle.*", "packer.stub",
                "packer.stub.*", "packer.oci", "packer.oci.*", "packer.sign", "packer.sign.*")),
    ("stage contract", ("packer.stage", "packer.manifest")),
    ("inputs", ("packer.recipe", "packer.source", "packer.components", "packer.demo", "packer.checkpoint",
                "packer.checkpoint.*")),
    # entered by a serving engine (vLLM's plugin entry point), beside the runtime; import the engine lazily
    ("engine adapters", ("packer.adapters", "packer.adapters.*", "packer.warm", "packer.warm.*")),
    # errors, the one way in, the build side's doors to the runtime's facts, and the helpers that read
    # files through the one way in (hashing, link or copy, a safetensors header)
    ("shared", ("packer.version", "packer.errors", "packer.reading", "packer.place", "packer.chunks", "packer.signed",
                "packer.hashing", "packer.filetree", "packer.safetensors_header")),
    # packer/util: a leaf below errors, the one way in and the places; its helpers take the caller's error
    # class (error=) and may import only each other and the runtime (FileEntry's place: its one rule)
    ("util", ("packer.util", "packer.util.*")),
    # shipped into the serving container: may import nothing from the build side
    ("runtime", ("packer.runtime", "packer.runtime.*")),
)


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    """``{dotted module name: file}`` of every module under ``root`` (a package directory)."""
    top = root.name
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (top, *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts).removesuffix(".__init__")] = path
    return out


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module (or package) of ours that ``name`` lands in, or None for a foreign one."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """``{imported module of ours: first line}`` for every import anywhere in ``path``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            owner = _owner(target, modules)
            if owner is not None and owner != module:
                found.setdefault(owner, node.lineno)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` of the package at ``root``."""
    modules = module_files(root)
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def layer_of(module: str) -> int | None:
    """Index in :data:`LAYERS` (0 is the top) of ``module``, or None when no pattern covers it."""
    hits = {i for i, (_, patterns) in enumerate(LAYERS) for p in patterns if fnmatch.fnmatchcase(module, p)}
    assert len(hits) <= 1, f"{module}: declared in more than one layer of LAYERS: {sorted(hits)}"
    return hits.pop() if hits else None


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import of a module in a higher layer than the importer's, as one line each."""
    out = []
    for module, targets in sorted(graph.items()):
        mine = layer_of(module)
        for target, line in sorted(targets.items()):
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs < mine:
                out.append(f"{module} (layer {LAYERS[mine][0]!r}) imports {target} (layer {LAYERS[theirs][0]!r}) "
                           f"at line {line}")
    return out


def test_every_module_is_in_a_layer() -> None:
    missing = [m for m in sorted(module_files()) if layer_of(m) is None]
    assert not missing, (f"modules in no layer: {', '.join(missing)}; add each (or a pattern) to the layer it "
                         f"belongs to in LAYERS in {Path(__file__).name}")


def test_no_import_circles() -> None:
    found = circles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_imports_run_down_the_layers() -> None:
    found = upward_imports(import_graph())
    assert not found, "imports against the layer order:\n" + "\n".join(found)


def test_the_checks_see_what_they_must(tmp_path: Path) -> None:
    """A circle through a function-level relative import and a TYPE_CHECKING import is found."""
    pkg = tmp_path / "packer"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "runtime" / "__init__.py").write_text("")
    (pkg / "runtime" / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "runtime" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                          "    from packer.runtime.a import f\n")
    (pkg / "runtime" / "c.py").write_text("from ..errors import X\nimport os\n")
    (pkg / "errors.py").write_text("X = 1\n")
    graph = import_graph(pkg)
    assert circles(graph) == [["packer.runtime.a", "packer.runtime.b"]]
    assert graph["packer.runtime.c"] == {"packer.errors": 1}
    assert upward_imports(graph) == [
        "packer.runtime.c (layer 'runtime') imports packer.errors (layer 'shared') at line 1"]


def test_util_is_a_leaf_below_the_shared_layer() -> None:
    """packer/util is the layer right above the runtime: everything of the build side may use it,
    and it imports nothing of the build side but itself."""
    names = [name for name, _ in LAYERS]
    assert names.index("util") == names.index("shared") + 1 == names.index("runtime") - 1
    assert {layer_of(m) for m in module_files() if m.startswith("packer.util")} == {names.index("util")}
    graph = import_graph()
    up = {f"{m} imports {t}" for m, targets in graph.items() if m.startswith("packer.util")
          for t in targets if not t.startswith(("packer.util", "packer.runtime"))}
    assert not up, sorted(up)


def test_each_stage_has_its_own_folder() -> None:
    """packer's top level holds the command line, the build runner, the stage contract, sources
    and shared helpers; a module of the stages layer lives in its stage's package."""
    modules = module_files()
    stages = next(i for i, (name, _) in enumerate(LAYERS) if name == "stages")
    loose = [m for m, path in modules.items()
             if m.count(".") == 1 and path.name != "__init__.py" and layer_of(m) == stages]
    assert loose == [], f"stage modules at packer's top level (move each into its stage's folder): {loose}"
    packages = {m for m, path in modules.items() if path.name == "__init__.py" and m.count(".") == 1}
    assert {"packer.weights", "packer.bundle", "packer.stub", "packer.oci", "packer.sign"} <= packages
