"""Dockerfile text from structured values: every instruction packer writes is made here.

A value never reaches the Dockerfile by concatenation. Each function takes the values of one
instruction and writes them so that Docker's dockerfile frontend (BuildKit; buildah's and
podman's imagebuilder follow the same rules) reads back exactly those values, or raises
:class:`~packer.errors.ImageError` when the Dockerfile cannot say them. The rules relied on,
with the default escape character ``\\`` (packer writes no ``# escape=`` directive):

- A line break always ends a line, and a line ending in ``\\`` (blanks allowed after it)
  continues on the next; there is no escape for a line break in a word. A line whose first
  non-blank is ``#`` is a comment, dropped before continuations are joined.
- ENV and LABEL split ``key=value`` words at unquoted white space (Go's ``unicode.IsSpace``:
  NBSP and U+0085 too); WORKDIR and USER take the rest of the line. All of them then go
  through the shell lexer: ``'…'`` is literal, ``"…"`` is literal except ``$`` (expansion)
  and ``\\`` before ``"``, ``$`` or ``\\``; ``$NAME`` and ``${…}`` expand against the build's
  environment. So a value is written bare when it is plain (letters, digits, ``_./:@%+,-``),
  else double-quoted with ``\\``, ``"`` and ``$`` escaped; UTF-8 text is read as is.
- CMD and ENTRYPOINT given a JSON array of strings (the exec form) are decoded as JSON
  (Go's ``encoding/json``: every escape, ``\\uXXXX`` surrogate pairs included) and never
  expanded; anything else in that place would silently become the shell form.

What no word can hold: a line break (there is no escape for it), and by choice every other
character :func:`packer.util.show.show` escapes but tab (a lexer quirk drops a leading BOM, Go's
scanner complains about NUL). The exec form holds anything but NUL and lone surrogates. Docker
reads lines of up to 64 KiB; a longer one is refused too. A bare word never starts with ``-``
(the parser would take ``--x`` for a flag).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from packer.errors import ImageError
from packer.util.show import show

_PLAIN = re.compile(r"[A-Za-z0-9_./:@%+,-]+")  # nothing the splitter or the lexer treats specially
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LABEL_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_EXPANSION = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?[-+][^\"\\\n]*)?\}")
_WORD_EXTRA = frozenset("\t")
MAX_LINE_BYTES = 64 * 1024 - 1  # Go's bufio.Scanner default: a longer line fails the build


@dataclass(frozen=True)
class Expand:
    """A variable expansion packer means Docker to perform (``${PYTHONPATH:+:…}``), written as is."""

    text: str

    def __post_init__(self) -> None:
        if not _EXPANSION.fullmatch(self.text):
            raise ValueError(f"not a ${{NAME}} expansion: {self.text!r}")


def _shown(value: str, limit: int = 60) -> str:
    text = show(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _refuse(what: str, value: str) -> None:
    bad = next((ch for ch in value if not ch.isprintable() and ch not in _WORD_EXTRA), None)
    if bad is not None:
        raise ImageError(f"Dockerfile: {what} '{_shown(value)}' holds '{show(bad)}' (U+{ord(bad):04X}), "
                         "which a Dockerfile cannot say exactly")


def word(*parts: str | Expand, what: str = "value") -> str:
    """One lexer word (an ENV or LABEL value, a WORKDIR, a USER) that reads back as ``parts`` joined.

    Args:
        parts: literal text (reads back as is) and :class:`Expand` (left to Docker).
        what: what the value is, for the error message.

    Raises:
        ImageError: a literal holds a character a Dockerfile word cannot carry (see the module).
    """
    for part in parts:
        if isinstance(part, str):
            _refuse(what, part)
    plain = all(isinstance(p, Expand) or _PLAIN.fullmatch(p) for p in parts if p != "")
    first = parts[0] if parts else ""
    if plain and any(parts) and not (isinstance(first, str) and first.startswith("-")):  # not a --flag
        return "".join(p.text if isinstance(p, Expand) else p for p in parts)
    body = "".join(p.text if isinstance(p, Expand) else re.sub(r'([\\"$])', r"\\\1", p) for p in parts)
    return f'"{body}"'


def exec_form(args: Sequence[str], *, what: str = "command") -> str:
    """The JSON array Docker decodes back into ``args`` (CMD, ENTRYPOINT); printable ASCII and
    printable UTF-8 text as is, every other character as a JSON escape.

    Raises:
        ImageError: an argument holds NUL (no process argument can) or a lone surrogate (no
            UTF-8 either, so the image config could not hold it).
    """
    for arg in args:
        bad = next((ch for ch in arg if ch == "\0" or 0xD800 <= ord(ch) <= 0xDFFF), None)
        if bad is not None:
            raise ImageError(f"Dockerfile: {what} argument '{_shown(arg)}' holds '{show(bad)}', "
                             "which no process argument can hold")
    text = json.dumps(list(args), ensure_ascii=False)  # escapes '"', '\\' and C0 already
    return "".join(ch if ch.isprintable() else _json_escape(ch) for ch in text)


def _json_escape(ch: str) -> str:
    cp = ord(ch)
    if cp < 0x10000:
        return f"\\u{cp:04x}"
    cp -= 0x10000
    return f"\\u{0xD800 + (cp >> 10):04x}\\u{0xDC00 + (cp & 0x3FF):04x}"


def comment(text: str, limit: int = 1000) -> str:
    """A comment line for people to read (nothing reads a comment back): ``text`` with every
    non-printable character escaped, cut after ``limit`` characters (a long file list must not
    make a line Docker cannot read), never ending in the continuation character."""
    line = f"# {_shown(text, limit)}".rstrip()
    return line[:-1] + "\\x5c" if line.endswith("\\") else line


def env(name: str, *value: str | Expand) -> str:
    """``ENV name=value``: one variable, so its value expands against what came before.

    Raises:
        ImageError: ``name`` is not a variable name, or the value cannot be written.
    """
    if not _ENV_NAME.fullmatch(name):
        raise ImageError(f"Dockerfile: '{show(name)}' is not an environment variable name")
    return f"ENV {name}={word(*value, what=f'ENV {name}')}"


def label(pairs: Sequence[tuple[str, str]]) -> str:
    """``LABEL k="v" …``, one pair per line (joined by continuations).

    Raises:
        ImageError: a key that is not a plain label key, or a value that cannot be written.
    """
    items = []
    for key, value in pairs:
        if not _LABEL_KEY.fullmatch(key):
            raise ImageError(f"Dockerfile: '{show(key)}' is not a label key this writer quotes")
        items.append(f"{key}={word(value, what=f'LABEL {key}')}")
    return "LABEL " + " \\\n      ".join(items)


def instruction(keyword: str, *value: str | Expand) -> str:
    """``KEYWORD word`` for the one-word instructions: WORKDIR, USER, FROM.

    Raises:
        ImageError: the value cannot be written.
    """
    if keyword not in ("WORKDIR", "USER", "FROM"):
        raise ValueError(f"not a one-word instruction: {keyword!r}")
    return f"{keyword} {word(*value, what=keyword)}"


def arg(name: str, default: str) -> str:
    """``ARG name=default``.

    Raises:
        ImageError: ``name`` is not a variable name, or the default cannot be written.
    """
    if not _ENV_NAME.fullmatch(name):
        raise ImageError(f"Dockerfile: '{show(name)}' is not a build argument name")
    return f"ARG {name}={word(default, what=f'ARG {name}')}"


def add(src: str, dest: str) -> str:
    """``ADD src dest`` for packer's own tarball names (plain words only).

    Raises:
        ImageError: a path that is not a plain word.
    """
    for path in (src, dest):
        if not _PLAIN.fullmatch(path) or path.startswith("-"):
            raise ImageError(f"Dockerfile: ADD path '{show(path)}' is not a plain path")
    return f"ADD {src} {dest}"


def render(lines: Sequence[str]) -> bytes:
    """The Dockerfile's bytes: ``lines`` (each made by this module) joined, UTF-8.

    Raises:
        ImageError: a line longer than Docker's parser reads (64 KiB).
    """
    data = ("\n".join(lines) + "\n").encode()
    longest = max(map(len, data.split(b"\n")))
    if longest > MAX_LINE_BYTES:
        raise ImageError(f"Dockerfile: a line of {longest} bytes (an ENV value or a command?) is longer "
                         f"than Docker reads ({MAX_LINE_BYTES})")
    return data
