"""`packer convert` reads untrusted input in an isolated child: limits, no network."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from packer.demo import write_demo


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("demo-src")
    write_demo(d)
    return d


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "packer", *args], capture_output=True, text=True, check=False,
                          env={**os.environ, **(env or {})})


def test_audit_hook_refuses_sockets() -> None:
    code = ("import socket\nfrom packer.weights.sandbox import _isolate\n"
            "_isolate({'as': 2**34, 'cpu': 60, 'fsize': 2**30})\n"
            "try:\n    socket.socket()\nexcept PermissionError as e:\n    print('refused', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and proc.stdout.startswith("refused"), proc.stderr


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_convert_opens_no_socket(demo_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "trace"
    proc = subprocess.run(["strace", "-f", "-qq", "-e", "trace=socket,connect", "-o", str(log),
                           sys.executable, "-m", "packer", "convert", str(demo_dir / "pytorch_model.bin"),
                           "-o", str(tmp_path / "out")], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    calls = [line for line in log.read_text().splitlines() if "socket(" in line or "connect(" in line]
    assert calls == []
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_sandboxed_and_in_process_conversions_agree(demo_dir: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    assert run("convert", str(demo_dir / "pytorch_model.bin"), "-o", str(a)).returncode == 0
    assert run("convert", "--no-sandbox", str(demo_dir / "pytorch_model.bin"), "-o", str(b)).returncode == 0
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_limit_hit_in_child_is_one_line_and_leaves_nothing(demo_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run("convert", str(demo_dir / "pytorch_model.bin"), "-o", str(out), env={"PACKER_SANDBOX_FSIZE": "100000"})
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert not out.exists() or not any(p.suffix == ".safetensors" for p in out.iterdir())


@pytest.mark.parametrize("var", ["PACKER_SANDBOX_AS", "PACKER_SANDBOX_CPU", "PACKER_SANDBOX_FSIZE"])
@pytest.mark.parametrize("value", ["inf", "nan", "-5", "0", "1e9", "junk", "\x1b[31mred"])
def test_a_sandbox_limit_that_is_no_number_is_one_line_naming_it(var: str, value: str, demo_dir: Path,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run("convert", str(demo_dir / "pytorch_model.bin"), "-o", str(out), env={var: value})
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {var}: expected a whole number of "), proc.stderr
    assert "\x1b" not in proc.stderr and not out.exists()


_GOOD = {"files": [{"path": "model.safetensors", "size": 8, "sha256": "ab" * 32}], "section": {}, "bytes": 8,
         "notes": [], "digests": {}}


@pytest.mark.parametrize(("reply", "why"), [
    ({**_GOOD, "files": [{"path": "m", "size": 8, "sha256": "", "offset": "0"}]},
     r"files\[0\]\.offset: expected a size in bytes"),
    ({**_GOOD, "files": [{"path": "m", "size": -1, "sha256": ""}]}, r"files\[0\]\.size: expected a size"),
    ({**_GOOD, "files": [_GOOD["files"][0]] * 2}, "names a file twice"),
    ({**_GOOD, "files": {"path": "m"}}, "files: expected an array"),
    ({k: v for k, v in _GOOD.items() if k != "bytes"}, r"bytes: expected .*\(required\)"),
    ({**_GOOD, "digests": {"layer:m": 1}}, "digests.*: expected a string"),
    ({"error": ["not", "a", "string"], "type": "WeightsError"}, "error: expected a string"),
])
def test_a_malformed_reply_from_the_child_is_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reply: dict[str, object], why: str
) -> None:
    """The child read the input: its reply is checked field by field before anything is built from it."""
    import json

    import packer.weights.sandbox as sandbox
    from packer.errors import CheckpointError
    from packer.recipe import WeightsConfig
    from packer.weights.options import ConvertOptions

    done = subprocess.CompletedProcess(["child"], 0, json.dumps(reply), "")
    monkeypatch.setattr(sandbox, "_run_child", lambda request, progress: (done, 0))
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=f"the reader's reply: .*{why}"):
        sandbox.convert_sandboxed(tmp_path / "pytorch_model.bin", tmp_path / "out", WeightsConfig(), ConvertOptions())


def test_a_well_formed_reply_keeps_only_the_fields_of_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    import packer.weights.sandbox as sandbox
    from packer.recipe import WeightsConfig
    from packer.weights.options import ConvertOptions

    extra = {**_GOOD, "files": [{**_GOOD["files"][0], "executable": True}]}  # a key no file entry has
    done = subprocess.CompletedProcess(["child"], 0, json.dumps(extra), "")
    monkeypatch.setattr(sandbox, "_run_child", lambda request, progress: (done, 0))
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    out = sandbox.convert_sandboxed(tmp_path / "pytorch_model.bin", tmp_path / "out", WeightsConfig(), ConvertOptions())
    assert [(f.path, f.size, f.blob, f.offset) for f in out.files] == [("model.safetensors", 8, "", 0)]
