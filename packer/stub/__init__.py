"""Emit ``packer_loader.py`` and the runtime it imports: this build's loader, readable where it runs.

The runtime is the ``packer/runtime/`` package, shipped byte for byte into
``OUT/packer_runtime/`` (names, docstrings and line numbers kept, so a traceback in a serving
container names real files and lines). Beside it, :func:`render` writes a short stub from
``stub/template.py``: the marked block becomes the canonical JSON of the embedded manifest and
the sha256 of every runtime file, which the stub checks before it imports any of them,
relative to its own location. Same inputs, same bytes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from packer.errors import StubError
from packer.hashing import file_entry
from packer.stage import StageOutput
from packer.util.formats import LOADER_NAME
from packer.util.fsutil import atomic_write_bytes, canonical_json

RUNTIME = Path(__file__).parent.parent / "runtime"  # the package shipped as the loader's runtime
RUNTIME_DIR = "packer_runtime"  # its directory in OUT and the image: not `packer`, never shadowed
TEMPLATE = Path(__file__).parent / "template.py"
BEGIN = "# >>> packer:embedded (replaced by packer.stub when the loader is emitted)\n"
END = "# <<< packer:embedded\n"


def _escape(ch: str) -> str:
    o = ord(ch)
    if ch in "\\'":
        return "\\" + ch
    if 32 <= o < 127:
        return ch
    return f"\\x{o:02x}" if o < 256 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


_RECORD = 6  # an object of at most this many plain members is one entry: one line


def _json(v: Any) -> str:
    return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _plain(v: Any) -> bool:
    """A scalar, or a list of scalars (a shape, a pair of offsets)."""
    return not isinstance(v, dict | list) or (isinstance(v, list) and not any(isinstance(x, dict | list) for x in v))


def _entry_lines(v: Any) -> list[str]:
    """Canonical JSON of ``v`` cut into lines between entries, never inside one: an object of
    objects (or a long one) gets a line per member, a record (a few plain members: a file's
    size and sha256, a tensor's dtype, shape and offsets) stays whole with its key, so
    ``grep <sha256> packer_loader.py`` finds the file's line."""
    if not isinstance(v, dict | list) or not v:
        return [_json(v)]
    if len(v) <= _RECORD and all(map(_plain, v.values() if isinstance(v, dict) else v)):
        return [_json(v)]
    members = ([[_json(k) + ":" + first, *rest] for k, (first, *rest) in
                ((k, _entry_lines(x)) for k, x in sorted(v.items()))] if isinstance(v, dict)
               else [_entry_lines(x) for x in v])
    lines: list[str] = []
    for i, m in enumerate(members):
        lines += [*m[:-1], m[-1] + ("," if i < len(members) - 1 else "")]
    open_, close = "{}" if isinstance(v, dict) else "[]"
    lines[0] = open_ + lines[0]
    lines[-1] += close  # the same line when there is one
    return lines


def _manifest_literal(embedded: dict[str, Any], data: bytes) -> list[str]:
    """The embedded manifest as adjacent literals, one entry a line (a line over ruff's 120
    columns says ``noqa: E501``: an entry is never cut); joined they are exactly ``data``."""
    lines = _entry_lines(embedded)
    if "".join(lines) != data.decode().rstrip("\n"):
        raise StubError("the embedded manifest does not render back to its canonical JSON")
    out = []
    for line in lines:
        text = "    '" + "".join(map(_escape, line)) + "'"
        out.append(text + "  # noqa: E501" if len(text) > 120 else text)
    return out


def runtime_files(runtime: Path = RUNTIME) -> dict[str, bytes]:
    """The runtime's files by their path under ``RUNTIME_DIR``: every ``*.py`` of the package.

    Raises:
        StubError: the package is missing or has no ``__init__.py``.
    """
    if not (runtime / "__init__.py").is_file():
        raise StubError(f"{runtime}: the loader's runtime package is missing (no __init__.py)")
    paths = sorted(p for p in runtime.rglob("*.py") if "__pycache__" not in p.parts)
    return {p.relative_to(runtime).as_posix(): p.read_bytes() for p in paths}


def render(embedded: dict[str, Any], runtime: dict[str, bytes], *,
           template: str | None = None) -> tuple[bytes, str]:
    """Render the stub for ``embedded`` and the ``runtime`` files it is to import.

    Args:
        embedded: the manifest the loader pins (JSON-able).
        runtime: the runtime files by their path under ``RUNTIME_DIR`` (see :func:`runtime_files`).
        template: the stub's source (default: ``stub/template.py``).

    Returns:
        ``(file bytes, sha256 of the canonical embedded JSON)``.

    Raises:
        StubError: the template lacks its marked block or has it twice.
    """
    text = template if template is not None else TEMPLATE.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise StubError(f"{TEMPLATE}: the '# >>> packer:embedded' block is missing or repeated")
    data = canonical_json(embedded)
    digests = "".join(f"    {ascii(rel)}: '{hashlib.sha256(body).hexdigest()}',\n"
                      for rel, body in sorted(runtime.items()))
    block = (BEGIN + "_MANIFEST_JSON = (\n" + "\n".join(_manifest_literal(embedded, data))
             + f"\n)\n_RUNTIME_DIR = {RUNTIME_DIR!r}\n_RUNTIME_SHA256: dict[str, str] = {{\n{digests}}}\n" + END)
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    name, version = str(embedded.get("name", "")), str(embedded.get("version", ""))
    banner = "#!/usr/bin/env python3\n" + f"# Emitted by packer for {ascii(name)} {ascii(version)}; do not edit.\n"
    return (banner + head + block + tail).encode(), hashlib.sha256(data).hexdigest()


def planned_files() -> list[str]:
    """The paths :func:`emit_loader` writes, relative to OUT: the stub first, then its runtime."""
    return [LOADER_NAME, *(f"{RUNTIME_DIR}/{rel}" for rel in runtime_files())]


def emit_loader(out_dir: Path, embedded: dict[str, Any], *,
                rel_root: Path | None = None) -> StageOutput:
    """Write ``out_dir/packer_loader.py`` and ``out_dir/packer_runtime/`` atomically, file by file.

    Args:
        out_dir: the build's output (staging) directory.
        embedded: the manifest to embed (files, weights, bundle, runtime).
        rel_root: directory the returned file entries are relative to (default ``out_dir``).

    Returns:
        the stage output: the stub, then every runtime file; section ``{"file", "runtime",
        "embedded_sha256"}``.

    Raises:
        StubError: the runtime package or the template is missing or broken.
    """
    out_dir = Path(out_dir)
    runtime = runtime_files()
    body, digest = render(embedded, runtime)
    try:
        compile(body, LOADER_NAME, "exec")
    except SyntaxError as e:
        raise StubError(f"{LOADER_NAME}: the rendered loader does not compile: {e}") from e
    targets = [out_dir / LOADER_NAME]
    for rel, data in runtime.items():
        targets.append(out_dir / RUNTIME_DIR / rel)
        targets[-1].parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(targets[-1], data)
    atomic_write_bytes(targets[0], body, mode=0o777)  # last: a stub never names files not yet there
    root = Path(rel_root) if rel_root else out_dir
    return StageOutput(files=tuple(file_entry(root, t) for t in targets),
                       section={"file": LOADER_NAME, "runtime": RUNTIME_DIR, "embedded_sha256": digest},
                       bytes_processed=len(body) + sum(map(len, runtime.values())))
