"""Code a model needs: the files ``auto_map`` names are carried (pinned, never run by packer).

transformers' ``register_for_auto_class`` + ``save_pretrained`` writes ``auto_map`` into
``config.json`` and copies the model's module files (and their relative imports) beside it;
``from_pretrained(model_dir(), trust_remote_code=True)`` must then find them and give the
same outputs bitwise. ``bundle.remote_code = false`` leaves them out and says what follows.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from packer.errors import BundleError
from tests.built import build_dir
from tests.component_fixtures import import_loader

CONFIG = '''
from transformers import PretrainedConfig


class TinyConfig(PretrainedConfig):
    model_type = "tiny-remote"

    def __init__(self, width=8, **kwargs):
        self.width = width
        super().__init__(**kwargs)
'''
MODELING = '''
import torch
from transformers import PreTrainedModel

from .configuration_tiny import TinyConfig


class TinyModel(PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config):
        super().__init__(config)
        self.inner = torch.nn.Linear(config.width, config.width)
        self.post_init()

    def forward(self, x):
        return torch.tanh(self.inner(x)) * 3
'''


pytestmark = pytest.mark.usefixtures("build_env")  # tests/conftest.py: no start-up log, a private bundle cache


@pytest.fixture(autouse=True)
def _modules_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))


@pytest.fixture
def tiny_package(tmp_path: Path) -> Iterator[Any]:
    pkg = tmp_path / "code" / "tinypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "configuration_tiny.py").write_text(CONFIG)
    (pkg / "modeling_tiny.py").write_text(MODELING)
    sys.path.insert(0, str(pkg.parent))
    try:
        yield importlib.import_module("tinypkg.modeling_tiny")
    finally:
        sys.path.remove(str(pkg.parent))
        for name in [n for n in sys.modules if n.startswith("tinypkg")]:
            del sys.modules[name]


def _saved(tmp_path: Path, modeling: Any) -> tuple[Path, Any]:
    config_module = sys.modules["tinypkg.configuration_tiny"]
    config_module.TinyConfig.register_for_auto_class()
    modeling.TinyModel.register_for_auto_class("AutoModel")
    torch.manual_seed(0)
    model = modeling.TinyModel(config_module.TinyConfig(width=8)).eval()
    src = tmp_path / "src"
    model.save_pretrained(src)
    return src, model


def test_auto_map_code_is_carried_and_loads(tmp_path: Path, tiny_package: Any) -> None:
    from transformers import AutoModel

    src, model = _saved(tmp_path, tiny_package)
    auto_map = json.loads((src / "config.json").read_text())["auto_map"]
    assert auto_map == {"AutoConfig": "configuration_tiny.TinyConfig", "AutoModel": "modeling_tiny.TinyModel"}
    plan = build_dir(src, tmp_path / "plan", dry_run=True)
    assert any("carries the code files auto_map names, pinned, never imported or run by packer: "
               "configuration_tiny.py, modeling_tiny.py" in n for n in plan.notes)
    out = tmp_path / "out"
    result = build_dir(src, out)
    members = {m["name"]: m for m in result.manifest["bundle"]["members"]}
    for name in ("configuration_tiny.py", "modeling_tiny.py"):  # pinned like every member
        import hashlib

        assert members[name]["sha256"] == hashlib.sha256((src / name).read_bytes()).hexdigest()
    md = import_loader(out).model_dir()
    assert (md / "modeling_tiny.py").read_bytes() == (src / "modeling_tiny.py").read_bytes()
    x = torch.randn(3, 8)
    with torch.no_grad():
        got = AutoModel.from_pretrained(md, trust_remote_code=True).eval()(x)
        assert torch.equal(got, model(x))


def test_remote_code_false_leaves_the_code_out_and_says_so(tmp_path: Path, tiny_package: Any) -> None:
    src, _model = _saved(tmp_path, tiny_package)
    result = build_dir(src, tmp_path / "out", bundle={"remote_code": False})
    names = {m["name"] for m in result.manifest["bundle"]["members"]}
    assert "modeling_tiny.py" not in names and "config.json" in names
    assert any("bundle.remote_code = false leaves out the code files auto_map names: the model directory "
               "will not load with trust_remote_code=True" in n for n in result.notes)


def test_auto_map_naming_a_missing_or_bad_file_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.ones(2)}, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "modeling_gone.Gone"}}))
    with pytest.raises(BundleError, match=r"names code in modeling_gone\.py, which the model directory does not "
                                          r"hold; add the file, or set bundle.remote_code = false"):
        build_dir(src, tmp_path / "out", dry_run=True)
    for bad in ("../evil.X", "a/b.X", "os.path.join", "x"):
        (src / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": bad}}))
        with pytest.raises(BundleError, match="not a 'module.Class' of a file in the model directory"):
            build_dir(src, tmp_path / "out", dry_run=True)
    (src / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "org/repo--modeling_x.X"}}))
    plan = build_dir(src, tmp_path / "plan", dry_run=True)
    assert any("auto_map names code in other repositories, not carried: org/repo--modeling_x.X" in n
               for n in plan.notes)


def _auto_mapped(src: Path, modeling: str) -> Path:
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "modeling_x.X"}}))
    (src / "modeling_x.py").write_text(modeling)
    return src


def test_a_linked_code_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    from packer.bundle.remote_code import remote_code

    secret = tmp_path / "secret.py"
    secret.write_text("from .TOKEN_s3cr3t import x\n")
    src = _auto_mapped(tmp_path / "src", "")
    (src / "modeling_x.py").unlink()
    (src / "modeling_x.py").symlink_to(secret)
    with pytest.raises(BundleError, match="leads outside") as caught:
        remote_code(src)
    assert "TOKEN_s3cr3t" not in str(caught.value)  # the target's text never reaches a message
    (src / "modeling_x.py").unlink()  # the config itself, linked out of the directory
    (src / "config.json").unlink()
    (tmp_path / "other.json").write_text(json.dumps({"auto_map": {"AutoModel": "modeling_TOKEN_s3cr3t.X"}}))
    (src / "config.json").symlink_to(tmp_path / "other.json")
    with pytest.raises(BundleError, match="leads outside") as caught:
        remote_code(src)
    assert "TOKEN_s3cr3t" not in str(caught.value)


def test_code_elsewhere_is_escaped_in_the_note(tmp_path: Path) -> None:
    from packer.bundle.remote_code import remote_code

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "org/r--m.X\x1b[2J\u202e"}}))
    assert remote_code(src).elsewhere == ("org/r--m.X\\x1b[2J\\u202e",)


# whitespace runs over many lines made the old whole-text regex backtrack at every line start
BLANK_LINES = ("\n", "    \n", " \t \x0c \n")
ODD_LINES = "from    \nfrom .x\nimport  .  \nfrom .\n" * 100


def _scan_seconds(tmp_path: Path, lines: int) -> float:
    import time

    from packer.bundle.remote_code import remote_code

    src = _auto_mapped(tmp_path / f"src{lines}",
                       "".join(BLANK_LINES[i % 3] for i in range(lines)) + ODD_LINES + "from .y import z\n")
    (src / "y.py").write_text("import .x\n")
    (src / "x.py").write_text("")
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        assert remote_code(src).files == ("modeling_x.py", "x.py", "y.py")
        best = min(best, time.perf_counter() - start)
    return best


def test_scan_is_linear_in_the_file(tmp_path: Path) -> None:
    # a quadratic scan takes 16x for 4x the lines (5,000 -> 20,000 blank lines: 0.45 s -> 8.5 s)
    small, large = _scan_seconds(tmp_path, 5_000), _scan_seconds(tmp_path, 20_000)
    assert large < 8 * max(small, 0.01)  # the floor keeps timer noise on tiny times out of it


def test_a_300000_line_modeling_file_does_not_stall_packer_bundle(tmp_path: Path) -> None:
    import subprocess

    src = _auto_mapped(tmp_path / "src", "    \n" * 300_000 + "from .y import z\n")
    (src / "y.py").write_text("")
    # a child process, so a quadratic scan is killed instead of holding the test run (generous bound)
    proc = subprocess.run([sys.executable, "-m", "packer", "bundle", "--dry-run", str(src), "-o",
                           str(tmp_path / "b.tar.zst")], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "y.py" in proc.stdout and "modeling_x.py" in proc.stdout
