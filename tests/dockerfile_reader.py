"""Read a Dockerfile back the way Docker's dockerfile frontend does, for the tests.

Written from BuildKit's documented and observable rules, independently of
``packer.oci.dockerfile_syntax`` (a reader that shared the writer's code would agree with any
mistake in it): physical lines split at ``\\n`` (a ``\\r`` before it dropped), comment lines
(``#`` as the first non-blank) dropped, a line ending in the escape character and blanks joined
with the next; the instruction word split off at the first run of blanks; ENV and LABEL split
into ``key=value`` words at unquoted white space (quotes and escapes kept for the lexer);
the shell lexer: ``'…'`` literal, ``"…"`` literal but for ``$`` and ``\\"`` ``\\$`` ``\\\\``,
``\\x`` outside quotes is ``x``, ``$NAME`` / ``${NAME}`` / ``${NAME:-w}`` / ``${NAME-w}`` /
``${NAME:+w}`` / ``${NAME+w}`` expanded against the environment so far; CMD and ENTRYPOINT
as JSON arrays of strings; WORKDIR cleaned like Go's ``path.Clean``.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Mapping
from typing import Any

ESCAPE = "\\"
MAX_LINE_BYTES = 65535  # bufio.MaxScanTokenSize - 1
_CONTINUES = re.compile(r"\\[ \t]*$")
_SPLIT = re.compile(r"[\t\v\f\r ]+")
_GO_SPACE = frozenset("\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | frozenset(
    chr(c) for c in range(0x2000, 0x200B))


class ReadError(ValueError):
    """The Dockerfile is not what Docker would read without complaint."""


def instructions(text: str) -> list[tuple[str, str]]:
    """``[(KEYWORD, rest of the logical line)]`` in file order."""
    out: list[tuple[str, str]] = []
    current: str | None = None
    for raw in text.split("\n"):
        if len(raw.encode()) > MAX_LINE_BYTES:
            raise ReadError(f"a line of {len(raw.encode())} bytes: longer than Go's scanner reads")
        line = raw[:-1] if raw.endswith("\r") else raw
        bare = line.lstrip("".join(_GO_SPACE))
        if bare.startswith("#") or (current is not None and not bare.strip()):
            continue  # a comment, or an empty line inside a continuation
        if current is None:
            if not bare.strip():
                continue
            line, current = bare, ""
        m = _CONTINUES.search(line)
        if m:
            current += line[: m.start()]
            continue
        out.append(_split(current + line))
        current = None
    if current is not None:
        out.append(_split(current))
    return out


def _split(line: str) -> tuple[str, str]:
    parts = _SPLIT.split(line.strip(), maxsplit=1)
    return parts[0].upper(), parts[1] if len(parts) > 1 else ""


def words(rest: str) -> list[str]:
    """Split ENV/LABEL arguments at unquoted white space, quotes and escapes kept."""
    out, word, quote, in_word, blank_ok = [], "", "", False, False
    i = 0
    while i < len(rest):
        ch = rest[i]
        if quote:
            if ch == quote:
                quote = ""
            elif ch == ESCAPE and quote == '"' and i + 1 < len(rest):
                word += ch
                i += 1
                ch = rest[i]
            word += ch
        elif ch in _GO_SPACE:
            if in_word and (word or blank_ok):
                out.append(word)
            word, in_word, blank_ok = "", False, False
        else:
            in_word = True
            if ch in "'\"":
                quote, blank_ok = ch, True
            elif ch == ESCAPE:
                if i + 1 == len(rest):
                    break
                word += ch
                i += 1
                ch = rest[i]
            word += ch
        i += 1
    if in_word and (word or blank_ok):
        out.append(word)
    return out


class _Lexer:
    def __init__(self, text: str, env: Mapping[str, str]) -> None:
        self.text, self.pos, self.env = text, 0, env

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def take(self) -> str:
        ch = self.peek()
        self.pos += 1
        return ch

    def until(self, stop: str = "") -> str:
        out = []
        while self.peek():
            ch = self.peek()
            if stop and ch == stop:
                self.take()
                return "".join(out)
            if ch == "$":
                out.append(self.dollar())
            elif ch == "'":
                self.take()
                start = self.pos
                end = self.text.find("'", start)
                if end < 0:
                    raise ReadError(f"unterminated single quote in {self.text!r}")
                out.append(self.text[start:end])
                self.pos = end + 1
            elif ch == '"':
                out.append(self.double())
            else:
                self.take()
                if ch == ESCAPE:
                    ch = self.take()
                out.append(ch)
        if stop:
            raise ReadError(f"missing {stop!r} in {self.text!r}")
        return "".join(out)

    def double(self) -> str:
        self.take()
        out = []
        while True:
            ch = self.peek()
            if not ch:
                raise ReadError(f"unterminated double quote in {self.text!r}")
            if ch == '"':
                self.take()
                return "".join(out)
            if ch == "$":
                out.append(self.dollar())
                continue
            self.take()
            if ch == ESCAPE and self.peek() in ('"', "$", ESCAPE) and self.peek():
                ch = self.take()
            out.append(ch)

    def name(self) -> str:
        start = self.pos
        while self.peek() and (self.peek().isalnum() or self.peek() == "_"):
            self.take()
        return self.text[start:self.pos]

    def dollar(self) -> str:
        self.take()
        if self.peek() != "{":
            name = self.name()
            return self.env.get(name, "") if name else "$"
        self.take()
        name = self.name()
        op = self.take()
        if op == "}":
            return self.env.get(name, "")
        null_unset = op == ":"
        if null_unset:
            op = self.take()
        if not name or op not in "-+" or not op:
            raise ReadError(f"unsupported substitution in {self.text!r}")
        alt = self.until("}")
        value = self.env.get(name)
        unset = value is None or (null_unset and value == "")
        if op == "-":
            return alt if unset else str(value)
        return "" if unset else alt


def lex(text: str, env: Mapping[str, str]) -> str:
    """One word after quote removal and variable expansion."""
    return _Lexer(text, env).until()


def _exec_form(rest: str) -> list[str]:
    rest = rest.lstrip()
    if not rest.startswith("["):
        raise ReadError(f"not the exec form: {rest!r}")
    value = json.loads(rest)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ReadError(f"not a JSON array of strings: {rest!r}")
    return value


def _pairs(rest: str, env: Mapping[str, str]) -> list[tuple[str, str]]:
    out = []
    for w in words(rest):
        key, sep, value = w.partition("=")
        if not sep:
            raise ReadError(f"no '=' in {w!r}")
        out.append((lex(key, env), lex(value, env)))
    return out


def run_config(text: str, base: Mapping[str, Any]) -> dict[str, Any]:
    """What building ``text`` onto a base whose config is ``base`` sets: Env (as a dict),
    Labels, WorkingDir, User, Entrypoint and Cmd (absent keys left out)."""
    env = {k: v for k, _, v in (e.partition("=") for e in base.get("Env") or [])}
    cfg: dict[str, Any] = {k: v for k, v in base.items() if k not in ("Env",)}
    labels = dict(base.get("Labels") or {})
    cmd_here = False
    for keyword, rest in instructions(text):
        if keyword == "ENV":
            for key, value in _pairs(rest, env):
                env[key] = value
        elif keyword == "LABEL":
            labels.update(_pairs(rest, env))
        elif keyword == "WORKDIR":
            path = lex(rest.strip(), env)
            cfg["WorkingDir"] = posixpath.normpath(posixpath.join(cfg.get("WorkingDir") or "/", path))
        elif keyword == "USER":
            cfg["User"] = lex(rest.strip(), env)
        elif keyword == "ENTRYPOINT":
            cfg["Entrypoint"] = _exec_form(rest)
            if not cmd_here:
                cfg.pop("Cmd", None)  # setting ENTRYPOINT drops a CMD inherited from the base
        elif keyword == "CMD":
            cfg["Cmd"], cmd_here = _exec_form(rest), True
        elif keyword not in ("ARG", "FROM", "ADD"):
            raise ReadError(f"unexpected instruction {keyword}")
    cfg["Env"] = env
    if labels:
        cfg["Labels"] = labels
    return cfg
