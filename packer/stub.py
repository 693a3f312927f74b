"""Emit ``packer_loader.py``: the runtime loader with the build's manifest embedded.

The runtime loader is a handful of small modules under ``packer/runtime/``;
:func:`packer.runtime_join.amalgamate` joins them into one self-contained module (and refuses
what would change meaning there). :func:`render` replaces the marked block in that text with
the canonical JSON of the embedded manifest and the source of the bundle reader (run at first
use of ``bundle_dir()``). Same inputs, same bytes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from packer.errors import StubError
from packer.formats import LOADER_NAME
from packer.fsutil import atomic_write_bytes, canonical_json, file_entry
from packer.runtime_join import RUNTIME, amalgamate
from packer.stage import StageOutput

BEGIN = "# >>> packer:embedded (replaced by packer.stub when the loader is emitted)\n"
END = "# <<< packer:embedded\n"
LINE = 88  # longest string literal line we write (ruff's limit is 100)


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
            and all(len(x) <= 100 and x == x.rstrip() for x in lines)):
        return "r'''\\\n" + source + ("" if source.endswith("\n") else "\n") + "'''"
    return "(\n" + "\n".join(_literal_lines(source)) + "\n)"


def render(embedded: dict[str, Any], *, loader_source: str | None = None,
           reader_source: str | None = None) -> tuple[bytes, str]:
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
             + "\n" + END)
    head, rest = template.split(BEGIN)
    _, tail = rest.split(END)
    name, version = str(embedded.get("name", "")), str(embedded.get("version", ""))
    banner = "#!/usr/bin/env python3\n" + f"# Emitted by packer for {ascii(name)} {ascii(version)}; do not edit.\n"
    return (banner + head + block + tail).encode(), hashlib.sha256(data).hexdigest()


def emit_loader(out_dir: Path, embedded: dict[str, Any], *,
                rel_root: Path | None = None) -> StageOutput:
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
                       bytes_processed=len(body))
