"""The one way packer shows text that came from an input: visible escapes, never interpreted.

A tensor name, a pickle global, a zip member or a metadata value is chosen by whoever wrote
the file. Printed as is, ``ESC[2J`` clears the screen, ``ESC]0;...BEL`` sets the window
title, ``CR`` and ``LF`` forge whole lines (``note: file is safe``) and a lone surrogate
cannot even be encoded (``UnicodeEncodeError``). :func:`show` turns every character that is
not printable (C0 and C1 controls, DEL, lone surrogates, format characters such as the
right-to-left override, line and paragraph separators, private-use and unassigned code
points) into a backslash escape. Printable text (an ordinary path, a name in any script)
comes through unchanged; a backslash is kept as it is, so ``a\\x1b`` written into a name
reads the same as an escaped ESC, which is harmless: nothing is ever interpreted.

The CLI applies it to every line it prints and every string of its ``--json`` output
(:func:`show_json`), so a message built anywhere in the library is covered.

A command printed for the user to paste is the one place where an escape must also be read
back: :func:`shell_word` writes each of its arguments as the shell reads it, in characters
:func:`show` leaves alone, so the pasted command names exactly the path it was made for.
"""

from __future__ import annotations

import os
import shlex
from typing import Any

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    named = _NAMED.get(ch)
    if named is not None:
        return named
    cp = ord(ch)
    if cp < 0x100:
        return f"\\x{cp:02x}"
    if cp < 0x10000:
        return f"\\u{cp:04x}"
    return f"\\U{cp:08x}"


def show(text: str) -> str:
    """``text`` with every non-printable character written as a visible escape.

    Args:
        text: any string, lone surrogates included (``os.fsdecode`` and pickles make them).

    Returns:
        One line of printable characters that encodes to UTF-8: ``\\n``, ``\\r``, ``\\t``,
        ``\\xNN`` (other C0, DEL, C1), ``\\uNNNN`` or ``\\UNNNNNNNN`` for the rest (as
        :meth:`str.isprintable` decides; ASCII space is printable).
    """
    if text.isprintable():  # the common case, in C
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def show_json(value: Any) -> Any:
    """A copy of a JSON-able value with :func:`show` applied to every string and key.

    Args:
        value: dicts, lists, tuples, strings, numbers, booleans, None (what ``json.dumps``
            takes); tuples come back as lists.

    Returns:
        The same structure; its ``json.dumps`` is valid JSON whose strings hold no control
        character and no lone surrogate.
    """
    if isinstance(value, str):
        return show(value)
    if isinstance(value, dict):
        return {show(k) if isinstance(k, str) else k: show_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [show_json(v) for v in value]
    return value


def shell_word(text: str) -> str:
    """``text`` as one shell word that bash (ksh, zsh, POSIX.1-2024 sh) reads back exactly.

    Every argument of a command packer prints for the user to paste goes through here. Printed
    through :func:`show`, a newline that :func:`shlex.quote` kept inside single quotes would
    reach the terminal as the two characters ``\\n`` and the pasted command would name another
    path (a sibling named with a real backslash, say). So text holding anything :func:`show`
    escapes is written in ANSI-C quoting instead, with those characters as the ``\\xHH``
    escapes of their bytes; the result is printable and :func:`show` leaves it as it is.

    Args:
        text: any string; a file name's undecodable bytes (lone surrogates, as
            :func:`os.fsdecode` makes them) come back as those bytes.

    Returns:
        ``shlex.quote(text)`` when every character is printable, else ``$'...'`` where ``\\``
        and ``'`` are escaped with a backslash and every non-printable character is written
        as ``\\xHH`` per byte of its file-system encoding.
    """
    if text.isprintable():
        return shlex.quote(text)
    parts = []
    for ch in text:
        if ch in "\\'":
            parts.append("\\" + ch)
        elif ch.isprintable():
            parts.append(ch)
        else:
            parts.extend(f"\\x{b:02x}" for b in os.fsencode(ch))
    return "$'" + "".join(parts) + "'"
