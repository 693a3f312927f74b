"""packer/__init__.py: the declared public surface resolves, and ``import packer`` stays cheap."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import packer
from tests.test_layers import module_files

ROOT = Path(__file__).resolve().parents[1]


def _fresh(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)


def test_every_public_name_resolves_to_what_its_home_defines() -> None:
    assert len(packer.__all__) == len(set(packer.__all__))
    for name in packer.__all__:
        value = getattr(packer, name)
        assert value is not None, name
        if name != "__version__":
            assert getattr(value, "__name__", None) == name, name
    assert issubclass(packer.VerifyError, packer.PackerError)
    assert set(packer.__all__) <= set(dir(packer))
    assert set(packer.__all__) == {"__version__", *packer._HOMES}  # resolved as declared, nothing more


def test_no_public_name_is_also_a_submodule() -> None:
    """A name bound both ways would flip when the submodule is imported (the import system
    sets the package's attribute), so ``packer.build`` is the function and building.py its module."""
    submodules = {m.split(".")[1] for m in module_files() if m.count(".") >= 1}
    assert not set(packer.__all__) & submodules


def test_an_unknown_name_is_an_attribute_error() -> None:
    assert not hasattr(packer, "no_such_thing")


def test_import_packer_imports_no_stage_and_no_torch() -> None:
    proc = _fresh("import json, sys, packer\n"
                  "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'packer'))))")
    assert json.loads(proc.stdout) == ["packer", "packer.version"]


def test_the_version_is_one_value() -> None:
    from packer.manifest import __version__ as in_manifest

    assert packer.__version__ == in_manifest
    assert f'version = "{packer.__version__}"' in (ROOT / "pyproject.toml").read_text()
