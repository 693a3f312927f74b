"""``packer warm`` and the serving plugin against a hostile engine run and a hostile environment.

A serving pod's environment may carry packer warm's own variables (set by someone else); the
folder a hit's checked copy goes to may be one other users can change; the engine's run may
record a key that is no key, print without end, or fill its caches past any use. Each is
refused in one line, and ``packer warm`` publishes nothing when it refuses.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from packer.adapters import gate, vllm_warm
from packer.errors import WarmStateError
from packer.warm import capture, pins
from packer.warm.key import CAPTURE, CAPTURE_NONCE, capture_mark, proven_capture
from tests.built import build_dir
from tests.hf_fixtures import VLLM_LLAMA, llama
from tests.test_warm_capture_links import _tree
from tests.test_warm_roots import stand_in

REPO = Path(__file__).resolve().parents[1]


# --- a serving process that inherited packer warm's variable writes nothing ---


def test_the_capture_variable_in_a_server_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    victim = tmp_path / ".bashrc"
    victim.write_text("export PATH=/usr/bin\n")
    victim.chmod(0o600)
    monkeypatch.setenv(CAPTURE, str(victim))
    monkeypatch.setenv(CAPTURE_NONCE, secrets.token_hex(16))
    monkeypatch.delenv(vllm_warm.DECIDED, raising=False)
    monkeypatch.delenv(vllm_warm.SWITCH, raising=False)
    args = types.SimpleNamespace(load_format="auto", model=str(tmp_path))
    assert vllm_warm.before_config(args, lambda *a: tmp_path) is None  # served as before: no state looked up
    assert victim.read_text() == "export PATH=/usr/bin\n" and victim.stat().st_mode & 0o777 == 0o600
    assert capsys.readouterr().err == ("packer: warm state: PACKER_WARM_CAPTURE is set but names no key file packer "
                                       "warm made for this run (its secret is not there): ignored, nothing written\n")


def test_a_check_that_fails_in_a_server_with_the_variable_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The variable alone does not make packer's failures the engine's: only packer warm's own run raises."""
    monkeypatch.setenv(CAPTURE, str(tmp_path / "key.json"))
    monkeypatch.setenv(CAPTURE_NONCE, NONCE)

    def fails() -> None:
        raise ValueError("no device")
    assert vllm_warm._never_fatal(fails) is None
    assert "miss (packer's check failed: ValueError: no device)" in capsys.readouterr().err
    (tmp_path / "key.json").write_bytes(capture_mark(NONCE))  # packer warm's run: the failure is raised
    with pytest.raises(ValueError):
        vllm_warm._never_fatal(fails)


def test_only_the_file_holding_the_runs_secret_is_the_capture(tmp_path: Path) -> None:
    nonce = secrets.token_hex(16)
    key = tmp_path / "key.json"
    key.write_bytes(capture_mark(nonce))
    assert proven_capture(str(key), nonce) == key
    assert proven_capture(str(key), secrets.token_hex(16)) is None  # another run's secret
    assert proven_capture(str(key), "") is None and proven_capture(str(key), nonce.upper()) is None
    (tmp_path / "link").symlink_to(key)
    assert proven_capture(str(tmp_path / "link"), nonce) is None  # never through a link
    key.write_bytes(capture_mark(nonce) + b"more")
    assert proven_capture(str(key), nonce) is None
    assert proven_capture(str(tmp_path / "absent"), nonce) is None


# --- the checked copy goes where no other user can swap it ---


@pytest.mark.parametrize("mode, refused", [(0o777, True), (0o770, True), (0o1777, False), (0o700, False)])
def test_the_warm_dir_must_be_one_no_other_user_can_change(mode: int, refused: bool, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    base = tmp_path / "warm"
    base.mkdir()
    base.chmod(mode)
    monkeypatch.setenv("PACKER_WARM_DIR", str(base))
    if refused:
        with pytest.raises(WarmStateError) as e:
            gate._private_dir()
        assert str(e.value) == (f"PACKER_WARM_DIR={base}: not a folder of this user or root that only they can "
                                "change (or with the sticky bit, as /tmp): another user could swap the checked "
                                "copy of the warm state after its check; refused")
        assert list(base.iterdir()) == []
    else:
        made = gate._private_dir()
        assert made.parent == base and made.stat().st_mode & 0o777 == 0o700


# --- the key the run recorded is checked whole before anything is published ---

NONCE = "0" * 32
GOOD = {"config": "c", "model_path": "/m", "engine": "vllm", "device": {"kind": "cpu", "arch": "x86_64"}}


@pytest.mark.parametrize("key, said", [
    (None, "the engine's run recorded no key"),
    ({k: v for k, v in GOOD.items() if k != "model_path"}, "the recorded key names no model path"),
    ({**GOOD, "device": "cpu"}, "is not a table of kind and arch"),
    ({**GOOD, "device": {"kind": "../x", "arch": "y"}}, "do not make a plain directory name"),
    ({**GOOD, "x": float("nan")}, "Out of range float values are not JSON compliant"),
    ({**GOOD, "x": "\ud800"}, "surrogates not allowed"),
], ids=["no key", "no model path", "device a string", "device kind a path", "NaN", "a lone surrogate"])
def test_a_recorded_key_that_is_no_key_is_one_line(key: dict[str, Any] | None, said: str, tmp_path: Path) -> None:
    path = tmp_path / "key.json"
    path.write_bytes(capture_mark(NONCE) if key is None else json.dumps(key).encode())
    with pytest.raises(WarmStateError) as e:
        capture._read_key(path, capture_mark(NONCE))
    assert str(e.value).startswith(f"{path}: ") and said in str(e.value) and "\n" not in str(e.value), e.value


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("warm-hostile")
    llama(tmp / "hf", **VLLM_LLAMA)
    build_dir(tmp / "hf", tmp / "out")
    return tmp / "out"


def _warm(out: Path, tmp: Path, then: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PACKER_BUNDLE_CACHE": str(tmp / "bundle"),
           "STAND_IN_SAW": str(tmp / "saw.json")}
    return subprocess.run([sys.executable, "-m", "packer", "warm", str(out), "--python", str(stand_in(tmp, then)),
                           "--json", "--", "--dtype", "float32"], capture_output=True, text=True, timeout=300,
                          check=False, cwd=tmp, env=env)


def test_a_key_without_a_model_path_publishes_nothing(built: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    subprocess.run(["cp", "-a", str(built), str(out)], check=True)
    before = _tree(out)
    then = ('k = json.loads(Path(os.environ["PACKER_WARM_CAPTURE"]).read_text()); del k["model_path"]\n'
            'Path(os.environ["PACKER_WARM_CAPTURE"]).write_text(json.dumps(k))\n')
    r = _warm(out, tmp_path, then)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].endswith("key.json: the recorded key names no model path"), lines[0]
    assert _tree(out) == before


def test_an_engine_that_prints_without_end_is_read_by_its_tail(built: Path, tmp_path: Path) -> None:
    """64 MiB on stdout and on stderr: the report (its last line) is found, the rest is not held."""
    out = tmp_path / "out"
    subprocess.run(["cp", "-a", str(built), str(out)], check=True)
    then = ('for _ in range(64):\n    sys.stdout.write("x" * (1 << 20) + "\\n")\n'
            '    sys.stderr.write("y" * (1 << 20) + "\\n")\nsys.stdout.flush()\n')
    r = _warm(out, tmp_path, then)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["token_ids"] == [1, 2, 3, 4]


def test_a_failed_run_names_its_last_line_from_the_tail(built: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    subprocess.run(["cp", "-a", str(built), str(out)], check=True)
    then = 'sys.stderr.write("z" * (8 << 20) + "\\nRuntimeError: no device\\n"); sys.exit(5)\n'
    r = _warm(out, tmp_path, then)
    assert r.returncode == 1 and r.stderr.strip().endswith(
        "the engine's warm run failed (exit 5): RuntimeError: no device"), r.stderr[-500:]


# --- what a capture may copy is bounded, and named as it can be written ---


def test_more_files_than_a_state_holds_are_refused_before_a_copy(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    top = tmp_path / "vllm"
    top.mkdir()
    for i in range(4):
        (top / f"f{i}").write_bytes(b"x")
    monkeypatch.setattr(pins, "MAX_STATE_FILES", 3)
    with pytest.raises(WarmStateError) as e:
        pins.collect({"vllm": top})
    assert "the engine's cache holds more than 3 files" in str(e.value) and "refused before anything is copied" in str(
        e.value)


def test_a_state_over_its_bytes_is_refused_before_a_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    top = tmp_path / "vllm"
    top.mkdir()
    with (top / "sparse").open("wb") as f:  # no disk used: only its size counts
        f.truncate(2 << 30)
    monkeypatch.setattr(pins, "MAX_STATE_BYTES", 1 << 30)
    with pytest.raises(WarmStateError) as e:
        pins.collect({"vllm": top})
    assert "or 1 GiB (at " in str(e.value), e.value


def test_a_cache_file_name_that_is_not_utf8_is_refused_by_name(tmp_path: Path) -> None:
    top = tmp_path / "vllm"
    top.mkdir()
    (top / os.fsdecode(b"k\xffernel")).write_bytes(b"x")
    with pytest.raises(WarmStateError) as e:
        pins.collect({"vllm": top})
    assert "a name that is not printable UTF-8 in the engine's cache" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_warm_folder_that_is_a_link_is_not_the_builds(built: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``packer verify`` refuses ``OUT/warm`` as a link; the serving plugin does not follow it either."""
    out = tmp_path / "out"
    subprocess.run(["cp", "-a", str(built), str(out)], check=True)
    (tmp_path / "elsewhere" / "vllm-cpu-x86_64").mkdir(parents=True)
    (out / "warm").symlink_to(tmp_path / "elsewhere")
    args = types.SimpleNamespace(model=str(out), model_loader_extra_config=None)
    assert vllm_warm._find_state(args, "vllm-cpu-x86_64", "", lambda *a: out / "packer_loader.py") is None
    assert capsys.readouterr().err.strip().endswith(
        f"miss ({out / 'warm'} is a link, not the build's own folder; refused)")


def test_a_process_that_left_the_runs_session_does_not_outlive_it(built: Path, tmp_path: Path) -> None:
    """A double fork into a session of its own (setsid), as a daemon does: the run's reaper kills it."""
    out = tmp_path / "out"
    subprocess.run(["cp", "-a", str(built), str(out)], check=True)
    pidfile = tmp_path / "daemon.pid"
    then = (f'if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n'
            f'        Path({str(pidfile)!r}).write_text(str(os.getpid()))\n        import time; time.sleep(120)\n'
            f'    os._exit(0)\nos.wait()\n'
            f'import time\nwhile not Path({str(pidfile)!r}).exists():\n    time.sleep(0.05)\n')
    r = _warm(out, tmp_path, then)
    assert r.returncode == 0, r.stderr[-2000:]
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_hard_link_between_a_cache_file_and_a_lock_inside_the_roots_is_no_outside_link(tmp_path: Path) -> None:
    """Lock files are not shipped, but their names lie inside the roots: the file is the run's own."""
    top = tmp_path / "vllm"
    top.mkdir()
    (top / "kernel.so").write_bytes(b"x")
    os.link(top / "kernel.so", top / "kernel.so.lock")
    assert sorted(pins.collect({"vllm": top})) == ["vllm/kernel.so"]
    os.link(top / "kernel.so", tmp_path / "outside")  # a third name, outside: refused as before
    with pytest.raises(WarmStateError, match="has 3 hard links, 1 of them outside"):
        pins.collect({"vllm": top})
