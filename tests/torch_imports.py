"""Count the interpreters of a run that import torch (tests/test_vllm_start.py, benchmarks/vllm_warm.py).

:func:`count_in` writes a ``sitecustomize`` that appends each importing interpreter's pid to a
file; put its folder first on ``PYTHONPATH``. A forked process finds torch imported already and
appends nothing, so the count is the interpreters that paid for the import.
"""

from __future__ import annotations

from pathlib import Path

COUNTER = """
import os, sys
class _CountTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            with open({log!r}, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
        return None
sys.meta_path.insert(0, _CountTorch())
"""


def count_in(site: Path, log: Path) -> None:
    """Make ``site`` a folder whose ``sitecustomize`` counts torch's imports into ``log``."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(COUNTER.format(log=str(log)))


def imports(log: Path) -> int:
    """How many interpreters imported torch (0 where none did)."""
    return len(log.read_text().split()) if log.exists() else 0
