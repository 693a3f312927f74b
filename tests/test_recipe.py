"""Recipe loading and validation: every error names the key path or the TOML line."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from packer.errors import RecipeError
from packer.recipe import demo_recipe, load_recipe, parse_size, recipe_from_dict

REPO = Path(__file__).resolve().parents[1]
BASE = {"name": "m", "version": "1", "source": "demo"}


def test_shipped_recipes_load() -> None:
    demo = load_recipe(REPO / "recipes" / "demo.toml")
    assert demo.source == "demo"
    assert demo.normalised() == demo_recipe().normalised()  # `packer build` == demo.toml
    hf = load_recipe(REPO / "recipes" / "hf-model.toml")
    assert hf.source.startswith("hf://") and hf.weights.max_shard_size == 2 * 10**9
    assert hf.image.owner == "1000:0" and hf.image.env == (("HF_HUB_OFFLINE", "1"),)
    assert hf.image.base_name == "docker.io/nvidia/cuda:12.4.1-runtime-ubuntu22.04"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"weights": {"max_shard_size": 12}}, 'weights.max_shard_size: expected a size like "5GB", got 12'),
        ({"weights": {"max_shard_sise": "5GB"}}, "weights.max_shard_sise: unknown key"),
        ({"colour": "red"}, "colour: unknown key"),
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
