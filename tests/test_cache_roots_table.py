"""The warm cache roots live in one table (packer/warm/roots.py ``CACHE_ROOTS``): a state's
folders, the variables capture and a hit set, the key's library versions and the trust-gate
scan's list of cache variables all follow it, and no other module spells a root's variable."""

from __future__ import annotations

from pathlib import Path

from packer.adapters import gate
from packer.warm import pins, roots
from tests.test_trust_gate import CACHE_VARS

PACKAGE = Path(__file__).resolve().parents[1] / "packer"


def test_every_table_of_roots_is_derived_from_the_one_list() -> None:
    names = tuple(r.name for r in roots.CACHE_ROOTS)
    assert len(set(names)) == len(names) and len({r.variable for r in roots.CACHE_ROOTS}) == len(names)
    assert pins.ROOTS == roots.ROOTS == names
    assert names == gate.ROOTS and {r.name: r.variable for r in roots.CACHE_ROOTS} == gate.CACHE_ENV
    assert tuple(roots.root_libraries()) == names  # the key names a library and version for every root
    assert set(roots.LIBRARIES) | {"cuda"} == set(names)
    assert set(gate.CACHE_ENV.values()) <= CACHE_VARS  # the scan refuses any write of each outside a gate


def test_no_other_module_spells_a_cache_roots_variable() -> None:
    home = PACKAGE / "warm" / "roots.py"
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == home:
            continue
        text = path.read_text()
        spelled = [r.variable for r in roots.CACHE_ROOTS if f'"{r.variable}"' in text or f"'{r.variable}'" in text]
        assert not spelled, f"{path}: spells {spelled}: derive it from packer.warm.roots.CACHE_ROOTS"
