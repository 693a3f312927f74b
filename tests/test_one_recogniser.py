"""One recogniser of other frameworks' weight files: ``build``, ``convert`` and ``inspect`` give one answer.

Keras (``.weights.h5``, ``.keras``), ONNX, GGUF and NumPy (``.npz``, ``.npy``) files are named as what
they are, with what to do, in the same line and exit code 1 from each command, whether the file is
named or found in a directory; a file whose name says nothing is recognised by its first bytes.
The NumPy advice, followed, writes safetensors (``np.load(..., allow_pickle=False)``: an object
array is refused by numpy itself) that build into the same arrays, bitwise.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from packer.cli import main
from tests.built import build_dir

HDF5 = b"\x89HDF\r\n\x1a\n" + bytes(64)


def answer(args: list[str]) -> str:
    """The one line a command prints for a refused input, asserting exit code 1."""
    result = CliRunner().invoke(main, args)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def answers(tmp_path: Path, path: Path) -> list[str]:
    """The answers of convert, inspect and build, for ``path`` named and for its directory."""
    recipes = []
    for name, source in (("file", path), ("dir", path.parent)):
        recipe = tmp_path / f"{name}.toml"
        recipe.write_text(f'name = "x"\nversion = "1"\nsource = "{source}"\n')
        recipes.append(recipe)
    return [answer(["convert", "--no-sandbox", str(path), "-o", str(tmp_path / "c1")]),
            answer(["convert", "--no-sandbox", str(path.parent), "-o", str(tmp_path / "c2")]),
            answer(["inspect", str(path)]),
            answer(["build", str(recipes[0]), "-o", str(tmp_path / "b1")]),
            answer(["build", str(recipes[1]), "-o", str(tmp_path / "b2")])]


def _npz(path: Path) -> None:
    np.savez(path, w=np.arange(6, dtype=np.float32).reshape(2, 3), b=np.ones(3, dtype=np.float16))


@pytest.mark.parametrize(("name", "write", "what"), [
    ("model.weights.h5", lambda p: p.write_bytes(HDF5), "a Keras model"),
    ("model.keras", lambda p: p.write_bytes(b"PK\x03\x04" + bytes(64)), "a Keras model"),
    ("model.onnx", lambda p: p.write_bytes(b"\x08\x07\x12\x07pytorch" + bytes(16)), "an ONNX graph"),
    ("params.npz", _npz, "NumPy arrays (a .npz archive)"),
    ("embedding.npy", lambda p: np.save(p, np.arange(4.0)), "NumPy arrays (a .npy array)"),
    ("saved_model.pb", lambda p: p.write_bytes(b"\x08\x01\x12" + bytes(16)),
     "a TensorFlow SavedModel, checkpoint or TFLite file"),
])
def test_build_convert_and_inspect_give_one_answer(tmp_path: Path, name: str, write: object, what: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    write(src / name)  # type: ignore[operator]
    got = answers(tmp_path, src / name)
    assert got == [got[0]] * len(got), got
    assert got[0].startswith(f"error: {src / name}: {what}, which packer does not convert")


@pytest.mark.parametrize(("name", "content", "what"), [
    ("weights.bin", HDF5, "a Keras model"),
    ("model.pt", b"GGUF\x03\x00\x00\x00" + bytes(64), "a GGUF file"),
])
def test_a_file_named_like_ours_is_recognised_by_its_first_bytes(tmp_path: Path, name: str, content: bytes,
                                                                 what: str) -> None:
    (tmp_path / name).write_bytes(content)
    line = answer(["inspect", str(tmp_path / name)])
    assert line.startswith(f"error: {tmp_path / name}: {what}")
    assert line == answer(["convert", "--no-sandbox", str(tmp_path / name), "-o", str(tmp_path / "c")])


def _follow(line: str) -> None:
    """Run the advice's one command, as a user pastes it (``python`` is this interpreter)."""
    (command,) = re.findall(r"`([^`]+)`", line)
    argv = shlex.split(command)
    assert argv[0] == "python"
    subprocess.run([sys.executable, *argv[1:]], check=True, capture_output=True, timeout=120)


def test_the_numpy_advice_followed_builds_the_same_arrays(tmp_path: Path) -> None:
    src = tmp_path / "it's numpy"
    src.mkdir()
    w = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))  # column-major on disk
    np.savez(src / "params.npz", w=w, b=np.ones(3, dtype=np.float16), i=np.arange(5, dtype=np.int64))
    _follow(answer(["inspect", str(src / "params.npz")]))
    result = build_dir(src, tmp_path / "out")
    assert result.manifest["weights"]["left_out"] == ["params.npz"]  # and named as what it is
    assert any(n.startswith("left out: params.npz: NumPy arrays (a .npz archive)") for n in result.notes)
    got = load_file(src / "params.safetensors")
    assert set(got) == {"w", "b", "i"} and torch.equal(got["w"], torch.from_numpy(np.ascontiguousarray(w)))
    assert torch.equal(got["b"], torch.ones(3, dtype=torch.float16)) and torch.equal(got["i"], torch.arange(5))
    one = tmp_path / "one"
    one.mkdir()
    np.save(one / "embedding.npy", np.arange(8, dtype=np.float32).reshape(2, 4))
    _follow(answer(["convert", "--no-sandbox", str(one / "embedding.npy"), "-o", str(tmp_path / "c")]))
    assert torch.equal(load_file(one / "embedding.safetensors")["weight"], torch.arange(8.0).reshape(2, 4))


def test_an_object_array_is_refused_by_the_advice_itself(tmp_path: Path) -> None:
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    line = answer(["inspect", str(tmp_path / "objects.npy")])
    with pytest.raises(subprocess.CalledProcessError) as e:
        _follow(line)
    assert b"allow_pickle=False" in e.value.stderr and not (tmp_path / "objects.safetensors").exists()
