"""One way in: no module reads an input's bytes except through its side's reading module.

The source is read with ``ast`` (nothing is imported), like tests/test_layers.py. A raw read is
a call that opens or parses bytes by itself: ``open()``, ``io.open``, ``os.open`` with flags
that read, ``Path.open`` (any ``.open(...)`` method but the bundle reader's), ``json.load(s)``,
``.read_bytes()``, ``.read_text()``, ``mmap.mmap``, ``shutil.copy*`` of a path, the
safetensors library's ``safe_open`` and numpy's ``fromfile``/``memmap``. Each side's reading
module is where they live; :data:`ALLOWED` is the short, reviewed list of the others, each
with its reason (packer's own outputs and installed files, never an input).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "packer"

# (file relative to the repository, call as raw_reads names it) -> why it is not an input read
ALLOWED: dict[tuple[str, str], str] = {
    ("packer/stub/__init__.py", ".read_bytes()"):
        "the runtime package's own installed sources, shipped verbatim into OUT",
    ("packer/stub/__init__.py", ".read_text()"): "the stub template, packer's own installed source",
    ("packer/weights/writer.py", "os.open"): "re-reads the shard this writer just created with O_EXCL",
    ("packer/weights/verify.py", "safe_open"): "the safetensors library opens the path itself, after "
                                               "reading.check_regular refused anything but a regular file",
    ("packer/filetree.py", "open"): "link_or_copy's copy target, created exclusively ('xb'): a write",
}

_READ_FLAGS_ONLY_IF_ABSENT = {"O_WRONLY"}  # os.open without O_WRONLY (or with O_RDWR) reads
_NO_BYTES = {"O_DIRECTORY"}  # a directory descriptor (to fsync it) yields no bytes
_METHODS = {"read_bytes", "read_text"}
_MODULE_CALLS = {("json", "load"), ("json", "loads"), ("io", "open"), ("mmap", "mmap"), ("shutil", "copyfile"),
                 ("shutil", "copy"), ("shutil", "copy2"), ("np", "fromfile"), ("np", "memmap"),
                 ("numpy", "fromfile"), ("numpy", "memmap")}


def _flag_names(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)} | {
        n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _os_open_reads(call: ast.Call) -> bool:
    if len(call.args) < 2:
        return True
    names = _flag_names(call.args[1])
    if names & _NO_BYTES:
        return False
    return "O_RDWR" in names or not names & _READ_FLAGS_ONLY_IF_ABSENT


def _call_name(call: ast.Call) -> str | None:
    """How :func:`raw_reads` names ``call`` when it is a raw read, else None."""
    fn = call.func
    if isinstance(fn, ast.Name):
        return fn.id if fn.id in ("open", "safe_open") else None
    if not isinstance(fn, ast.Attribute):
        return None
    base = fn.value.id if isinstance(fn.value, ast.Name) else None
    if fn.attr in _METHODS:
        return f".{fn.attr}()"
    if base == "os" and fn.attr == "open":
        return "os.open" if _os_open_reads(call) else None
    if (base, fn.attr) in _MODULE_CALLS:
        return f"{base}.{fn.attr}"
    if fn.attr == "open" and not (isinstance(fn.value, ast.Attribute) and fn.value.attr == "Bundle") \
            and base != "Bundle":
        return ".open()"  # Path.open, tarfile.open, gzip.open...: the bundle reader checks its own input
    return None


def raw_reads(paths: list[Path], root: Path = ROOT) -> list[tuple[str, int, str]]:
    """``(file relative to root, line, call)`` of every raw read in the Python files ``paths``."""
    found = []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and (name := _call_name(node)):
                found.append((rel, node.lineno, name))
    return sorted(found)


# what runs in the serving container (the stub, the runtime, the engine adapters) reads through the
# runtime's own reading module: its side of the rule
RUNTIME_SIDE = (PACKAGE / "runtime", PACKAGE / "adapters", PACKAGE / "stub" / "template.py")


def _build_side() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if not any(p.is_relative_to(s) for s in RUNTIME_SIDE)]


# (side, its files, its reading module)
SIDES = [("build", _build_side, "packer/reading.py")]


@pytest.mark.parametrize(("side", "files", "reading"), SIDES, ids=[s[0] for s in SIDES])
def test_every_read_goes_through_the_reading_module(side: str, files: object, reading: str) -> None:
    assert callable(files)
    found = [(f, line, call) for f, line, call in raw_reads(files())
             if f != reading and (f, call) not in ALLOWED]
    assert not found, (f"{side} side: raw reads outside {reading} (route them through it, or add a reviewed "
                       f"entry with its reason to ALLOWED): " + "; ".join(f"{f}:{n}: {c}" for f, n, c in found))


def test_the_allowlist_is_short_and_current() -> None:
    assert len(ALLOWED) <= 8
    present = {(f, call) for f, _, call in raw_reads(sorted(PACKAGE.rglob("*.py")))}
    stale = sorted(set(ALLOWED) - present)
    assert not stale, f"ALLOWED names reads that no longer exist: {stale}"
    assert all(reason.strip() for reason in ALLOWED.values())


def test_the_scanner_sees_each_kind_of_read(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "import io, json, mmap, os, shutil\nfrom pathlib import Path\n"
        "open('a')\nio.open('a')\nos.open('a', os.O_RDONLY)\nos.open('a', os.O_RDWR | os.O_CREAT)\n"
        "json.load(f)\njson.loads(b'')\nPath('a').read_bytes()\nPath('a').read_text()\nPath('a').open()\n"
        "mmap.mmap(3, 0)\nshutil.copyfile('a', 'b')\nsafe_open('a', framework='np')\n"
        # not reads: a write-only open, a directory descriptor, the bundle reader's own entry
        "os.open('a', os.O_WRONLY | os.O_CREAT)\nos.open('d', os.O_RDONLY | os.O_DIRECTORY)\n"
        "reader.Bundle.open('b')\n")
    calls = [call for _, _, call in raw_reads([src], tmp_path)]
    assert calls == ["open", "io.open", "os.open", "os.open", "json.load", "json.loads", ".read_bytes()",
                     ".read_text()", ".open()", "mmap.mmap", "shutil.copyfile", "safe_open"]
