"""``packer warm`` copies only what the engine's run wrote into the cache directories packer made.

A hostile engine run (the stand-in of tests/test_warm_roots.py, with extra moves) replaces a
cache root by a link to a folder holding a secret, renames a folder prepared before the run into
a root's place, hard-links a secret file into a root, or puts a link inside one. Each capture is
refused in one line naming the root (and the variable that set it, where the root itself is at
fault), exit 1, and the secret's bytes are in no file of OUT: not in a warm state, not in any
image blob that ``packer push`` would publish.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from packer.warm.roots import CACHE_ENV
from tests.built import build_dir
from tests.hf_fixtures import VLLM_LLAMA, llama
from tests.test_warm_roots import REPO, stand_in

SECRET = b"packer-test-secret: token 7f3a9c0e51d2"
_ROOT = 'd = Path(os.environ["FLASHINFER_WORKSPACE_BASE"])\nimport shutil\n'
HOSTILE = {
    # the case: the FlashInfer cache directory replaced by a link to a folder holding token.txt
    "root replaced by a link": (_ROOT + 'shutil.rmtree(d)\nd.symlink_to(os.environ["STAND_IN_SECRETS"])\n',
                                "cache root flashinfer (FLASHINFER_WORKSPACE_BASE="),
    "root replaced by a folder prepared before the run": (
        _ROOT + 'shutil.rmtree(d)\nos.rename(os.environ["STAND_IN_PREPARED"], d)\n',
        "cache root flashinfer (FLASHINFER_WORKSPACE_BASE="),
    "a secret hard-linked into a root": (
        _ROOT + 'os.link(Path(os.environ["STAND_IN_SECRETS"]) / "token.txt", d / "kernel.so")\n', "hard links"),
    "a link inside a root": (_ROOT + '(d / "ops").symlink_to(os.environ["STAND_IN_SECRETS"])\n',
                             "a link in the engine's cache"),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("warm-links")
    llama(tmp / "hf", **VLLM_LLAMA)
    build_dir(tmp / "hf", tmp / "out")
    return tmp / "out"


def _tree(top: Path) -> dict[str, bytes]:
    return {p.relative_to(top).as_posix(): p.read_bytes() for p in sorted(top.rglob("*")) if p.is_file()}


def _warm(out: Path, tmp: Path, then: str) -> subprocess.CompletedProcess[str]:
    secrets, prepared = tmp / "secrets", tmp / "prepared"
    for d in (secrets, prepared / ".cache"):
        d.mkdir(parents=True)
    (secrets / "token.txt").write_bytes(SECRET)
    (prepared / ".cache" / "token.txt").write_bytes(SECRET)
    env: dict[str, Any] = {**os.environ, "PYTHONPATH": str(REPO), "PACKER_BUNDLE_CACHE": str(tmp / "bundle"),
                           "STAND_IN_SAW": str(tmp / "saw.json"), "STAND_IN_SECRETS": str(secrets),
                           "STAND_IN_PREPARED": str(prepared)}
    return subprocess.run([sys.executable, "-m", "packer", "warm", str(out), "--python", str(stand_in(tmp, then)),
                           "--", "--dtype", "float32"], capture_output=True, text=True, timeout=300, check=False,
                          cwd=tmp, env=env)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_capture_that_reaches_outside_its_roots_is_refused_and_nothing_of_it_is_published(
        built: Path, tmp_path: Path, case: str) -> None:
    out = tmp_path / "out"
    subprocess.run(["cp", "-a", str(built), str(out)], check=True)
    before = _tree(out)
    assert any(rel.startswith("image/blobs/sha256/") for rel in before)  # the blobs push would publish
    then, said = HOSTILE[case]
    r = _warm(out, tmp_path, then)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and said in lines[0], r.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in r.stderr
    after = _tree(out)
    assert after == before  # OUT as it was: no state, no warm image, no new blob
    assert not [rel for rel, data in after.items() if SECRET in data]  # every file and blob scanned


def test_the_refusal_names_the_root_and_the_variable_that_set_it(built: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    subprocess.run(["cp", "-a", str(built), str(out)], check=True)
    r = _warm(out, tmp_path, HOSTILE["root replaced by a link"][0])
    line = r.stderr.strip()
    assert f"cache root flashinfer ({CACHE_ENV['flashinfer']}=" in line and "symbolic link" in line, line
    assert str(tmp_path / "secrets") in line  # where the link led, said; nothing under it read
