"""``packer profile OUT``: run the emitted loader's self-test in a fresh process.

The loader prints its stage table as one JSON line (``PACKER_STARTUP_LOG=json``) and
``python -X importtime`` adds one line per import; both arrive on stderr and are parsed here.
OUT is an input: a FIFO or device anywhere in it is refused before the child starts, which
would block on it; the stub runs only when it is the one the build's ``manifest.json`` pins
(the trust gate's :func:`~packer.adapters.gate.check_stub`); each report line is parsed with the
bounds of :mod:`packer.reading`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from packer.adapters.gate import check_stub
from packer.errors import EngineAdapterError, LoaderError
from packer.reading import REPORT, irregular_entries, not_regular, parse_json
from packer.runtime.env import ArtifactMismatchError
from packer.util.formats import LOADER_NAME
from packer.util.show import shell_word

TOP_IMPORTS = 10
_STAGE_KEYS = ("stage", "seconds", "bytes", "gbps")


def parse_stderr(text: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """Split the self-test's stderr into stages, imports and the remaining lines.

    Returns:
        ``(stages, imports sorted by cumulative time, other lines)``.
    """
    stages: list[dict[str, Any]] = []
    imports: list[dict[str, Any]] = []
    other: list[str] = []
    total: float | None = None
    for line in text.splitlines():
        if line.startswith("import time:"):
            parts = [p.strip() for p in line[len("import time:"):].split("|")]
            if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit():
                imports.append({"module": parts[2], "self_us": int(parts[0]),
                                "cumulative_us": int(parts[1])})
            continue
        rec = _json_line(line)
        if rec is not None and "startup" in rec:
            stages += [{k: s.get(k) for k in _STAGE_KEYS} for s in rec["startup"]]
            total = rec.get("total_s")  # since the process's first stage: the last line's is the whole
        elif line.strip():
            other.append(line)
    if stages:
        stages.append({"stage": "total", "seconds": total, "bytes": 0, "gbps": None})
    imports.sort(key=lambda r: (-r["cumulative_us"], r["module"]))
    return stages, imports, other


def _json_line(line: str) -> dict[str, Any] | None:
    if not line.startswith("{"):
        return None
    try:
        rec = parse_json(line, REPORT, where="the self-test's report", error=LoaderError)
    except LoaderError:
        return None
    return rec if isinstance(rec, dict) else None


def profile(out_dir: Path, *, device: str | None = None, verify: bool = False,
            timeout: float = 900.0) -> dict[str, Any]:
    """Run ``OUT/packer_loader.py --selftest`` under ``-X importtime`` and collect its table.

    Args:
        out_dir: a build output directory.
        device: ``cpu``, ``cuda`` or ``cuda:N``; None: the self-test's default (the recipe's
            device, cpu where CUDA is not available), so profile and ``--selftest`` agree.
        verify: also check sha256 of every file.
        timeout: seconds before the self-test is given up.

    Returns:
        ``{"stages": [...], "slow_imports": [top 10 by cumulative us], "returncode": 0,
        "device": the device the self-test ran on, "tensors": how many it checked, "loader": the
        stub it ran, "verified": whether every file's sha256 was checked too}``.

    Raises:
        LoaderError: no loader in ``out_dir``, or the self-test failed (its last stderr line).
    """
    loader = Path(out_dir).absolute() / LOADER_NAME  # the child runs in OUT: a relative path would name OUT twice
    if not loader.is_file():
        raise LoaderError(f"{loader}: missing; build first with `packer build -o {shell_word(str(out_dir))}`")
    if odd := irregular_entries(loader.parent):  # the self-test would block on the first one it opens
        raise not_regular(odd[0], os.stat(odd[0]).st_mode, LoaderError)
    try:  # the self-test runs the stub: only the one this build's manifest pins
        check_stub(loader)
    except (EngineAdapterError, ArtifactMismatchError) as e:
        raise LoaderError(f"packer profile: not run: {e}") from None
    cmd = [sys.executable, "-X", "importtime", str(loader), "--selftest", *(["--device", device] if device else [])]
    if verify:
        cmd.append("--verify")
    env = {**os.environ, "PACKER_STARTUP_LOG": "json"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                              cwd=loader.parent, check=False)
    except subprocess.TimeoutExpired:
        raise LoaderError(f"{loader}: self-test did not finish in {timeout:.0f}s") from None
    stages, imports, other = parse_stderr(proc.stderr)
    if proc.returncode != 0:
        last = other[-1] if other else f"{loader}: self-test exited with {proc.returncode}"
        raise LoaderError(last)
    passed = re.search(r"self-test passed \((\d+) tensors.* on (\S+)\)$", proc.stderr, re.M)
    return {"stages": stages, "slow_imports": imports[:TOP_IMPORTS], "returncode": proc.returncode,
            "device": passed.group(2) if passed else None, "tensors": int(passed.group(1)) if passed else None,
            "loader": str(loader), "verified": verify}
