"""packer.util.formats: file names and weight patterns are spelled once on the build side."""

from __future__ import annotations

import ast
from pathlib import Path

from packer.util import formats

PACKAGE = Path(formats.__file__).parent.parent
# the runtime cannot import packer; the checkpoint reader and the shard plan keep their own
APART = ("util/formats.py", "runtime/", "checkpoint/", "weights/plan.py")


def test_names_and_patterns_are_spelled_only_in_formats() -> None:
    spelled = {formats.LOADER_NAME, formats.MANIFEST_NAME, *formats.WEIGHT_SUFFIXES, *formats.WEIGHT_PATTERNS}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if not rel.startswith(APART):
            found += [f"{rel}:{n.lineno}: {n.value!r}" for n in ast.walk(ast.parse(path.read_text()))
                      if isinstance(n, ast.Constant) and n.value in spelled]
    assert found == []


def test_weight_patterns_follow_the_suffixes() -> None:
    assert formats.WEIGHT_PATTERNS == ("*.safetensors", "*.pt", "*.pth", "*.ckpt", "*.bin")
