"""packer.profiling: the self-test in a fresh process, its stage table and slowest imports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from packer.errors import LoaderError
from packer.profiling import parse_stderr, profile
from tests.loader_fixtures import make_out


@pytest.mark.slow
def test_profile_reports_stages_and_slowest_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACKER_BUNDLE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    out.mkdir()
    m = make_out(out)
    result = profile(out, device="cpu", verify=True)
    assert result["returncode"] == 0
    names = [s["stage"] for s in result["stages"]]
    assert names[0] == "import torch" and names[-1] == "total"
    assert {"headers", "verify sha256", "map", "bundle", "check"} <= set(names)
    verify = next(s for s in result["stages"] if s["stage"] == "verify sha256")
    assert verify["bytes"] == sum(m["files"][r]["size"] for r in m["weights"]["files"])
    imports = result["slow_imports"]
    assert len(imports) == 10 and imports[0]["module"] == "torch"
    cum = [i["cumulative_us"] for i in imports]
    assert cum == sorted(cum, reverse=True) and all(i["self_us"] >= 0 for i in imports)
    assert result["device"] == "cpu" and result["tensors"] == len(m["weights"]["tensors"]) and result["verified"]
    assert result["loader"] == str(out / "packer_loader.py")
    monkeypatch.chdir(tmp_path)  # `packer profile out`, as its --help shows: a relative OUT
    assert profile(Path("out"), device="cpu")["returncode"] == 0
    # no --device: the self-test's own default (the build's cuda, cpu where CUDA is missing)
    from packer.stub import emit_loader

    emit_loader(out, {**m, "runtime": {**m["runtime"], "device": "cuda"}})
    assert profile(Path("out"))["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    emit_loader(out, m)

    rel = m["weights"]["files"][0]
    (out / rel).write_bytes((out / rel).read_bytes()[:-1])
    named = re.escape(str((out / rel).resolve()))  # the weight file by its absolute path
    with pytest.raises(LoaderError, match=rf"^packer_loader: self-test failed: {named}: \d+ bytes, the manifest says"):
        profile(out, device="cpu")


def test_profile_runs_only_the_stub_the_build_pinned(tmp_path: Path) -> None:
    from tests.built import build_dir
    from tests.hf_fixtures import llama

    llama(tmp_path / "hf")
    out = tmp_path / "out"
    build_dir(tmp_path / "hf", out)
    canary = tmp_path / "canary"
    stub = out / "packer_loader.py"
    stub.write_text(f"open({str(canary)!r}, 'w').write('ran')\n" + stub.read_text())
    with pytest.raises(LoaderError, match=f"^packer profile: not run: {re.escape(str(stub))}: sha256 .* the loader "
                                          "is not the one this build wrote$"):
        profile(out, device="cpu")
    assert not canary.exists()


def test_profile_without_a_loader(tmp_path: Path) -> None:
    with pytest.raises(LoaderError, match="packer_loader.py: missing; build first"):
        profile(tmp_path)


def test_parse_stderr() -> None:
    text = "\n".join([
        "import time: self [us] | cumulative | imported package",
        "import time:       120 |        120 |   _io",
        "import time:      5000 |    1200000 | torch",
        "import time:        30 |        300 |     json.decoder",
        '{"startup": [{"stage": "headers", "seconds": 0.01, "bytes": 100, "gbps": 0.01, "lane": 0}],'
        ' "total_s": 0.5}',
        "packer_loader: self-test passed (3 tensors on cpu)",
    ])
    stages, imports, other = parse_stderr(text)
    assert stages == [{"stage": "headers", "seconds": 0.01, "bytes": 100, "gbps": 0.01},
                      {"stage": "total", "seconds": 0.5, "bytes": 0, "gbps": None}]
    assert [i["module"] for i in imports] == ["torch", "json.decoder", "_io"]
    assert other == ["packer_loader: self-test passed (3 tensors on cpu)"]


def test_the_cli_says_where_it_checked_and_that_it_passed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    m = make_out(out)
    env = {"PACKER_BUNDLE_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "packer", "profile", str(out), "--device", "cpu"], capture_output=True,
                       text=True, timeout=300, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    n = len(m["weights"]["tensors"])
    assert r.stdout.splitlines()[-1] == (f"self-test passed on cpu: {n} tensors of {out / 'packer_loader.py'} "
                                         "(sizes, headers, every tensor and the bundle checked)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="hardware: the message is for a machine without CUDA")
def test_cuda_asked_for_without_cuda_is_one_line_in_the_command_line_s_words(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    make_out(out)
    with pytest.raises(LoaderError) as e:
        profile(out, device="cuda")
    assert str(e.value) == ("packer_loader: self-test not run: --device cuda needs CUDA, and torch sees no CUDA "
                            "device here; run with --device cpu")
