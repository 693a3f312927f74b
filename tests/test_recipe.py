"""Recipe loading and validation: every error names the key path or the TOML line."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from packer.errors import RecipeError
from packer.recipe import (
    Rename,
    demo_recipe,
    load_recipe,
    parse_size,
    recipe_from_dict,
    recipe_from_options,
    weights_from_options,
)

REPO = Path(__file__).resolve().parents[1]
BASE = {"name": "m", "version": "1", "source": "demo"}


def test_shipped_recipes_load() -> None:
    demo = load_recipe(REPO / "recipes" / "demo.toml")
    assert demo.source == "demo"
    assert demo.normalised() == demo_recipe().normalised()  # `packer build` == demo.toml
    hf = load_recipe(REPO / "recipes" / "hf-model.toml")
    assert hf.source.startswith("hf://") and hf.weights.max_shard_size == 2 * 10**9
    assert hf.image.owner == "1000:0" and hf.image.env == (("HF_HUB_OFFLINE", "1"),)
    assert hf.image.base_name == "registry.example.com/team/serving:1.0"
    # no rule that renames a published model's names, no file list that needs a shard index
    assert hf.weights.renames == () and hf.weights.files == ()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"weights": {"max_shard_size": 12}}, 'weights.max_shard_size: expected a size like "5GB", got 12'),
        ({"weights": {"max_shard_sise": "5GB"}}, "weights.max_shard_sise: unknown key"),
        ({"colour": "red"}, "colour: unknown key"),
        ({"weights": {"dtyp": "float16"}}, "weights.dtyp: unknown key (allowed: allow_globals, chunk_size, "
         "components, dtype, exclude, files, include, key, layout, leave_out, max_expansion, max_shard_size, "
         "renames, strip_prefixes, tie_prefer, variants); did you mean 'dtype'?"),
        ({"weight": {"dtype": "float16"}}, "weight: unknown key (allowed: bundle, image, name, runtime, sign, "
         "source, version, warm, weights); did you mean 'weights'?"),
        ({"weights": {"dtype": "fp8"}}, "weights.dtype: expected one of"),
        ({"weights": {"renames": [{"pattern": "(", "replace": "x"}]}}, "weights.renames[0].pattern: invalid regular"),
        ({"weights": {"strip_prefixes": "module."}}, "weights.strip_prefixes: expected a list of non-empty strings"),
        ({"image": {"compression": "xz"}}, "image.compression: expected one of 'gzip', 'zstd', 'none'"),
        ({"image": {"owner": "root"}}, 'image.owner: expected a numeric "uid:gid"'),
        ({"image": {"base": "docker://x"}}, 'image.base: expected an OCI layout reference'),
        ({"image": {"prefix": "opt/model"}}, "image.prefix: expected an absolute path"),
        ({"image": {"single_layer": "yes"}}, "image.single_layer: expected true or false"),
        ({"image": {"base_name": "/srv/layouts/base"}}, "image.base_name: expected a registry reference"),
        ({"image": {"base_name": "debian:12"}}, "image.base_name: expected a registry reference"),
        ({"image": {"cmd": "python3 serve.py"}}, "image.cmd: expected a list of strings"),
        ({"image": {"env": {"A-B": "1"}}}, "image.env.A-B: expected a variable name"),
        ({"image": {"env": {"A": 1}}}, "image.env.A: expected a variable name"),
        ({"image": {"user": "root;x"}}, "image.user: expected a user"),
        ({"image": {"workdir": "srv"}}, "image.workdir: expected an absolute path"),
        ({"image": {"platform": "amd64"}}, "image.platform: expected a platform"),
        ({"runtime": {"warmup": [{"name": "x", "shape": [1, -2]}]}},
         "runtime.warmup[0].shape: expected a list of positive"),
        ({"runtime": {"warmup": [{"shape": [1]}]}}, "runtime.warmup[0]: expected a table with"),
        ({"bundle": []}, "bundle: expected a table"),
        ({"name": ""}, "name: expected a non-empty string"),
    ],
)
def test_invalid_values_name_the_key(raw: dict, message: str) -> None:
    with pytest.raises(RecipeError) as e:
        recipe_from_dict({**BASE, **raw})
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("missing", ["name", "version", "source"])
def test_missing_required_key(missing: str) -> None:
    raw = {k: v for k, v in BASE.items() if k != missing}
    with pytest.raises(RecipeError, match=f"^{missing}: missing required key"):
        recipe_from_dict(raw)


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text('name = "x"\nversion = "1"\nsource = \n')
    with pytest.raises(RecipeError, match=r"bad\.toml: invalid TOML: .*line 3"):
        load_recipe(p)


def test_error_in_file_is_prefixed_with_path(tmp_path: Path) -> None:
    p = tmp_path / "r.toml"
    p.write_text('name = "x"\nversion = "1"\nsource = "demo"\n[weights]\ntypo = 1\n')
    with pytest.raises(RecipeError, match=r"r\.toml: weights\.typo: unknown key"):
        load_recipe(p)


def test_unreadable_recipe(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="cannot read recipe"):
        load_recipe(tmp_path / "absent.toml")


def test_relative_source_resolves_against_recipe_dir(tmp_path: Path) -> None:
    p = tmp_path / "r.toml"
    p.write_text('name = "x"\nversion = "1"\nsource = "model"\n')
    assert load_recipe(p).base_dir == tmp_path


@given(st.integers(min_value=1, max_value=10**6), st.sampled_from(["B", "KB", "MB", "GB", "MiB", "GiB"]))
def test_parse_size(n: int, unit: str) -> None:
    factor = {"B": 1, "KB": 1000, "MB": 10**6, "GB": 10**9, "MiB": 2**20, "GiB": 2**30}[unit]
    assert parse_size(f"{n}{unit}") == n * factor
    assert parse_size(f"{n} {unit.lower()}") == n * factor


@given(st.text(max_size=12))
def test_parse_size_rejects_garbage_cleanly(text: str) -> None:
    with contextlib.suppress(ValueError):
        assert parse_size(text) >= 0


# Every string a recipe can hold, each key once (the schema check below keeps it complete).
EVERY_STRING = {
    "name": "m", "version": "1", "source": "demo",
    "weights": {"files": ["*.bin"], "key": "state_dict", "strip_prefixes": ["module."],
                "include": ["*"], "exclude": ["n_averaged"],
                "renames": [{"pattern": "a", "replace": "b"}], "dtype": "float16", "max_shard_size": "5GB",
                "chunk_size": "1MiB",
                "tie_prefer": ["lm_head.weight"], "allow_globals": ["m.C"], "layout": "auto",
                "components": ["unet"], "variants": ["model.int8.safetensors"],
                "leave_out": ["model.fp8.safetensors"]},
    "bundle": {"include": ["*.json"], "exclude": ["x.json"]},
    "image": {"base": "oci:/srv/base:v1", "base_name": "docker.io/library/debian:12", "prefix": "/models",
              "compression": "gzip", "owner": "0:0", "weights": "layer", "platform": "linux/amd64", "tag": "t",
              "entrypoint": ["python3"], "cmd": ["serve.py"], "user": "model", "workdir": "/srv",
              "env": {"A": "1"}},
    "runtime": {"device": "cuda", "warmup": [{"name": "input_ids", "shape": [1], "dtype": "int64"}]},
    "sign": {"key": "k.pem"},
    "warm": {"engine": "vllm", "args": ["--dtype"], "model_dir": "/models", "device": "cpu", "python": "/opt/py",
             "requests": [{"prompt_tokens": 8, "logprobs": 2}]},
}


def _string_leaves(value: object, path: str = "") -> list[str]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _string_leaves(v, f"{path}.{k}" if path else k)]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _string_leaves(v, f"{path}[{i}]")]
    return [path] if isinstance(value, str) else []


def _with(raw: object, path: str, text: str) -> object:
    """``raw`` with the string at ``path`` (``a.b[0].c``) given ``text`` in its middle."""
    head, _, rest = path.partition(".")
    name, _, index = head.partition("[")
    if isinstance(raw, dict):
        item = raw[name]
        if index:
            i = int(index.split("]")[0])
            tail = path[len(f"{name}[{i}]"):].lstrip(".")
            new = list(item)
            new[i] = _with(item[i], tail, text) if tail else item[i][:1] + text + item[i][1:]
            return {**raw, name: new}
        return {**raw, name: _with(item, rest, text) if rest else item[:1] + text + item[1:]}
    raise AssertionError(path)


def test_every_key_is_in_the_sample() -> None:
    from packer import recipe

    sample = EVERY_STRING
    tables = {"weights": recipe._WEIGHTS, "bundle": recipe._BUNDLE, "image": {**recipe._IMAGE},
              "runtime": recipe._RUNTIME, "sign": recipe._SIGN, "warm": recipe._WARM}
    tables["image"].pop("single_layer")  # not a string
    tables["weights"] = {k: v for k, v in tables["weights"].items() if k != "max_expansion"}  # a number
    tables["bundle"] = {k: v for k, v in tables["bundle"].items() if k != "remote_code"}  # a boolean
    for section, spec in tables.items():
        assert set(spec) == set(sample[section]), section
    recipe_from_dict(sample)  # the sample itself is valid


LEAVES = _string_leaves(EVERY_STRING)
# the few controls a key has a use for: an exec-form argument may be a multi-line script
ALLOWED = {"image.entrypoint[0]": "\t\n", "image.cmd[0]": "\t\n", "image.env.A": "\t"}


@pytest.mark.parametrize("path", LEAVES)
@pytest.mark.parametrize("char", ["\n", "\r", "\x1b", "\x00", "\x7f", "\x85", "\u202e", "\u2028", "\ufeff", "\ud800"])
def test_every_string_refuses_control_characters(path: str, char: str) -> None:
    raw = _with(EVERY_STRING, path, char)
    if char in ALLOWED.get(path, ""):
        recipe_from_dict(raw)  # type: ignore[arg-type]
        return
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(raw)  # type: ignore[arg-type]
    shown = {"\n": "\\n", "\r": "\\r"}.get(char) or (
        f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")
    assert str(e.value) == (f"{path}: character '{shown}' (U+{ord(char):04X}) is not allowed here: "
                            "recipe strings hold printable text only")


@pytest.mark.parametrize("path", LEAVES)
def test_tab_is_refused_outside_env_values_and_commands(path: str) -> None:
    raw = _with(EVERY_STRING, path, "\t")
    if "\t" in ALLOWED.get(path, ""):
        image = recipe_from_dict(raw).image  # type: ignore[arg-type]
        assert "\t" in "".join([*(image.entrypoint or ()), *(image.cmd or ()), *dict(image.env).values()])
    else:
        with pytest.raises(RecipeError, match=rf"^{re.escape(path)}: character '\\t'"):
            recipe_from_dict(raw)  # type: ignore[arg-type]


def test_the_warm_table_is_validated_with_key_paths_and_kept_out_of_the_manifest() -> None:
    got = recipe_from_dict({**BASE, "warm": {"engine": "vllm", "args": ["--dtype", "float32"], "device": "cuda"}})
    assert got.warm.args == ("--dtype", "float32") and got.warm.device == "cuda" and got.warm.model_dir is None
    assert "warm" not in got.normalised()  # the state is pinned apart; the build's bytes do not change
    for bad, said in [({"engine": "tgi"}, "warm.engine: expected one of 'vllm'"),
                      ({"device": "cpu"}, "warm.engine: missing"),
                      ({"engine": "vllm", "args": "--dtype"}, "warm.args: expected a list of strings"),
                      ({"engine": "vllm", "model_dir": "models"}, "warm.model_dir: expected an absolute path"),
                      ({"engine": "vllm", "device": "tpu"}, "warm.device: expected one of 'cpu', 'cuda'"),
                      ({"engine": "vllm", "gpu": 1}, "warm.gpu: unknown key")]:
        with pytest.raises(RecipeError, match=f"^{re.escape(said)}"):
            recipe_from_dict({**BASE, "warm": bad})


def test_a_control_character_in_a_table_key_is_refused() -> None:
    with pytest.raises(RecipeError, match=r"^image\.env\.A\\nRUN: character '\\n'"):
        recipe_from_dict({**BASE, "image": {"env": {"A\nRUN": "1"}}})


def test_a_recipe_file_with_a_newline_in_workdir_fails_in_one_line(tmp_path: Path) -> None:
    p = tmp_path / "r.toml"
    p.write_text('name = "x"\nversion = "1"\nsource = "demo"\n[image]\nworkdir = "/srv\\nRUN touch /pwned"\n')
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert str(e.value) == (f"{p}: image.workdir: character '\\n' (U+000A) is not allowed here: "
                            "recipe strings hold printable text only")


@pytest.mark.parametrize("key", ["workdir", "prefix"])
@pytest.mark.parametrize("path", ["/a//b", "/a/./b", "//a", "/a/.."])
def test_paths_are_clean_so_docker_records_them_unchanged(key: str, path: str) -> None:
    with pytest.raises(RecipeError, match=rf"^image\.{key}: expected an absolute path, clean"):
        recipe_from_dict({**BASE, "image": {key: path}})
    recipe_from_dict({**BASE, "image": {"prefix": "/models/"}})  # a trailing '/' is dropped from a prefix
    with pytest.raises(RecipeError, match=r"^image\.workdir: expected an absolute path, clean"):
        recipe_from_dict({**BASE, "image": {"workdir": "/srv/"}})  # but WORKDIR would drop it too


def test_warm_requests_are_validated_with_key_paths() -> None:
    from packer.warm.requests import DEFAULT_REQUESTS

    assert recipe_from_dict({**BASE, "warm": {"engine": "vllm"}}).warm.requests is None  # the default mix
    mix = [{"prompt_tokens": 8, "max_tokens": 2, "logprobs": 5}, {"n": 2, "temperature": 0.7, "top_p": 0.9}]
    got = recipe_from_dict({**BASE, "warm": {"engine": "vllm", "requests": mix}})
    assert got.warm.requests == tuple(mix)
    assert "warm" not in got.normalised()
    assert DEFAULT_REQUESTS[0].get("logprobs") and any(r.get("n", 1) > 1 for r in DEFAULT_REQUESTS)
    for bad, said in [
        ([], "warm.requests: expected a non-empty list of request tables"),
        ({"logprobs": 1}, "warm.requests: expected a non-empty list"),
        (["x"], "warm.requests[0]: expected a table"),
        ([{"logprobs": True}], "warm.requests[0].logprobs: expected an integer from 0"),
        ([{}, {"top_p": 1.5}], "warm.requests[1].top_p: expected a number in (0, 1], got float 1.5"),
        ([{"temperature": float("nan")}], "warm.requests[0].temperature: expected a number in [0, 100]"),
        ([{"top_k": 0}], "warm.requests[0].top_k: expected -1 (off) or a positive integer"),
        ([{"prompt": "hi"}], "warm.requests[0].prompt: unknown key (allowed: frequency_penalty, "),
        ([{}] * 65, "warm.requests: 65 requests; at most 64"),
    ]:
        with pytest.raises(RecipeError, match=re.escape(said)):
            recipe_from_dict({**BASE, "warm": {"engine": "vllm", "requests": bad}})


def test_packer_converts_options_make_the_weights_table_a_recipe_would() -> None:
    cfg = weights_from_options(key="state_dict", strip_prefixes=("module.",), renames=[(r"^a\.", "b.")],
                               dtype="float16", max_shard_size="2GB", tie_prefer=("lm_head.weight",),
                               max_expansion=2.0, allow_globals=("mypkg.Config",))
    table = {"key": "state_dict", "strip_prefixes": ["module."], "renames": [{"pattern": r"^a\.", "replace": "b."}],
             "dtype": "float16", "max_shard_size": "2GB", "tie_prefer": ["lm_head.weight"], "max_expansion": 2.0,
             "allow_globals": ["mypkg.Config"]}
    assert cfg == recipe_from_dict({**BASE, "weights": table}).weights
    assert cfg.renames == (Rename(r"^a\.", "b."),)
    empty = weights_from_options(key="", strip_prefixes=(), renames=(), dtype="", max_shard_size="5GB",
                                 tie_prefer=(), max_expansion=4.0, allow_globals=())
    assert (empty.key, empty.dtype) == (None, None)  # an empty --key or --dtype is none, as before
    with pytest.raises(RecipeError, match=r"^--allow-global"):
        weights_from_options(key=None, strip_prefixes=(), renames=(), dtype=None, max_shard_size="5GB",
                             tie_prefer=(), max_expansion=4.0, allow_globals=("nodot",))


def test_packer_builds_recipe_is_the_file_or_the_demo_with_the_flags_applied(tmp_path: Path) -> None:
    assert recipe_from_options(None, allow_globals=(), sign_key=None) == demo_recipe()
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "m"\nversion = "1"\nsource = "demo"\n[weights]\nallow_globals = ["a.B"]\n')
    rec = recipe_from_options(recipe, allow_globals=("c.D",), sign_key=tmp_path / "k.pem")
    assert rec.weights.allow_globals == ("a.B", "c.D")
    assert rec.sign.key == str(tmp_path / "k.pem")
