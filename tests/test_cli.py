"""The command line contract: exit codes, one-line errors, --json, and no torch for --help."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

import click
import pytest

REPO = Path(__file__).resolve().parents[1]


def packer(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "packer", *args], capture_output=True, text=True,
                          cwd=cwd, check=False)


def test_help_does_not_import_torch() -> None:
    code = ("import sys\nfrom packer.cli import main\nsys.argv=['packer','--help']\n"
            "try:\n main()\nexcept SystemExit:\n pass\n")
    code += "assert 'torch' not in sys.modules, 'torch imported'\nassert 'safetensors' not in sys.modules\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "Examples" in proc.stdout


@pytest.mark.parametrize("command", ["build", "convert", "inspect", "bundle", "unbundle", "verify", "profile", "push",
                                     "stream", "demo-model"])
def test_every_command_has_help_with_examples(command: str) -> None:
    proc = packer(command, "--help")
    assert proc.returncode == 0 and "Example" in proc.stdout and "--json" in proc.stdout


def test_usage_error_exits_2(tmp_path: Path) -> None:
    assert packer("build", "--no-such-flag").returncode == 2
    assert packer("verify").returncode == 2
    assert packer("frobnicate").returncode == 2


def test_inspect_of_a_directory_says_which_file_to_name(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "pytorch_model.bin").write_bytes(b"x")
    proc = packer("inspect", "src", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("error: src: is a directory; inspect reads one checkpoint file, "
                                   "e.g. src/pytorch_model.bin")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "manifest.json").write_text("{}")
    proc = packer("inspect", "out", cwd=tmp_path)
    assert proc.returncode == 1 and proc.stderr.strip() == (
        "error: out: is a directory; inspect reads one file: name one of this build's weight files, "
        "e.g. out/weights/model.safetensors")


def test_build_of_a_model_directory_builds_it_with_the_recipe_defaults(tmp_path: Path) -> None:
    from packer.demo import write_demo
    from packer.verifying import verify

    src = tmp_path / "My Model (v2)"
    src.mkdir()
    write_demo(src)
    proc = packer("build", src.name, "-o", "out", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_bytes())
    assert (manifest["recipe"]["name"], manifest["recipe"]["version"]) == ("my-model-v2", "0.0.0")
    assert manifest["source"]["uri"] == str(src)
    assert json.loads(proc.stdout)["image"]["tag"] == "my-model-v2:0.0.0"
    verify(tmp_path / "out")


@pytest.mark.parametrize(
    ("args", "line"),
    [(["convert", "nowhere.bin", "-o", "x"], "error: nowhere.bin: does not exist"),
     (["inspect", "."], "error: .: is a directory; inspect reads one checkpoint file, e.g. model.safetensors"),
     (["verify", "nowhere"], "error: nowhere: does not exist"),
     (["bundle", "f.txt", "-o", "x.tar.zst"], "error: f.txt: is not a directory")],
)
def test_a_missing_input_is_bad_input_exit_1(tmp_path: Path, args: list[str], line: str) -> None:
    (tmp_path / "f.txt").write_text("x")
    proc = packer(*args, cwd=tmp_path)
    assert proc.returncode == 1 and proc.stderr.strip() == line


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ('name = "x"\nversion = "1"\nsource = "demo"\ncolour = 1\n', "colour: unknown key"),
        ('name = "x"\nversion = "1"\nsource = "demo"\n[weights]\nmax_shard_size = 12\n',
         'weights.max_shard_size: expected a size like "5GB", got 12'),
        ('name = "x"\nversion = "1"\n', "source: missing required key"),
        ('name = "x"\nversion = "1"\nsource = "./nowhere"\n', "does not exist"),
        ('name = "x"\nversion = \n', "line 2"),
        ('name = "x\\nRUN id"\nversion = "1"\nsource = "demo"\n', "name: character '\\n' (U+000A) is not allowed"),
        ('name = "x"\nversion = "1"\nsource = "demo"\n[image]\nworkdir = "/srv\\u001b[2J"\n',
         "image.workdir: character '\\x1b' (U+001B) is not allowed"),
    ],
    ids=["unknown-key", "wrong-type", "missing-key", "missing-source", "bad-toml", "newline", "escape"],
)
def test_bad_recipe_is_one_line_exit_1_and_writes_nothing(tmp_path: Path, body: str, fragment: str) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text(body)
    proc = packer("build", str(recipe), "-o", str(tmp_path / "out"))
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.toml"]


def test_debug_shows_traceback(tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "x"\nversion = "1"\nsource = "demo"\ncolour = 1\n')
    proc = packer("build", str(recipe), "-o", str(tmp_path / "out"), "--debug")
    assert proc.returncode == 1 and "Traceback" in proc.stderr


def test_build_json_and_verify(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = packer("build", str(REPO / "recipes" / "demo.toml"), "-o", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)  # only JSON on stdout
    assert summary["out"] == str(out) and summary["files"] >= 5
    names = [s["stage"] for s in summary["stages"]]
    assert names[:4] == ["source", "weights", "bundle", "loader"] and "image" in names and "verify" in names
    assert "stage" in proc.stderr and "total" in proc.stderr  # the stage table went to stderr

    ok = packer("verify", str(out), "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"] is True
    checked = json.loads(ok.stdout)
    assert summary["files"] == checked["files"] and summary["bytes"] == checked["bytes"]  # counted alike
    du = subprocess.run(["du", "-s", "-B1", str(out)], capture_output=True, text=True, check=True).stdout
    assert checked["disk_bytes"] == int(du.split()[0]) and summary["disk_bytes"] > 0
    index = json.loads((out / "image" / "index.json").read_bytes())
    assert summary["image"]["manifest_digest"] == index["manifests"][0]["digest"]
    assert summary["image"]["tag"] == "packer-demo:0.1.0"
    loader = out / "packer_loader.py"
    data = bytearray(loader.read_bytes())
    data[-2] ^= 1
    loader.write_bytes(bytes(data))
    bad = packer("verify", str(out))
    assert bad.returncode == 1 and "packer_loader.py" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_default_build_goes_to_dist_and_prints_the_stage_table(tmp_path: Path) -> None:
    proc = packer("build", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "dist" / "manifest.json").is_file()
    table = proc.stdout
    for stage in ("source", "weights", "bundle", "loader", "image", "verify", "total"):
        assert stage in table
    assert "GB/s" in table


def test_quiet_prints_nothing(tmp_path: Path) -> None:
    proc = packer("build", "-q", "-o", str(tmp_path / "o"))
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""


def test_build_dry_run_prints_plan_and_writes_nothing(tmp_path: Path) -> None:
    proc = packer("build", "--dry-run", "-o", str(tmp_path / "o"))
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert "model.embed_tokens.weight" in plan["weights"]["tensors"]
    assert "tokenizer.json" in [m["name"] for m in plan["bundle"]["members"]]
    layers = {layer["name"]: layer for layer in plan["image"]["plan"]["layers"]}
    assert list(layers) == ["weights model.safetensors", "model files", "bundle", "loader"]
    tensor_bytes = max(t["data_offsets"][1] for t in plan["weights"]["tensors"].values())
    assert layers["weights model.safetensors"]["size"] == tensor_bytes > 0
    members = {m["name"]: m for m in plan["bundle"]["members"]}
    assert "/models/tokenizer.json" in layers["model files"]["files"]
    assert layers["model files"]["known_bytes"] == sum(m["size"] for m in members.values())
    assert layers["model files"]["size"] is None  # the chunk table is sized when written
    assert layers["model files"]["sized_when_written"] == ["/models/packer-chunks.json"]
    assert members["config.json"]["source"] == "config.json"  # not a scratch path that is gone after the run
    assert proc.stderr.splitlines()[0] == "note: source layout: model; components: model (., transformers)"
    assert list(tmp_path.iterdir()) == []


def test_build_dry_run_json_is_one_document_on_stdout(tmp_path: Path) -> None:
    proc = packer("build", "--dry-run", "--json", "-o", str(tmp_path / "o"))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["dry_run"] is True and "model.embed_tokens.weight" in summary["plan"]["weights"]["tensors"]
    assert summary["notes"][0].startswith("source layout: model")
    assert "{" not in proc.stderr  # the plan is not on stderr


def test_json_failure_is_a_document_on_stdout(tmp_path: Path) -> None:
    """A job parsing --json reads a document on failure too: the error and the exit code."""
    for args, code in ((("verify", str(tmp_path / "missing")), 1), (("verify", str(tmp_path)), 1),
                       (("convert", str(tmp_path / "x\x1b[2J.bin"), "-o", str(tmp_path / "o")), 1)):
        proc = packer(*args, "--json")
        assert proc.returncode == code, proc.stderr
        doc = json.loads(proc.stdout)
        assert set(doc) == {"error", "exit_code"} and doc["exit_code"] == code
        assert proc.stderr.strip() == f"error: {doc['error']}"  # the same one line, escaped alike
        assert "\x1b" not in proc.stdout


def test_malformed_shard_size_is_a_usage_error(tmp_path: Path) -> None:
    ckpt = tmp_path / "c.bin"
    ckpt.write_bytes(b"")
    proc = packer("convert", str(ckpt), "-o", str(tmp_path / "o"), "--max-shard-size", "12")
    assert proc.returncode == 2 and "'--max-shard-size': expected a size like \"5GB\"" in proc.stderr
    assert packer("convert", str(ckpt), "-o", str(tmp_path / "o"), "--dtype", "int8").returncode == 2


def test_a_plain_pickle_is_refused_with_advice_that_works(tmp_path: Path) -> None:
    import pickle

    import torch
    from safetensors.torch import load_file

    want = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    raw = tmp_path / "raw.pkl"
    with raw.open("wb") as f:
        pickle.dump(want, f)  # pickle.dump of tensors: not torch.save's format
    proc = packer("convert", str(raw), "-o", str(tmp_path / "o"))
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
    assert "if the file was written with pickle.dump, not torch.save, re-save it" in proc.stderr
    # the advice, followed (where the file was made: this test made it, so it may unpickle it)
    with raw.open("rb") as f:
        torch.save(pickle.load(f), tmp_path / "resaved.bin")
    ok = packer("convert", str(tmp_path / "resaved.bin"), "-o", str(tmp_path / "o"))
    assert ok.returncode == 0, ok.stderr
    assert torch.equal(load_file(tmp_path / "o" / "model.safetensors")["w"], want["w"])


def test_library_does_not_import_click() -> None:
    code = ("import sys, packer.building, packer.manifest, packer.recipe, packer.source\n"
            "assert 'click' not in sys.modules\nassert 'torch' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_profile_prints_the_loader_stage_table(tmp_path: Path) -> None:
    assert packer("build", "-q", "-o", str(tmp_path / "o")).returncode == 0
    proc = packer("profile", str(tmp_path / "o"))
    assert proc.returncode == 0, proc.stderr
    for stage in ("import torch", "headers", "check", "total", "slowest imports"):
        assert stage in proc.stdout
    report = json.loads(packer("profile", str(tmp_path / "o"), "--json").stdout)
    assert report["returncode"] == 0 and report["stages"][-1]["stage"] == "total"


def test_inspect_shows_the_alias_map_a_conversion_recorded(tmp_path: Path) -> None:
    import torch

    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    torch.save({"embed.weight": w, "lm_head.weight": w}, tmp_path / "tied.pt")
    assert packer("convert", str(tmp_path / "tied.pt"), "-o", str(tmp_path / "out"), "-q").returncode == 0
    proc = packer("inspect", str(tmp_path / "out" / "model.safetensors"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].endswith(": safetensors, 1 tensor")
    assert "  embed.weight  F32  [3, 4]  48 B" in lines
    assert '  metadata packer.aliases = {"lm_head.weight":"embed.weight"}' in lines


@pytest.mark.parametrize("space", ["\u00a0", "\u2003", "\u3000"], ids=["nbsp", "em-space", "ideographic"])
def test_convert_takes_a_directory_named_with_a_non_ascii_space(tmp_path: Path, space: str) -> None:
    """A path on the command line is a file name, not a recipe string: any space a name holds is
    taken (and shown escaped), while a recipe's own strings still refuse such characters."""
    import torch
    from safetensors.torch import load_file

    from tests.weights_validate import validate_output

    want = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    src = tmp_path / f"my{space}model{space}dir"
    src.mkdir()
    torch.save(want, src / "pytorch_model.bin")
    out = tmp_path / f"out{space}x"
    proc = packer("convert", str(src), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    validate_output(out)
    assert torch.equal(load_file(out / "model.safetensors")["w"], want["w"])
    escaped = f"\\u{ord(space):04x}" if ord(space) > 0xFF else f"\\x{ord(space):02x}"
    assert f"{escaped}x/model.safetensors" in proc.stdout and space not in proc.stdout  # shown escaped
    # the same character in a recipe string is still refused
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'name = "a{space}b"\nversion = "1"\nsource = "demo"\n')
    bad = packer("build", str(recipe), "-o", str(tmp_path / "o"))
    assert bad.returncode == 1 and f"name: character '{escaped}' (U+{ord(space):04X}) is not allowed" in bad.stderr


# -- --json: one document on stdout for every exit of every command ------------------------------

# the library function each command calls, made to fail unexpectedly
CALLS = {"build": ("packer.building", "build"), "convert": ("packer.weights.sandbox", "convert_cli"),
         "inspect": ("packer.checkpoint", "inspect_checkpoint"), "bundle": ("packer.bundle", "bundle_to_file"),
         "unbundle": ("packer.bundle", "unbundle"), "verify": ("packer.verifying", "verify"),
         "profile": ("packer.profiling", "profile"), "warm": ("packer.warm_step", "warm_output"),
         "push": ("packer.pushing", "push"), "stream": ("packer.stream", "lay_out"),
         "demo-model": ("packer.demo", "write_demo_model")}
# a command whose argument is no path: what it refuses, and the end of its one line
REFUSED = {"stream": (["oci://127.0.0.1:9/nowhere@sha256:" + "0" * 64], "Connection refused)"),
           "demo-model": (["/proc/nowhere"], "cannot write /proc/nowhere: No such file or directory")}


def _commands() -> list[str]:
    from packer.cli import main

    return sorted(main.commands)


def _command(name: str) -> click.Command:
    from packer.cli import main

    return main.commands[name]


def _invoke(args: list[str]) -> tuple[int, str, str]:
    from click.testing import CliRunner

    from packer.cli import main

    result = CliRunner().invoke(main, args)
    return result.exit_code, result.stdout, result.stderr


def _one_document(stdout: str, code: int) -> dict[str, Any]:
    doc = json.loads(stdout)  # "Extra data" if a second document (or anything else) follows
    assert doc == {"error": doc["error"], "exit_code": code}, stdout
    assert isinstance(doc["error"], str) and doc["error"]
    return doc


def _arguments(name: str, tmp_path: Path, *, exist: bool) -> list[str]:
    """Arguments and required options for ``name``: inputs that exist (of the kind each takes),
    and only the required arguments; or every one-word argument naming nothing."""
    from packer.cli import InputPath

    args: list[str] = []
    for param in _command(name).params:
        if isinstance(param, click.Argument) and param.nargs == 1 and (param.required or not exist):
            if not exist:
                args.append(str(tmp_path / "nowhere"))
            elif isinstance(param.type, InputPath) and not param.type.file_okay:
                (tmp_path / "dir").mkdir(exist_ok=True)
                args.append(str(tmp_path / "dir"))
            elif isinstance(param.type, InputPath):
                (tmp_path / "file.bin").write_bytes(b"")
                args.append(str(tmp_path / "file.bin"))
            else:
                args.append("registry.example/x:1")
        elif isinstance(param, click.Option) and param.required:
            args += [param.opts[0], str(tmp_path / "out")]
    return args


def _bad_option(name: str) -> list[str]:
    """An unknown option; where the command passes those on (warm: the engine's flags), a known
    option with a value of the wrong kind."""
    command = _command(name)
    if not command.context_settings.get("ignore_unknown_options"):
        return ["--no-such-option"]
    typed = (click.types.FloatParamType, click.types.IntParamType, click.Choice)
    option = next(p for p in command.params if isinstance(p, click.Option) and isinstance(p.type, typed))
    return [option.opts[0], "not-a-value"]


def _missing_argument(name: str) -> list[str]:
    """No argument where one is required; else an option's value left out (build's -o)."""
    params = _command(name).params
    if any(isinstance(p, click.Argument) and p.required for p in params):
        return []
    option = next(p for p in params if isinstance(p, click.Option) and not p.is_flag and p.nargs == 1)
    return [option.opts[0]]


def test_every_command_is_covered() -> None:
    assert set(CALLS) == set(_commands())


@pytest.mark.parametrize("where", ["after", "last"])
@pytest.mark.parametrize("name", _commands())
def test_json_usage_errors_are_one_document_exit_2(tmp_path: Path, name: str, where: str) -> None:
    """An unknown option or a missing argument fails in click, before --json is parsed."""
    for words in (_bad_option(name), _missing_argument(name)):
        args = [name, "--json", *words] if where == "after" else [name, *words, "--json"]
        if words == _missing_argument(name) and where == "last" and words:  # -o --json: --json is -o's value
            continue
        code, stdout, stderr = _invoke(args)
        assert code == 2, (args, stdout, stderr)
        doc = _one_document(stdout, 2)
        assert f"Error: {doc['error']}" in stderr  # the same message, on stderr
    code, stdout, _ = _invoke(["--json", name, *_arguments(name, tmp_path, exist=True)])  # before the command
    _one_document(stdout, 2)


@pytest.mark.parametrize("name", _commands())
def test_json_refused_input_is_one_document_exit_1(tmp_path: Path, name: str) -> None:
    args, end = REFUSED.get(name, (_arguments(name, tmp_path, exist=False), "nowhere: does not exist"))
    code, stdout, stderr = _invoke([name, *args, "--json"])
    assert code == 1, (stdout, stderr)
    doc = _one_document(stdout, 1)
    assert doc["error"].endswith(end) and stderr.strip() == f"error: {doc['error']}"


@pytest.mark.parametrize("name", _commands())
def test_an_internal_error_is_one_line_and_with_json_one_document_exit_1(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    import importlib

    def boom(*_args: object, **_kwargs: object) -> NoReturn:
        raise RuntimeError("boom\nnote: forged")

    module, function = CALLS[name]
    monkeypatch.setattr(importlib.import_module(module), function, boom)
    args = [name, *_arguments(name, tmp_path, exist=True)]
    code, stdout, stderr = _invoke([*args, "--json"])
    assert code == 1, (stdout, stderr)
    doc = _one_document(stdout, 1)
    assert doc["error"].startswith("internal error: RuntimeError: boom\\nnote: forged")
    assert stderr.strip() == f"error: {doc['error']}" and "Traceback" not in stderr
    code, stdout, stderr = _invoke([*args, "--debug"])
    assert code == 1 and stdout == "" and "Traceback" in stderr and "RuntimeError: boom" in stderr


def test_the_entry_point_reports_usage_and_internal_errors_as_one_document(tmp_path: Path) -> None:
    for args in (["--json", "frobnicate"], ["verify", "--json"], ["build", "--no-such", "--json"]):
        proc = packer(*args)
        assert proc.returncode == 2 and _one_document(proc.stdout, 2)["error"] in proc.stderr, args
    code = ("import sys, packer.verifying\n"
            "def boom(*a, **k):\n raise KeyError('x')\n"
            "packer.verifying.verify = boom\nfrom packer.__main__ import run\n"
            f"sys.argv = ['packer', 'verify', {str(tmp_path)!r}, '--json']\nrun()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "KeyError" in _one_document(proc.stdout, 1)["error"], proc.stderr


def test_a_usage_error_shows_the_words_it_quotes_escaped() -> None:
    for args in (["verify", "a", "b\x1b[2J\nnote: ok\udcff", "--json"], ["--\x1b]0;t\x07", "--json"]):
        code, stdout, stderr = _invoke(args)
        assert code == 2 and "\x1b" not in stdout + stderr and "\nnote: ok" not in stderr, stderr
        assert f"Error: {_one_document(stdout, 2)['error']}" in stderr


def test_convert_takes_a_directory_named_with_controls_and_shows_it_escaped(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    src = tmp_path / "my\nmodel\x1b[2J"
    src.mkdir()
    torch.save({"w": torch.ones(2)}, src / "pytorch_model.bin")
    out = tmp_path / "out\nnote: ok"
    proc = packer("convert", str(src), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert torch.equal(load_file(out / "model.safetensors")["w"], torch.ones(2))
    assert "\x1b" not in proc.stdout and proc.stdout.count("\n") == 1
    assert "out\\nnote: ok/model.safetensors" in proc.stdout


def test_stream_into_a_missing_parent_names_the_parent(tmp_path: Path) -> None:
    proc = packer("stream", "oci://127.0.0.1:9/m@sha256:" + "0" * 64, "--dir", "a/b", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: stream: a does not exist; create it first (mkdir -p a), "
                                   "or name a --dir whose parent exists")
    assert not (tmp_path / "a").exists()
