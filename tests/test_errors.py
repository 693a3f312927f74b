"""packer.errors: one home and one name per error class, and each survives the sandbox."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from packer import errors
from packer.recipe import WeightsConfig
from packer.weights.options import ConvertOptions
from packer.weights.sandbox import convert_sandboxed, error_class
from tests.ckpt_factory import save

PACKAGE = Path(errors.__file__).parent
CLASSES = [c for c in vars(errors).values() if inspect.isclass(c) and issubclass(c, errors.PackerError)]


def _classes() -> list[tuple[str, str, list[str]]]:
    """``(file, class name, base names)`` of every class defined in the packer package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases]
                found.append((str(path.relative_to(PACKAGE.parent)), node.name, bases))
    return found


def test_every_error_class_lives_in_errors_py() -> None:
    names = {c.__name__ for c in CLASSES}
    elsewhere = [(f, n) for f, n, bases in _classes() if f != "packer/errors.py" and set(bases) & names]
    assert elsewhere == []


def test_error_class_names_are_unique() -> None:
    kinds = ("Error", "Exception", "Warning")
    errs = [n for _, n, bases in _classes() if n.endswith(kinds) or any(b.endswith(kinds) for b in bases)]
    assert "ArtifactMismatchError" in errs and "BundleFormatError" in errs  # the runtime's own two
    assert sorted(errs) == sorted(set(errs))


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_the_sandbox_finds_each_class_by_name(cls: type[errors.PackerError]) -> None:
    assert error_class(cls.__name__) is cls


def test_the_sandbox_refuses_names_that_are_not_error_classes() -> None:
    assert error_class("annotations") is errors.PackerError and error_class("nothing") is errors.PackerError


def test_a_truncated_pickle_keeps_its_class_across_the_sandbox(tmp_path: Path) -> None:
    data = save({"w": torch.ones(3)}, tmp_path / "m.bin", "legacy").read_bytes()
    (tmp_path / "m.bin").write_bytes(data[:200])  # ends inside the main pickle
    with pytest.raises(errors.TruncatedPickle, match=r"m\.bin: main pickle at byte \d+: declares"):
        convert_sandboxed(tmp_path / "m.bin", tmp_path / "out", WeightsConfig(), ConvertOptions())
