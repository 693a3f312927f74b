"""One trust gate per side: nothing runs code or points an engine at a cache except through it.

The source is read with ``ast`` (nothing is imported), as tests/test_one_way_in.py reads it for
raw reads. What the scan calls a way to run code: ``exec``/``eval``, the builtin ``compile``,
an unpickle (``pickle``, ``marshal``, ``torch.load``, ``dill``, ``cloudpickle``), a ``dlopen``
of a named library (``ctypes.CDLL(path)``; ``CDLL(None)`` is the C library this process already
runs on), an import by path or by a computed name (``spec_from_file_location``,
``SourceFileLoader``, ``FileFinder``, ``exec_module``, ``importlib.import_module``/``__import__``
of a non-literal), a change of ``sys.path``, and a write to ``os.environ`` of a variable an
engine or library reads a cache or code path from (:data:`CACHE_VARS`), or of a name the scan
cannot read as a literal.

The gates (:data:`GATES`) are where each side decides by proof: the engine side's
packer/adapters/gate.py (the stub from its anchored bytes, the served files against the
signature, the warm state against its pins and signature, the cache variables set and put back),
and the runtime's bootstrap in the emitted stub (packer/stub/template.py: each runtime file
against the sha256 the stub pins, compiled from those bytes). :data:`ALLOWED` is the short,
reviewed list of the others, each with its reason: none runs an input's code.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from packer.warm.roots import CACHE_ENV

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "packer"

GATES = {"packer/adapters/gate.py", "packer/stub/template.py"}
# what engines and libraries read code or compiled artifacts from: set only by a gate
# (every warm cache root's variable, from the one table packer.warm.roots.CACHE_ROOTS)
CACHE_VARS = frozenset({
    *CACHE_ENV.values(), "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "TORCH_EXTENSIONS_DIR",
    "HF_HOME", "HF_MODULES_CACHE", "TRANSFORMERS_CACHE", "PYTHONPATH", "PYTHONPYCACHEPREFIX",
    "PYTHONSTARTUP", "LD_PRELOAD", "LD_LIBRARY_PATH"})
# (file, what the scan calls it) -> why it runs no input's code
ALLOWED: dict[tuple[str, str], str] = {
    ("packer/stub/__init__.py", "compile"): "compiles the stub packer just emitted to check its syntax; the "
                                            "code object is dropped, never run",
    ("packer/runtime/pool.py", "environment write of PYTHONPATH"):
        "the fork server gets this process's own sys.path (Python < 3.12 does not pass it), put back at once",
    ("packer/runtime/pool.py", "environment write of a computed name"):
        "puts back the two variables start_pool saved a line before",
    ("packer/adapters/import_hook.py", "import by path"):
        "runs an installed module's own loader, as Python's finders found it, then packer's hooks",
    ("packer/__init__.py", "import of a computed name"):
        "the public surface's lazy names: each module is one of packer's own, from the _HOMES literal",
    ("packer/runtime/env.py", "environment write of a computed name"):
        "the CUDA start-up variables of runtime.env.STARTUP_ENV (packer's own constants), before CUDA starts",
    # python -m packer.adapters.vllm_start: a launcher that does what `python` does, in a process
    # that imported vLLM's modules once
    ("packer/adapters/vllm_start.py", "import of a computed name"):
        "imports the module names of vllm_start's own literal tables (PRELOAD, WORKERS, SERVER_PRELOAD)",
    ("packer/adapters/vllm_start.py", "sys.path change"):
        "runs the user's own entry script as `python SCRIPT` does: the script's folder first on sys.path",
    ("packer/adapters/forked_env.py", "environment write of a computed name"):
        "a child of the fork server takes the environment of the process that asked for it, as a spawned "
        "child does (the caller's own os.environ, sent over the server's socket)",
}
_UNPICKLE = {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("marshal", "load"),
             ("marshal", "loads"), ("torch", "load"), ("dill", "load"), ("dill", "loads"), ("cloudpickle", "load"),
             ("cloudpickle", "loads")}
_BY_PATH = {"spec_from_file_location", "SourceFileLoader", "FileFinder", "exec_module", "SourcelessFileLoader"}
_PATH_CHANGES = {"insert", "append", "extend", "__setitem__"}


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "literal"`` assignments: what an environment key named by NAME is."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _env_write(key: ast.AST | None, consts: dict[str, str]) -> str | None:
    """What the scan calls a write of ``os.environ[key]``; None for a plain packer variable."""
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        name = key.value
    elif isinstance(key, ast.Name) and key.id in consts:
        name = consts[key.id]
    else:
        return "environment write of a computed name"
    return f"environment write of {name}" if name in CACHE_VARS else None


def _call(call: ast.Call, consts: dict[str, str]) -> str | None:
    fn = call.func
    name = _dotted(fn)
    last = name.rsplit(".", 1)[-1]
    if name in ("exec", "eval", "compile"):
        return name
    if tuple(name.rsplit(".", 1)) in _UNPICKLE:
        return "unpickle"
    if last in ("CDLL", "PyDLL", "LoadLibrary") and not (
            call.args and isinstance(call.args[0], ast.Constant) and call.args[0].value is None):
        return "dlopen"
    if last in _BY_PATH:
        return "import by path"
    if name in ("importlib.import_module", "import_module", "__import__") and not (
            call.args and isinstance(call.args[0], (ast.Constant, ast.JoinedStr))):
        return "import of a computed name"
    if name.startswith("sys.path.") and last in _PATH_CHANGES:
        return "sys.path change"
    if name in ("os.environ.update", "os.environ.setdefault", "os.putenv"):
        keys = [call.args[0]] if name != "os.environ.update" and call.args else []
        if name == "os.environ.update" and call.args and isinstance(call.args[0], ast.Dict):
            keys = list(call.args[0].keys)  # type: ignore[arg-type]
        found = [w for k in keys or [None] if (w := _env_write(k, consts))]
        return found[0] if found else None
    return None


def gate_bypasses(paths: list[Path], root: Path = ROOT) -> list[tuple[str, int, str]]:
    """``(file relative to root, line, what)`` of every way to run code or set a cache variable."""
    found = []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        consts = _constants(tree)
        for node in ast.walk(tree):
            what = None
            if isinstance(node, ast.Call):
                what = _call(node, consts)
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, ast.Subscript) and _dotted(t.value) == "os.environ":
                        what = _env_write(t.slice, consts) or what
                    elif _dotted(t) == "sys.path" or (isinstance(t, ast.Subscript) and _dotted(t.value) == "sys.path"):
                        what = "sys.path change"
            if what:
                found.append((rel, node.lineno, what))
    return sorted(found)


def test_nothing_runs_code_or_points_an_engine_at_a_cache_outside_the_gates() -> None:
    found = [(f, line, what) for f, line, what in gate_bypasses(sorted(PACKAGE.rglob("*.py")))
             if f not in GATES and (f, what) not in ALLOWED]
    assert not found, ("ways to run code or set a cache variable outside the trust gates (go through "
                       "packer/adapters/gate.py, or add a reviewed entry with its reason to ALLOWED): "
                       + "; ".join(f"{f}:{n}: {w}" for f, n, w in found))


def test_the_allowlist_is_short_and_current() -> None:
    assert len(ALLOWED) <= 9
    present = {(f, what) for f, _, what in gate_bypasses(sorted(PACKAGE.rglob("*.py")))}
    stale = sorted(set(ALLOWED) - present)
    assert not stale, f"ALLOWED names bypasses that no longer exist: {stale}"
    assert all(reason.strip() for reason in ALLOWED.values())


def test_the_gates_are_where_the_engine_side_runs_code() -> None:
    found = {(f, what) for f, _, what in gate_bypasses(sorted(PACKAGE.rglob("*.py")))}
    assert ("packer/adapters/gate.py", "exec") in found  # the stub, from its checked bytes
    assert ("packer/adapters/gate.py", "environment write of VLLM_CACHE_ROOT") not in found  # a computed name:
    assert ("packer/adapters/gate.py", "environment write of a computed name") in found  # CACHE_ENV's values


@pytest.mark.parametrize(("line", "what"), [
    ("exec(code)", "exec"), ("eval('1')", "eval"), ("compile(src, 'f', 'exec')", "compile"),
    ("pickle.loads(b)", "unpickle"), ("torch.load(p)", "unpickle"), ("marshal.loads(b)", "unpickle"),
    ("ctypes.CDLL('/tmp/x.so')", "dlopen"), ("ctypes.cdll.LoadLibrary(p)", "dlopen"),
    ("importlib.util.spec_from_file_location('m', p)", "import by path"), ("spec.loader.exec_module(m)",
                                                                            "import by path"),
    ("importlib.import_module(name)", "import of a computed name"), ("__import__(n)", "import of a computed name"),
    ("sys.path.insert(0, d)", "sys.path change"), ("sys.path[:] = []", "sys.path change"),
    ("os.environ['VLLM_CACHE_ROOT'] = d", "environment write of VLLM_CACHE_ROOT"),
    ("os.environ[CACHE] = d", "environment write of TRITON_CACHE_DIR"),
    ("os.environ[k] = v", "environment write of a computed name"),
    ("os.environ.update({'TORCHINDUCTOR_CACHE_DIR': d})", "environment write of TORCHINDUCTOR_CACHE_DIR"),
    ("os.environ.update(other)", "environment write of a computed name"),
    ("os.environ.setdefault('CUDA_CACHE_PATH', d)", "environment write of CUDA_CACHE_PATH"),
])
def test_the_scanner_sees_each_way(tmp_path: Path, line: str, what: str) -> None:
    src = tmp_path / "m.py"
    src.write_text(f"CACHE = 'TRITON_CACHE_DIR'\n{line}\n")
    assert gate_bypasses([src], tmp_path) == [("m.py", 2, what)]


@pytest.mark.parametrize("line", [
    "ctypes.CDLL(None, use_errno=True)", "re.compile('x')", "importlib.import_module('vllm')",
    "os.environ['PACKER_WARM_STATE'] = 'hit'", "env = {**os.environ, 'VLLM_CACHE_ROOT': d}", "json.loads(b)",
])
def test_the_scanner_lets_plain_code_be(tmp_path: Path, line: str) -> None:
    src = tmp_path / "m.py"
    src.write_text(f"{line}\n")
    assert gate_bypasses([src], tmp_path) == []
