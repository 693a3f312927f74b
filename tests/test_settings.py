"""The loader's settings: one object, environment over the recipe's ``[runtime]`` over defaults."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from packer.runtime.loading import Loader
from packer.runtime.settings import RuntimeSettings, setting


def test_defaults() -> None:
    s = RuntimeSettings.from_sources({}, None)
    assert s == RuntimeSettings()
    assert (s.ring_slots, s.chunk_mb, s.chunk_bytes) == (4, 64, 64 * 2**20)
    assert s.readers == min(8, os.cpu_count() or 1)
    assert (s.artifacts, s.weights_dir, s.bundle_cache, s.startup_log) == ("", "", "", "text")
    assert (s.hugepages, s.expandable_segments, s.device, s.warmup) == (False, False, "cuda", ())


def test_environment_wins_over_the_recipe() -> None:
    recipe = {"ring_slots": 8, "chunk_mb": 16, "readers": 3, "device": "cpu",
              "warmup": [{"name": "input_ids", "shape": [1, 4]}]}
    env = {"PACKER_RING_SLOTS": "2", "PACKER_CHUNK_MB": "", "PACKER_HUGEPAGES": "1", "PACKER_STARTUP_LOG": "JSON"}
    s = RuntimeSettings.from_sources(env, recipe)
    assert s.ring_slots == 2  # both channels: the environment's
    assert s.chunk_mb == 16 and s.readers == 3  # an empty variable counts as unset: the recipe's
    assert s.hugepages and s.startup_log == "json"  # the environment alone
    assert s.device == "cpu" and s.warmup == ({"name": "input_ids", "shape": [1, 4]},)  # the recipe alone
    only_recipe = RuntimeSettings.from_sources({}, recipe)
    assert (only_recipe.ring_slots, only_recipe.chunk_mb) == (8, 16)


def test_device_and_warmup_come_from_the_recipe_only() -> None:
    s = RuntimeSettings.from_sources({"PACKER_DEVICE": "cpu", "PACKER_WARMUP": "[]"}, {"device": "cuda:1"})
    assert s.device == "cuda:1" and s.warmup == ()


def test_parsing_readers_and_flags() -> None:
    assert RuntimeSettings.from_sources({"PACKER_READERS": "0"}).readers == 1
    assert RuntimeSettings.from_sources({}, {"readers": -2}).readers == 1
    for value, want in (("1", True), ("0", False), ("", False)):
        assert RuntimeSettings.from_sources({"PACKER_EXPANDABLE_SEGMENTS": value}).expandable_segments is want
        assert setting("expandable_segments", {"PACKER_EXPANDABLE_SEGMENTS": value}) is want
    assert RuntimeSettings.from_sources({}, {"hugepages": True, "expandable_segments": 0}).hugepages is True
    assert setting("startup_log", {}) == "text" and setting("startup_log", {"PACKER_STARTUP_LOG": "Off"}) == "off"
    with pytest.raises(ValueError, match=r"^packer_loader: PACKER_RING_SLOTS: expected an integer, got 'four'$"):
        RuntimeSettings.from_sources({"PACKER_RING_SLOTS": "four"})
    with pytest.raises(ValueError, match="PACKER_CHUNK_MB: expected an integer, got None"):
        RuntimeSettings.from_sources({}, {"chunk_mb": None})


@pytest.mark.parametrize(("var", "value", "accepts"), [
    ("PACKER_STARTUP_LOG", "loud", "text or json or off"),
    ("PACKER_HUGEPAGES", "yes", "0 or 1"),
    ("PACKER_EXPANDABLE_SEGMENTS", "yes", "0 or 1"),
    ("PACKER_DEBUG", "2", "0 or 1"),
    ("PACKER_READERS", "1.5", "an integer"),
])
def test_a_bad_value_is_one_line_naming_the_variable_and_what_it_accepts(var: str, value: str, accepts: str) -> None:
    want = rf"^packer_loader: {var}: expected {accepts}, got '{value}'$"
    with pytest.raises(ValueError, match=want):
        RuntimeSettings.from_sources({var: value})
    with pytest.raises(ValueError, match=want):
        setting(var.removeprefix("PACKER_").lower(), {var: value})


def test_a_bad_variable_refuses_the_loader_and_the_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    env = {**os.environ, "PACKER_EXPANDABLE_SEGMENTS": "yes", "PYTHONPATH": str(Path(__file__).parents[1])}
    r = subprocess.run([sys.executable, "-c", "import packer.runtime.loader"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.splitlines()[-1] == ("ValueError: packer_loader: PACKER_EXPANDABLE_SEGMENTS: "
                                         "expected 0 or 1, got 'yes'")
    monkeypatch.setenv("PACKER_STARTUP_LOG", "loud")
    with pytest.raises(ValueError, match="PACKER_STARTUP_LOG: expected text or json or off, got 'loud'"):
        Loader({}, tmp_path)


def test_settings_are_frozen() -> None:
    s = RuntimeSettings()
    with pytest.raises(AttributeError):
        s.ring_slots = 9  # type: ignore[misc]


def test_loader_takes_one_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = {"runtime": {"ring_slots": 3, "chunk_mb": 2, "device": "cpu"}}
    monkeypatch.setenv("PACKER_READERS", "5")
    monkeypatch.setenv("PACKER_RING_SLOTS", "")
    monkeypatch.setenv("PACKER_BUNDLE_CACHE", str(tmp_path / "cache"))
    ld = Loader(m, tmp_path)
    assert (ld.slots, ld.chunk, ld.readers) == (3, 2 * 2**20, 5)
    assert ld.settings.bundle_cache == str(tmp_path / "cache") and ld.settings.device == "cpu"
    monkeypatch.setenv("PACKER_RING_SLOTS", "6")
    assert ld.slots == 3 and Loader(m, tmp_path).slots == 6  # the environment wins, per loader
    given = RuntimeSettings(ring_slots=2)
    assert Loader(m, tmp_path, settings=given).settings is given
