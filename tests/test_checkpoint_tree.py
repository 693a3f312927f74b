"""The walks over the unpickled tree: linear in its size, depth and names capped.

A chain nested 100,000 levels deep without MARK (tests/ckpt_factory.py ``deep_nesting``; torch
itself reads it) made ``packer inspect`` build 100,000 names of up to 200,000 characters each
(gigabytes) and ``convert`` quadratic. The real CLI runs here in a child process under a 2 GiB
address-space cap and a hang guard: a regression ends in MemoryError or a timeout, not in a
slow pass.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from packer.checkpoint import inspect_checkpoint, read_checkpoint
from packer.checkpoint.tree import MAX_DEPTH, named_walk
from packer.errors import CheckpointError
from tests.ckpt_factory import deep_nesting

_AS_CAP = 2 * 2**30


def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_AS_CAP, _AS_CAP))


def _packer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "packer", *args], capture_output=True, text=True,
                          preexec_fn=_capped, timeout=300, check=False)


DEEP = "nested deeper than 1000 levels"
NOT_FLAT = "not a flat tensor dict"


@pytest.mark.parametrize(("kind", "bottom", "command", "reason"), [
    ("list", True, "inspect", DEEP),
    ("dict", True, "inspect", DEEP),
    ("dict", False, "inspect", DEEP),
    ("list", False, "convert", DEEP),  # junk beside a flat state dict: the placeholder walk
    ("dict", True, "convert", NOT_FLAT),  # the chain holds a tensor: counted, linear, refused
    ("dict", False, "convert --no-sandbox", DEEP),
])
def test_100k_deep_nesting_ends_in_one_line_in_bounded_memory(tmp_path: Path, kind: str, bottom: bool,
                                                              command: str, reason: str) -> None:
    path = tmp_path / "deep.pt"
    path.write_bytes(deep_nesting(100_000, kind=kind, tensor_at_bottom=bottom))
    out = tmp_path / "out"
    args = [*command.split(), str(path)] + (["-o", str(out)] if command.startswith("convert") else [])
    proc = _packer(*args)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and reason in lines[0], proc.stderr[-2000:]
    assert not out.exists()


def test_torch_reads_the_deep_fixture(tmp_path: Path) -> None:
    path = tmp_path / "deep.pt"
    path.write_bytes(deep_nesting(50, kind="dict", tensor_at_bottom=True))
    node = torch.load(path, weights_only=True)["deep"]
    for _ in range(49):
        node = node["a"]
    assert torch.equal(node["a"], torch.zeros(4))


def test_nesting_under_the_cap_is_listed_in_full(tmp_path: Path) -> None:
    path = tmp_path / "deep.pt"
    depth = MAX_DEPTH - 1
    path.write_bytes(deep_nesting(depth, kind="list", tensor_at_bottom=True))
    report = inspect_checkpoint(path)
    names = [t["name"] for t in report["tensors"]]
    assert names == ["w", "deep" + ".0" * depth]
    assert len(report["containers"]) == depth and report["containers"][-1]["tensors"] == 1


def test_junk_under_the_cap_beside_a_state_dict_converts(tmp_path: Path) -> None:
    path = tmp_path / "deep.pt"
    path.write_bytes(deep_nesting(MAX_DEPTH - 1, kind="dict"))
    contents = read_checkpoint(path)
    assert [r.name for r in contents.tensors] == ["w"] and contents.skipped == ("deep",)


def test_long_keys_are_capped_by_the_names_they_would_make(tmp_path: Path) -> None:
    # 900 levels under one 200,000-character key (written once, fetched from the memo): a
    # 200 KB file whose dotted names would total 81 billion characters
    path = tmp_path / "keys.pt"
    path.write_bytes(deep_nesting(900, kind="dict", tensor_at_bottom=True, key_len=200_000))
    assert path.stat().st_size < 300_000
    proc = _packer("inspect", str(path))
    assert proc.returncode == 1 and "names exceed 67108864 characters (cap)" in proc.stderr, proc.stderr[-2000:]


def test_named_walk_names_each_node_once_and_cuts_cycles() -> None:
    shared: dict[str, object] = {"x": 1}
    loop: list[object] = []
    loop.append(loop)
    root = {"a": shared, "b": shared, "c": loop, "d": (2, 3)}
    seen = [(name, first) for name, _, first in named_walk(root, lambda _: True, where="f")]
    assert seen == [("", True), ("a", True), ("a.x", True), ("b", False), ("c", True), ("c.0", False),
                    ("d", True), ("d.0", True), ("d.1", True)]


def test_named_walk_depth_cap_names_the_file_and_entry() -> None:
    root: list[object] = []
    node = root
    for _ in range(MAX_DEPTH + 5):
        child: list[object] = []
        node.append(child)
        node = child
    node.append(1)
    with pytest.raises(CheckpointError, match=r"^f\.pt: entry 0\.0\.0.*…: nested deeper than 1000 levels"):
        list(named_walk(root, lambda _: True, where="f.pt"))
