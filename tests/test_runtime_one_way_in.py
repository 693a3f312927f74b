"""The runtime's reading rule, read from the source: input bytes enter through one module.

``packer/runtime/reading.py`` is the runtime's one way in (regular files, caps, depth-capped
JSON, names checked before they are joined). Everywhere else under ``packer/runtime`` and
``packer/adapters`` (and in the stub template, which runs before its runtime is verified) a
call to ``open``, ``io.open``, ``os.open``, ``Path.open``, ``json.load(s)``, ``read_bytes``
or ``read_text`` fails this test unless it is on :data:`ALLOWED`, a short reviewed list whose
entries say why. The build side has the same rule in ``tests/test_one_way_in.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "packer"
READING = PACKAGE / "runtime" / "reading.py"
SCOPE = [*sorted((PACKAGE / "runtime").rglob("*.py")), *sorted((PACKAGE / "adapters").rglob("*.py")),
         PACKAGE / "stub" / "template.py"]

# (file relative to packer/, function, call) -> why it may read or open by itself
ALLOWED = {
    ("stub/template.py", "_read_runtime_file", "os.open"):
        "the stub reads its runtime before the runtime (and its reading module) is verified; it applies the "
        "same rule itself: O_NONBLOCK, fstat S_ISREG, a size cap",
    ("runtime/dirtree.py", "materialize", "os.open"):
        "creates a weight file materialized from its layer blob (O_CREAT|O_EXCL|O_NOFOLLOW): a write",
    ("runtime/bundle_reader.py", "extract", "os.open"): "a directory descriptor of the extraction target (a write)",
    ("runtime/bundle_reader.py", "write_members", "os.open"):
        "a directory descriptor of the streamed model directory being written (a write)",
    ("runtime/bundle_reader.py", "_write_tree", "os.open"):
        "creates the extracted members (O_CREAT|O_EXCL|O_NOFOLLOW relative to a directory descriptor): a write",
}
JSON_READS = {"load", "loads"}
PATH_READS = {"read_bytes", "read_text"}


def _call_name(call: ast.Call) -> str | None:
    """``open``, ``os.open``, ``json.loads``, ``.read_bytes``... for a call that reads, else None."""
    f = call.func
    if isinstance(f, ast.Name) and f.id == "open":
        return "open"
    if not isinstance(f, ast.Attribute):
        return None
    owner = f.value.id if isinstance(f.value, ast.Name) else None
    if f.attr in PATH_READS and owner != "reading":  # reading.read_bytes is the way in itself
        return f".{f.attr}"
    if owner == "json" and f.attr in JSON_READS:
        return f"json.{f.attr}"
    if f.attr == "open" and owner in ("os", "io", "builtins"):
        return f"{owner}.open"
    if f.attr == "open" and owner not in ("tarfile", "zipfile", "cls", "Bundle"):
        return ".open"  # Path.open, a file object's open
    return None


def reads(path: Path) -> list[tuple[str, str, int]]:
    """``(function, call, line)`` of every reading call in ``path``."""
    found = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else func
            if isinstance(child, ast.Call):
                call = _call_name(child)
                if call is not None:
                    found.append((func, call, child.lineno))
            visit(child, name)

    visit(ast.parse(path.read_text(), str(path)), "<module>")
    return found


def test_runtime_reads_go_through_the_reading_module() -> None:
    bad, used = [], set()
    for path in SCOPE:
        if path == READING:
            continue
        rel = path.relative_to(PACKAGE).as_posix()
        for func, call, line in reads(path):
            if (rel, func, call) in ALLOWED:
                used.add((rel, func, call))
            else:
                bad.append(f"packer/{rel}:{line}: {call}() in {func}; read through packer/runtime/reading.py")
    assert not bad, "\n".join(bad)
    assert used == set(ALLOWED), f"stale allowlist entries: {sorted(set(ALLOWED) - used)}"


def test_the_rule_sees_every_kind_of_read(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import io, json, os\nfrom pathlib import Path\n"
                      "def f(p):\n    open(p); io.open(p); os.open(p, 0); Path(p).open(); json.load(p)\n"
                      "    json.loads(p); Path(p).read_bytes(); p.read_text()\n")
    assert [c for _, c, _ in reads(sample)] == ["open", "io.open", "os.open", ".open", "json.load", "json.loads",
                                                ".read_bytes", ".read_text"]
