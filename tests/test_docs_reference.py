"""The reference pages in docs/reference/ against the code they describe.

Each test fails both ways: something the code has that its page does not name (a new option,
recipe key or environment variable documented nowhere), and something the page names that the
code does not have (a removed or misspelt one).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import click
import pytest

from packer import recipe as recipe_mod
from packer.cli import main
from packer.errors import RecipeError
from packer.runtime import settings

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "docs" / "reference"
COMMON = {"-q", "--quiet", "--json", "--debug", "-h", "--help"}


def _sections(text: str) -> dict[str, str]:
    """``{heading: body}`` of a page's ``## `` sections."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _first_column(body: str) -> set[str]:
    """The backticked names in the first cell of every table row of ``body``."""
    names: set[str] = set()
    for line in body.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            names |= set(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return names


# --- CLI -------------------------------------------------------------------------------------

def _options(cmd: click.Command) -> set[str]:
    return {o for p in cmd.params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)}


def test_cli_page_has_a_section_for_every_command_and_no_other() -> None:
    sections = _sections((REF / "cli.md").read_text())
    documented = {h.removeprefix("packer ") for h in sections if h.startswith("packer ")}
    assert isinstance(main, click.Group)
    assert documented == set(main.commands)


@pytest.mark.parametrize("name", sorted(main.commands) if isinstance(main, click.Group) else [])
def test_cli_options_documented_exactly(name: str) -> None:
    """Every option of ``packer NAME`` is in its table, and its table names no other; the
    options every command takes live in their own section."""
    assert isinstance(main, click.Group)
    cmd = main.commands[name]
    sections = _sections((REF / "cli.md").read_text())
    documented = {n for n in _first_column(sections[f"packer {name}"]) if n.startswith("-")}
    assert documented == _options(cmd) - COMMON
    common = {n for n in _first_column(sections["Options every command takes"]) if n.startswith("-")}
    assert (_options(cmd) | {"-h", "--help"}) & COMMON == common
    usage = sections[f"packer {name}"].split("\n\n", 2)[1]
    for arg in (p for p in cmd.params if isinstance(p, click.Argument)):
        assert arg.name is not None and arg.name.upper() in usage, f"packer {name}: argument {arg.name}"


# --- recipe ----------------------------------------------------------------------------------

def _recipe_keys() -> set[str]:
    keys: set[str] = set()
    for f in dataclasses.fields(recipe_mod.Recipe):
        if f.name == "base_dir":  # where the recipe lies, not a key
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            keys |= {f"{f.name}.{sub.name}" for sub in dataclasses.fields(default)}
        else:
            keys.add(f.name)
    return keys


def _documented_recipe_keys() -> set[str]:
    text = (REF / "recipe.md").read_text()
    table = text[text.index("| key | meaning | default |"):].split("\n\n", 1)[0]
    return _first_column(table)


def test_recipe_page_documents_every_key_and_no_other() -> None:
    assert _documented_recipe_keys() == _recipe_keys()


@pytest.mark.parametrize("key", sorted(_documented_recipe_keys()))
def test_every_documented_recipe_key_is_accepted_by_the_loader(key: str) -> None:
    """A documented key is one ``recipe_from_dict`` knows (its value may still be refused)."""
    raw: dict[str, object] = {"name": "m", "version": "1", "source": "demo"}
    section, _, sub = key.partition(".")
    raw[section] = {sub: object(), **({"engine": "vllm"} if section == "warm" else {})} if sub else object()
    try:
        recipe_mod.recipe_from_dict(raw)
    except RecipeError as e:
        assert "unknown key" not in str(e), e


# --- environment -----------------------------------------------------------------------------

def _code_env_names() -> set[str]:
    """Every environment variable name packer's code spells out, and the loader's knobs, which
    settings.py derives from its field names (``PACKER_<FIELD>``)."""
    names: set[str] = set()
    for path in (ROOT / "packer").rglob("*.py"):
        names |= set(re.findall(r"""["'](PACKER_[A-Z0-9_]+|SOURCE_DATE_EPOCH)["']""", path.read_text()))
    fields = set(settings.RuntimeSettings._fields) - set(settings._NO_ENV)
    return names | {f"PACKER_{f.upper()}" for f in fields}


def _dev_env_names() -> set[str]:
    names: set[str] = set()
    for path in [*(ROOT / "tests").rglob("*.py"), *(ROOT / ".ci").iterdir(), ROOT / "Makefile"]:
        if path.is_file() and path.name != Path(__file__).name:
            names |= set(re.findall(r"PACKER_[A-Z0-9_]+", path.read_text()))
    return names


def test_environment_page_documents_every_variable_the_code_reads() -> None:
    documented = _first_column((REF / "environment.md").read_text())
    assert _code_env_names() - documented == set()


def test_environment_page_documents_no_variable_nothing_reads() -> None:
    documented = {n for n in _first_column((REF / "environment.md").read_text()) if n.startswith("PACKER_")}
    assert documented - _code_env_names() - _dev_env_names() == set()


def test_the_readmes_python_functions_are_the_public_surface() -> None:
    """Every ``packer.NAME`` the README's Python paragraph names is in ``packer.__all__``, and every
    command it calls a function is one (the paragraph's claim, checked against the code)."""
    import packer

    text = (ROOT / "README.md").read_text()
    paragraph = text[text.index("From Python"):text.index("until one is used")]
    named = set(re.findall(r"`packer\.([A-Za-z_]+)", paragraph)) - {"__all__"}
    assert named and named <= set(packer.__all__), named - set(packer.__all__)
    assert all(callable(getattr(packer, n)) for n in named)


def test_the_readmes_python_paragraph_places_every_command() -> None:
    """The paragraph names each command once: as one library function (the list before "one function
    each") or as command-line only (the list before "command-line only"), so a new command is placed."""
    assert isinstance(main, click.Group)
    text = (ROOT / "README.md").read_text()
    paragraph = " ".join(text[text.index("From Python"):text.index("until one is used")].split())
    functions = set(re.findall(r"`([a-z-]+)`", paragraph[:paragraph.index("one function each")]))
    cli_only = paragraph[paragraph.index("one function each"):paragraph.index("command-line only")]
    only = set(re.findall(r"`([a-z-]+)`", cli_only[cli_only.rindex("("):]))
    assert not functions & only, functions & only
    assert functions | only == set(main.commands)


# --- keywords the pages give, against the real signatures -------------------------------------

_CALL = re.compile(r"\b(packer\.)?([A-Za-z_]+)\(([^()]*)\)")


def _signature_callables(page: str) -> dict[str, object]:
    """The functions a page's ``name(kw=...)`` may mean: the library's (``packer.__all__``), and on the
    loader's page the emitted loader's (its Build's methods and the runtime's module functions)."""
    import packer
    from packer.runtime import loader

    names: dict[str, object] = {n: getattr(packer, n) for n in packer.__all__ if callable(getattr(packer, n))}
    if page == "loader.md":
        names |= {n: getattr(loader.Build, n) for n in dir(loader.Build) if not n.startswith("_")}
        names |= {n: getattr(loader, n) for n in ("init_empty", "warmup", "report", "release_ring")}
    return names


def _keywords(fn: object) -> tuple[set[str], bool]:
    import inspect

    params = inspect.signature(fn).parameters.values()  # type: ignore[arg-type]
    return {p.name for p in params}, any(p.kind is p.VAR_KEYWORD for p in params)


def test_every_keyword_a_reference_page_gives_is_in_the_signature() -> None:
    """``build(layer_digests=False)``, ``load_into(model, device=...)``: each keyword a page passes to a
    library or loader function is a parameter of it (a renamed or removed one fails here)."""
    checked = 0
    for page in sorted(REF.glob("*.md")):
        callables = _signature_callables(page.name)
        for _, name, args in _CALL.findall(page.read_text()):
            fn = callables.get(name)
            if fn is None:
                continue  # another library's (torch.ones, transformers' from_pretrained)
            params, any_kw = _keywords(fn)
            for kw in re.findall(r"(?:^|,)\s*([A-Za-z_]+)\s*=", args):
                assert any_kw or kw in params, f"{page.name}: {name}({kw}=...) but {name} takes {sorted(params)}"
                checked += 1
    assert checked >= 10
