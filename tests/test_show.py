"""Input text reaches the terminal escaped, on every printing path of the real CLI.

Each escape kind (an ESC sequence that hides text, an OSC window title, CR, LF forging a
``note:`` line, a C1 CSI, DEL, a right-to-left override, a lone surrogate) rides in a pickle
global name, a zip member name, tensor and entry names and safetensors metadata; each file goes
through errors (in process and through the sandboxed child, with and without ``--debug``),
notes, ``inspect`` listings and ``--json``. The bytes printed must be UTF-8 with no control
character but the line ends packer writes, no forged line, and JSON that parses with no
control character or lone surrogate in any string.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from packer.util.show import shell_word, show, show_json
from tests.ckpt_factory import FakeStorage, Member, simple_tensor_dict, tensor_pickle, torch_zip

KINDS = {"esc": "\x1b[8m", "osc": "\x1b]0;pwned\x07", "cr": "\r", "lf": "\nnote: file is safe",
         "c1": "\x9b2J", "del": "\x7f", "bidi": "\u202e", "surrogate": "\ud800"}
HOSTILE = "".join(KINDS.values())
ENCODABLE = HOSTILE.replace(KINDS["surrogate"], "")  # what a zip name or safetensors header can hold


@pytest.mark.parametrize(("text", "shown"), [
    ("\x1b[8m", "\\x1b[8m"), ("\x1b]0;t\x07", "\\x1b]0;t\\x07"), ("a\rb\nc\td", "a\\rb\\nc\\td"),
    ("\x9b\x7f\x00", "\\x9b\\x7f\\x00"), ("\u202e\u2028", "\\u202e\\u2028"), ("\ud800\udcff", "\\ud800\\udcff"),
    ("\U000e0001", "\\U000e0001"),
    ("model.layers.0/weight ünïcode 名前 a b", "model.layers.0/weight ünïcode 名前 a b"),  # printable: as is
])
def test_show_escapes_every_non_printable_and_nothing_else(text: str, shown: str) -> None:
    assert show(text) == shown
    assert show(text).isprintable() and show(text).encode("utf-8")


WORDS = ["", "plain", "a b", "it's", "$HOME `id` \"q\" \\ !x *", "a\nb", "tab\there", "\x1b[2J", "\x7f\x9b",
         "no\u00a0break\u2003em\u3000ideo", "\u202eevil", "\udcff\udc80bytes", "\\x41 \\n'", "\nab9f", "ünïcode 名前",
         "-rf", "~root", "a=b", "\u2028sep"]


@pytest.mark.parametrize("text", WORDS, ids=range(len(WORDS)))
def test_shell_word_is_read_back_by_bash_as_the_text_and_survives_show(text: str) -> None:
    """What the user pastes is what show printed: bash must read it back as exactly ``text``."""
    word = shell_word(text)
    assert show(word) == word  # printed as is: nothing for show to escape
    r = subprocess.run(["bash", "-c", f"printf '%s' {word}"], capture_output=True, check=True)
    assert r.stdout == os.fsencode(text)
    if text.isprintable():
        assert word == shlex.quote(text)


def test_show_json_escapes_keys_and_nested_strings() -> None:
    value = {"a\x1b": ["\ud800", {"k\n": "v\r"}], "n": 1, "t": ("\x07",), "none": None}
    shown = show_json(value)
    assert shown == {"a\\x1b": ["\\ud800", {"k\\n": "v\\r"}], "n": 1, "t": ["\\x07"], "none": None}
    json.loads(json.dumps(shown, ensure_ascii=False).encode("utf-8"))


# -- fixtures: one file per place a name can come from -------------------------------------


def _short_unicode(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return b"\x8c" + bytes([len(raw)]) + raw


def global_file(path: Path) -> Path:
    """A torch zip whose pickle names the global ``<HOSTILE>.<HOSTILE>`` (STACK_GLOBAL)."""
    pkl = b"\x80\x04" + _short_unicode(f"os{HOSTILE}") + _short_unicode(f"system{HOSTILE}") + b"\x93."
    path.write_bytes(torch_zip(pkl, {}))
    return path


def zip_name_file(path: Path) -> Path:
    """A torch zip with an extra member whose name carries every encodable kind."""
    good = tensor_pickle(simple_tensor_dict(FakeStorage("0", 4)))
    path.write_bytes(torch_zip(good, {"0": bytes(16)}, extra=[Member(f"archive/x{ENCODABLE}", b"x")]))
    return path


def names_file(path: Path, *, text: str) -> Path:
    """A valid checkpoint: a tensor, a non-tensor entry and a placeholder named with ``text``."""
    torch.save({f"t{text}": torch.ones(2), f"skip{text}": 3, f"ph{HOSTILE}": argparse.Namespace(a=1)}, path)
    return path


def metadata_file(path: Path) -> Path:
    save_file({f"t{ENCODABLE}": torch.ones(2)}, str(path), metadata={f"k{ENCODABLE}": f"v{ENCODABLE}"})
    return path


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _packer(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "packer", *args], capture_output=True, cwd=tmp_path,
                          timeout=300, check=False)


def assert_inert(raw: bytes) -> str:
    """The printed bytes: UTF-8 (a raw lone surrogate cannot be encoded), no control character
    but packer's own line ends, no forged line; returns the text."""
    text = raw.decode("utf-8")
    bad = sorted({c for c in text if c != "\n" and not c.isprintable()})
    assert not bad, (bad, text[-2000:])
    assert not [line for line in text.splitlines() if line.startswith("note: file is safe")], text
    return text


# (fixture, command, kind of output): error -> one line on stderr; listing -> stdout; json -> stdout
PATHS = [
    ("global", "inspect", "error"), ("global", "convert", "error"), ("global", "convert --no-sandbox", "error"),
    ("global", "convert --no-sandbox --debug", "debug"), ("global", "build", "error"),
    ("zip", "inspect", "error"), ("zip", "convert", "error"),
    ("names", "inspect", "listing"), ("names", "inspect --json", "json"),
    ("names", "convert --no-sandbox", "error"),  # the tensor name holds a lone surrogate
    ("names", "convert", "error"), ("names", "convert --json", "error"),
    ("names-utf8", "convert", "listing"), ("names-utf8", "convert --json", "json"),
    ("metadata", "inspect", "listing"), ("metadata", "inspect --json", "json"),
]
FIXTURES = {"global": global_file, "zip": zip_name_file, "metadata": metadata_file,
            "names": lambda p: names_file(p, text=HOSTILE), "names-utf8": lambda p: names_file(p, text=ENCODABLE)}


@pytest.mark.parametrize(("fixture", "command", "output"), PATHS)
def test_every_escape_kind_is_shown_escaped_on_every_printing_path(tmp_path: Path, fixture: str, command: str,
                                                                   output: str) -> None:
    src = tmp_path / "in"
    src.mkdir()
    path = FIXTURES[fixture](src / ("model.safetensors" if fixture == "metadata" else "pytorch_model.bin"))
    args = command.split()
    if args[0] == "build":
        (tmp_path / "r.toml").write_text(f'name = "x"\nversion = "1"\nsource = "{src}"\n')
        args += [str(tmp_path / "r.toml"), "-o", str(tmp_path / "out")]
    else:
        args.append(str(path))
        if args[0] == "convert":
            args += ["-o", str(tmp_path / "out")]
    proc = _packer(tmp_path, *args)
    out, err = assert_inert(proc.stdout), assert_inert(proc.stderr)
    if output in ("error", "debug"):
        assert proc.returncode == 1, err
        lines = err.strip().splitlines()
        assert lines[-1].startswith("error: ") and "Traceback" not in lines[-1]
        assert len(lines) == 1 or (output == "debug" and "Traceback" in err), err
        assert "\\x1b" in lines[-1] or "not valid UTF-8" in lines[-1], lines[-1]  # shown, not dropped
        return
    assert proc.returncode == 0, err
    if output == "json":
        summary = json.loads(out)
        strings = _strings(summary)
        assert all(s.isprintable() for s in strings), [s for s in strings if not s.isprintable()]
        assert any("\\x1b]0;pwned\\x07" in s for s in strings)
    else:
        assert "\\x1b]0;pwned\\x07" in out + err
