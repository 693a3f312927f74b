"""Trees 1,100 folders deep under every walk of an input: one line naming the path and the cap.

Python 3.11's ``Path.rglob``, ``os.walk`` and ``shutil.rmtree`` recurse once per level, so such
a tree ended in a RecursionError traceback. Both sides walk with one iterative walker
(:func:`packer.runtime.reading.walk_tree`, wrapped by :func:`packer.reading.walk_tree`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from packer.cli import main
from packer.errors import WarmStateError
from packer.runtime.env import ArtifactMismatchError
from packer.runtime.served import check_extracted
from packer.warm.pins import check_state, collect, write_state

LEVELS = 1_100
CAP = r"deeper than \d+ levels"  # the cap: runtime.reading.MAX_TREE_DEPTH


def _deep(top: Path) -> Path:
    """``top/d/d/.../d/leaf`` 1,100 folders deep, made level by level (``os.makedirs`` recurses too)."""
    path = top
    path.mkdir(parents=True, exist_ok=True)
    for _ in range(LEVELS):
        path = path / "d"
        path.mkdir()
    (path / "leaf").write_bytes(b"x")
    return top


def _remove_deep(top: Path) -> None:
    """Remove a tree bottom-up without recursion (``shutil.rmtree`` recurses per level)."""
    stack = [(top, False)]
    while stack:
        path, emptied = stack.pop()
        if emptied or path.is_symlink() or not path.is_dir():
            path.rmdir() if emptied else path.unlink()
            continue
        stack.append((path, True))
        stack.extend((child, False) for child in path.iterdir())


@pytest.fixture
def trees(tmp_path: Path) -> Iterator[list[Path]]:
    """Folders the test fills with deep trees; removed iteratively (pytest's own cleanup recurses)."""
    made: list[Path] = []
    yield made
    for top in made:
        if top.exists():
            _remove_deep(top)
    assert not any(top.exists() for top in made)


def test_packer_verify_of_an_out_holding_a_deep_tree_is_one_line(tmp_path: Path, trees: list[Path]) -> None:
    import torch
    from safetensors.torch import save_file

    from tests.built import build_dir

    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.ones(2)}, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"hidden_size": 2}))
    out = tmp_path / "out"
    build_dir(src, out)
    trees.append(_deep(out / "extra"))
    result = CliRunner().invoke(main, ["verify", str(out)])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output and re.search(CAP, lines[0]), result.output
    assert str(out / "extra") in lines[0]


def test_the_bundle_cache_check_of_a_deep_tree_is_one_line(tmp_path: Path, trees: list[Path]) -> None:
    cache = tmp_path / "cache" / ("0" * 64)
    trees.append(_deep(cache))
    with pytest.raises(ArtifactMismatchError, match=CAP) as caught:
        check_extracted(cache, [], hashes=False)
    assert "\n" not in str(caught.value) and str(cache) in str(caught.value)


def test_a_warm_state_holding_a_deep_tree_is_one_line(tmp_path: Path, trees: list[Path]) -> None:
    caches = tmp_path / "caches" / "vllm"
    (caches / "modelinfos").mkdir(parents=True)
    (caches / "modelinfos" / "m.json").write_text("{}")
    state = tmp_path / "out" / "warm" / "vllm-cpu-x86_64"
    write_state(state, name=state.name, key={"engine": "vllm"}, files=collect({"vllm": caches}))
    trees.append(_deep(state / "files" / "vllm" / "deep"))
    with pytest.raises(WarmStateError, match=CAP) as caught:
        check_state(state)
    assert "\n" not in str(caught.value)
    trees.append(_deep(caches / "deep"))  # capturing from an engine's cache walks it too
    with pytest.raises(WarmStateError, match=CAP):
        collect({"vllm": caches})


def test_the_walk_never_follows_links_and_remove_tree_keeps_their_targets(tmp_path: Path,
                                                                          trees: list[Path]) -> None:
    from packer.reading import walk_tree
    from packer.util.fsutil import remove_tree

    target = tmp_path / "target"
    (target / "sub").mkdir(parents=True)
    (target / "sub" / "f").write_text("kept")
    top = tmp_path / "top"
    (top / "a").mkdir(parents=True)
    os.symlink(target, top / "a" / "link")  # a link to a folder: one entry, never entered
    os.symlink(top, top / "a" / "loop")
    assert [rel for rel, _, _ in walk_tree(top, error=WarmStateError)] == ["a", "a/link", "a/loop"]
    remove_tree(top)
    assert not top.exists() and (target / "sub" / "f").read_text() == "kept"
    deep = _deep(tmp_path / "deep")
    trees.append(deep)  # removed by the fixture if remove_tree fails
    remove_tree(deep)  # at any depth: shutil.rmtree's recursion ends in RecursionError here
    assert not deep.exists()


def test_a_deep_tree_left_by_the_weights_child_is_one_line(tmp_path: Path, trees: list[Path]) -> None:
    from packer.errors import WeightsError
    from packer.oci.reread import _remove_unnamed
    from packer.util.formats import UNNAMED_BLOBS

    trees.append(_deep(tmp_path / UNNAMED_BLOBS))
    with pytest.raises(WeightsError, match=CAP) as caught:
        _remove_unnamed(tmp_path)
    assert "\n" not in str(caught.value)
    shallow = tmp_path / "shallow"
    (shallow / UNNAMED_BLOBS / "a" / "b").mkdir(parents=True)
    _remove_unnamed(shallow)  # empty folders only: removed
    assert not (shallow / UNNAMED_BLOBS).exists()
