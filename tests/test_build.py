"""The build pipeline end to end: outputs, verify, determinism, atomic publish, crash safety."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from packer.building import build
from packer.bundle import unbundle
from packer.demo import write_demo
from packer.errors import PackerError, VerifyError
from packer.oci.plan import image_rel
from packer.recipe import demo_recipe, recipe_from_dict
from packer.util.fsutil import split_artifact
from packer.verifying import verify
from tests.built import held_in_blobs, weight_bytes, weights_copy
from tests.bundle_validate import validate_bundle
from tests.oci_validate import require_tool, run, validate_layout
from tests.weights_validate import aliases_of, validate_output

EXPECTED = {"manifest.json", "weights/model.safetensors", "bundle.tar.zst", "packer_loader.py",
            "packer_runtime/loader.py", "Dockerfile"}


def tree(out: Path) -> dict[str, str]:
    """sha256 of every file under ``out`` except the timings, by relative path."""
    return {
        p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != "build-timings.json"
    }


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "out"
    build(demo_recipe(), out)
    return out


def test_demo_build_outputs(demo_out: Path) -> None:
    files = tree(demo_out)
    assert set(files) | set(held_in_blobs(demo_out)) >= EXPECTED
    assert any(f.startswith("image/blobs/sha256/") for f in files)
    manifest = json.loads((demo_out / "manifest.json").read_bytes())
    assert manifest["source"]["kind"] == "demo"
    assert "pytorch_model.bin" in manifest["source"]["files"]
    assert manifest["tools"]["python"] and manifest["recipe"]["name"] == "packer-demo"
    assert manifest["weights"]["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    for rel, entry in manifest["files"].items():
        assert hashlib.sha256(weight_bytes(demo_out, rel)).hexdigest() == entry["sha256"]
    timings = json.loads((demo_out / "build-timings.json").read_bytes())
    assert [s["stage"] for s in timings["stages"]][:3] == ["source", "weights", "bundle"]
    assert not list(demo_out.parent.glob(".out.packer-*"))  # no staging left behind


def test_safetensors_reads_back_the_source_tensors(demo_out: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    src = write_demo(tmp_path)  # the same deterministic demo the build generated
    want = torch.load(src / "pytorch_model.bin", weights_only=True)  # an oracle, on a file we made
    weights = weights_copy(demo_out, tmp_path / "copy")  # the weight files, out of their layer blobs
    validate_output(weights)
    got = load_file(weights / "model.safetensors")
    aliases = aliases_of(weights)
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert sorted([*got, *aliases]) == sorted(want)
    for name, tensor in want.items():
        stored = got[aliases.get(name, name)]
        assert (stored.dtype, stored.shape) == (tensor.dtype, tensor.shape), name
        assert torch.equal(stored.flatten().view(torch.uint8), tensor.contiguous().flatten().view(torch.uint8)), name


def test_tokenizers_loads_the_bundled_tokenizer(demo_out: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    src = write_demo(tmp_path)
    files = validate_bundle(demo_out / "bundle.tar.zst")
    assert files["tokenizer.json"] == (src / "tokenizer.json").read_bytes()
    assert unbundle(demo_out / "bundle.tar.zst", tmp_path / "bundle") == sorted(files)
    bundled = Tokenizer.from_file(str(tmp_path / "bundle" / "tokenizer.json"))
    source = Tokenizer.from_file(str(src / "tokenizer.json"))
    words = sorted(w for w in source.get_vocab() if w.isalpha() and w.islower() and len(w) > 1)[:8]  # "baba"...
    ids = bundled.encode(" ".join(words)).ids
    assert ids == source.encode(" ".join(words)).ids == [source.token_to_id(w) for w in words]


def test_skopeo_and_umoci_read_the_image(demo_out: Path, tmp_path: Path) -> None:
    skopeo, umoci = require_tool("skopeo"), require_tool("umoci")
    copy = tmp_path / "out"  # the tools get a copy: nothing they might write lands in demo_out
    subprocess.run(["cp", "-a", str(demo_out), str(copy)], check=True)
    manifest = json.loads((copy / "manifest.json").read_bytes())
    image = manifest["image"]
    layout = validate_layout(copy / "image", image["tag"])
    info = json.loads(run([skopeo, "inspect", f"oci:{copy / 'image'}:{image['tag']}"]).stdout)
    assert info["Digest"] == image["manifest_digest"] == layout.manifest_digest
    assert info["Layers"] == [layer["digest"] for layer in image["layers"]]
    flags = [] if os.geteuid() == 0 else ["--rootless"]
    run([umoci, "unpack", *flags, "--image", f"{copy / 'image'}:{image['tag']}", str(tmp_path / "bundle")])
    root = tmp_path / "bundle" / "rootfs" / image["prefix"].lstrip("/")
    for rel in manifest["files"]:
        assert (root / image_rel(rel)).read_bytes() == weight_bytes(copy, rel), rel
    assert (root / "manifest.json").read_bytes() == split_artifact(manifest)


@pytest.mark.slow
def test_verify_passes_then_names_any_changed_file(demo_out: Path, tmp_path: Path) -> None:
    assert verify(demo_out)["files"] >= len(EXPECTED)
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(demo_out), str(copy)], check=True)
    for rel in sorted(tree(copy)):
        path = copy / rel
        original = path.read_bytes()
        flipped = bytearray(original)
        flipped[len(flipped) // 2] ^= 0x01
        path.unlink()  # layer tarballs are hardlinks of blobs: change this path alone
        path.write_bytes(bytes(flipped))
        with pytest.raises(VerifyError) as e:
            verify(copy)
        assert rel in str(e.value), (rel, str(e.value))
        path.unlink()
        path.write_bytes(original)
    verify(copy)


@pytest.mark.parametrize("section", ["files", "image_files"])
def test_verify_blames_a_canonical_manifest_whose_record_lost_a_key(demo_out: Path, tmp_path: Path,
                                                                   section: str) -> None:
    """A flipped byte can rename a key ("sha256" -> "rha256") and leave the JSON canonical."""
    from packer.util.fsutil import canonical_json

    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(demo_out), str(copy)], check=True)
    manifest = json.loads((copy / "manifest.json").read_bytes())
    rel = sorted(manifest[section])[0]
    manifest[section][rel]["rha256"] = manifest[section][rel].pop("sha256")
    (copy / "manifest.json").unlink()
    (copy / "manifest.json").write_bytes(canonical_json(manifest))
    with pytest.raises(VerifyError, match=f"manifest.json: {section} entry '{rel}' is not a record of size and sha256"):
        verify(copy)


def test_verify_names_every_link_of_a_changed_layer_tarball(demo_out: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(demo_out), str(copy)], check=True)
    layers = sorted((copy / "image" / "layers").glob("*.tar*"))
    assert layers and all(p.stat().st_nlink == 2 for p in layers)  # each is a hard link of its blob
    for layer in layers:
        with open(layer, "r+b") as f:  # in place, as a careless edit would: both names change
            f.seek(layer.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
        proc = subprocess.run([sys.executable, "-m", "packer", "verify", str(copy)], capture_output=True,
                              text=True, check=False)
        assert proc.returncode == 1
        (line,) = proc.stderr.strip().splitlines()
        assert str(layer) in line and "image/blobs/sha256/" in line, line
        with open(layer, "r+b") as f:
            f.seek(layer.stat().st_size // 2)
            f.write(byte)
    verify(copy)


def test_a_layer_that_cannot_be_read_is_named_by_its_read_error(demo_out: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that fails a read (EIO) fails the re-read that looks for a digest mismatch too: the
    first error stands, in one line, never the second's raw OSError."""
    import errno

    import packer.oci.verify as oci_verify

    real = oci_verify._HashingReader.read

    def failing(self: oci_verify._HashingReader, n: int = -1) -> bytes | memoryview:
        if self.size > 0:
            raise OSError(errno.EIO, "Input/output error")
        return real(self, n)

    monkeypatch.setattr(oci_verify._HashingReader, "read", failing)
    with pytest.raises(VerifyError, match=r"blobs/sha256/[0-9a-f]{64}.*: cannot read layer: \[Errno 5\] "
                                          r"Input/output error$"):
        verify(demo_out)


def test_verify_rejects_extra_and_missing_files(demo_out: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(demo_out), str(copy)], check=True)
    (copy / "weights").mkdir(exist_ok=True)  # the weight files lie in their layer blobs
    (copy / "weights" / "stray.bin").write_bytes(b"x")
    with pytest.raises(VerifyError, match="stray.bin: not listed"):
        verify(copy)
    (copy / "weights" / "stray.bin").unlink()
    (copy / "bundle.tar.zst").unlink()
    with pytest.raises(VerifyError, match="bundle.tar.zst: listed in the manifest but missing"):
        verify(copy)


def test_two_builds_are_byte_identical(demo_out: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    old = os.umask(0o077)
    try:
        build(demo_recipe(), tmp_path / "elsewhere" / "out2")
    finally:
        os.umask(old)
    assert tree(tmp_path / "elsewhere" / "out2") == tree(demo_out)


def test_rebuild_replaces_previous_build(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    from packer.demo import write_demo

    write_demo(src)
    recipe = recipe_from_dict({"name": "m", "version": "1", "source": str(src)})
    out = tmp_path / "out"
    build(recipe, out)
    first = tree(out)
    (src / "config.json").write_text('{"changed": true}\n')
    build(recipe, out)
    assert tree(out) != first and tree(out)["manifest.json"] != first["manifest.json"]
    verify(out)


def test_failed_build_leaves_previous_out_untouched(demo_out: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    subprocess.run(["cp", "-a", str(demo_out), str(out)], check=True)
    before = tree(out)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "pytorch_model.bin").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(PackerError):
        build(recipe_from_dict({"name": "m", "version": "1", "source": str(bad)}), out)
    assert tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "out"]


def test_refuses_to_replace_a_directory_that_is_not_a_build(tmp_path: Path) -> None:
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(PackerError, match="not a packer build output"):
        build(demo_recipe(), tmp_path / "precious")
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    from packer.stub import planned_files

    result = build(demo_recipe(), tmp_path / "out", dry_run=True)
    assert result.dry_run and "weights" in result.manifest
    assert list(tmp_path.iterdir()) == []
    top = result.manifest["image"]["plan"]["layers"][-1]
    assert top["name"] == "loader" and top["files"] == sorted(f"/models/{p}" for p in planned_files())


def test_dry_run_layer_sizes_are_the_built_ones_or_say_they_are_not_known_yet(tmp_path: Path, demo_out: Path) -> None:
    """A size the plan cannot know (the stub with its manifest, the compressed bundle) is not
    counted as 0: the layer says which files are sized when written, and the bytes it knows."""
    plan = build(demo_recipe(), tmp_path / "out", dry_run=True).manifest["image"]["plan"]["layers"]
    built = json.loads((demo_out / "manifest.json").read_bytes())
    sizes = {f"/models/{p}": e["size"] for p, e in built["files"].items()}
    members = {f"/models/{m['name']}": m["size"] for m in built["bundle"]["members"]}
    sizes |= members | {"/models/model.safetensors": sizes.get("/models/weights/model.safetensors", 0),
                        "/models/packer-chunks.json": sizes.get("/models/weights/packer-chunks.json", 0)}
    by_name = {la["name"]: la for la in plan}
    assert [la["name"] for la in plan] == ["weights model.safetensors", "model files", "bundle", "loader"]
    loader, bundle = by_name["loader"], by_name["bundle"]
    assert loader["size"] is None and loader["sized_when_written"] == ["/models/packer_loader.py"]
    assert loader["known_bytes"] == sum(sizes[f] for f in loader["files"] if f != "/models/packer_loader.py")
    assert bundle["size"] is None and bundle["known_bytes"] == 0
    assert bundle["sized_when_written"] == ["/models/bundle.tar.zst", "/models/manifest.json"]
    files = by_name["model files"]
    assert files["sized_when_written"] == ["/models/packer-chunks.json"]
    assert files["known_bytes"] == sum(sizes[f] for f in files["files"] if f != "/models/packer-chunks.json")


def test_the_image_holds_the_loader_and_its_runtime_and_it_runs(demo_out: Path, tmp_path: Path) -> None:
    from tests.oci_validate import require_tool, run

    umoci = require_tool("umoci")
    manifest = json.loads((demo_out / "manifest.json").read_bytes())
    runtime = sorted(p for p in manifest["files"] if p.startswith("packer_runtime/"))
    assert "packer_runtime/loader.py" in runtime
    assert manifest["image"]["layers"][-1]["files"] == sorted(["packer_loader.py", *runtime])
    stub = ast.parse((demo_out / "packer_loader.py").read_text())
    pinned = next(ast.literal_eval(n.value) for n in stub.body  # what the stub checks at import
                  if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "_RUNTIME_SHA256" and n.value)
    assert {f"packer_runtime/{k}": v for k, v in pinned.items()} == {p: manifest["files"][p]["sha256"] for p in runtime}
    run([umoci, "unpack", *([] if os.geteuid() == 0 else ["--rootless"]), "--image",
         f"{demo_out / 'image'}:{manifest['image']['tag']}", str(tmp_path / "bundle")])
    model = tmp_path / "bundle" / "rootfs" / "models"
    assert stat.S_IMODE((model / "packer_loader.py").stat().st_mode) == 0o755
    for rel in runtime:
        assert stat.S_IMODE((model / rel).stat().st_mode) == 0o644
        assert (model / rel).read_bytes() == (demo_out / rel).read_bytes()
    env = {**os.environ, "PACKER_STARTUP_LOG": "off", "PACKER_BUNDLE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, str(model / "packer_loader.py"), "--selftest", "--device", "cpu",
                           "--verify"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("packer_loader: self-test passed")


# --- crash safety ------------------------------------------------------------------------

# Runs `packer build` and SIGKILLs itself at the Nth rename (every stage ends in one) or once
# the staging directory holds at least N bytes: kill points inside and between all stages.
# Mode "count" kills nothing and prints how many renames the whole build made.
_KILLER = textwrap.dedent(
    """
    import atexit, os, signal, sys, threading, time
    from pathlib import Path
    mode, n, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    if mode in ("rename", "count"):
        count = [0]
        def hook(event, args):
            if event == "os.rename":
                count[0] += 1
                if count[0] == n and mode == "rename":
                    os.kill(os.getpid(), signal.SIGKILL)
        sys.addaudithook(hook)
        if mode == "count":
            atexit.register(lambda: print(count[0]))
    else:
        def watch():
            while True:
                total = 0
                for d in out.parent.glob("." + out.name + ".packer-staging-*"):
                    for root, _, files in os.walk(d):
                        for f in files:
                            try:
                                total += os.lstat(os.path.join(root, f)).st_size
                            except OSError:
                                pass
                if total >= n:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.001)
        threading.Thread(target=watch, daemon=True).start()
    from packer.cli import main
    sys.argv = ["packer", "build", "-q", "-o", str(out)]
    main()
    """
)


def _killed_build(mode: str, n: int, out: Path) -> subprocess.CompletedProcess[str]:
    tmp = out.parent / "tmpdir"  # a killed build leaves nothing in TMPDIR (the demo is generated beside out)
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp)}
    return subprocess.run([sys.executable, "-c", _KILLER, mode, str(n), str(out)], env=env, check=False,
                          stdout=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("previous", [False, True], ids=["fresh", "over-previous"])
def test_sigkill_at_every_stage_leaves_out_absent_or_previous(demo_out: Path, tmp_path: Path, previous: bool) -> None:
    out = tmp_path / "out"
    if previous:
        subprocess.run(["cp", "-a", str(demo_out), str(out)], check=True)
    before = tree(out) if previous else None
    size = sum((demo_out / f).stat().st_size for f in tree(demo_out))
    # Byte thresholds fall inside the weights stage (its own child process) and the image
    # stage. Every stage of the build process ends in a rename (demo files, bundle, loader,
    # manifest, image blobs and files, final manifest, timings, publish): a build that kills
    # nothing counts them, and kill points spread over all of them, the last at the publish.
    counted = _killed_build("count", 0, tmp_path / "counted")
    assert counted.returncode == 0
    renames = int(counted.stdout.split()[-1])
    assert renames >= 10, renames
    points = [("bytes", int(size * f)) for f in (0.02, 0.3, 0.45, 0.55, 0.8, 0.98)]
    points += [("rename", n) for n in sorted({2, *range(4, renames - 1, 4), renames - 1, renames})]
    killed = 0
    for mode, n in points:
        rc = _killed_build(mode, n, out).returncode
        killed += rc == -signal.SIGKILL
        if before is None and not out.exists():
            continue
        if before is None:  # the build got far enough to publish: it must be complete
            before = tree(out)
        assert tree(out) == before, (mode, n)
        verify(out)
    assert killed >= len(points) - 1  # every point but perhaps the last byte count falls inside the build
    assert subprocess.run([sys.executable, "-m", "packer", "build", "-q", "-o", str(out)]).returncode == 0
    verify(out)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.packer-")]
    assert not list((tmp_path / "tmpdir").iterdir())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_stopped_build_removes_staging_and_scratch(tmp_path: Path, sig: signal.Signals) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "packer", "build", "-q", "-o", str(out)],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".out.packer-staging-*/weights")) and time.monotonic() < deadline:
        time.sleep(0.01)  # until the weights stage has begun
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig  # the shells' convention: 143 for SIGTERM, 130 for Ctrl-C
    said = "interrupted" if sig == signal.SIGINT else "stopped (exit code 143)"
    assert err.strip().splitlines() == [f"error: {said}"]
    assert not out.exists() and not list(tmp_path.iterdir())


def test_full_disk_is_one_clear_error(tmp_path: Path) -> None:
    out = tmp_path / "out"
    limit = "import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (4_000_000, 4_000_000))"
    code = f"{limit}\nimport sys\nfrom packer.cli import main\nsys.argv=['packer','build','-o',{str(out)!r}]\nmain()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "too large" in lines[0].lower()
    assert list(tmp_path.iterdir()) == []


def test_hf_source_builds_offline_from_the_cache(tmp_path: Path) -> None:
    from packer.demo import write_demo
    from tests.hf_cache import populate_cache

    src = tmp_path / "src"
    src.mkdir()
    write_demo(src)
    cache = tmp_path / "cache"
    populate_cache(cache, "acme/demo", {p.name: p.read_bytes() for p in src.iterdir()}, commit="c0ffee" * 6 + "abcd")
    recipe = recipe_from_dict({"name": "m", "version": "1", "source": "hf://acme/demo@main"})
    build(recipe, tmp_path / "out", cache_dir=cache)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_bytes())
    assert manifest["source"] | {"files": None} == {"kind": "hf", "uri": "hf://acme/demo@main",
                                                    "revision": "c0ffee" * 6 + "abcd", "files": None}
    for name in ("tokenizer.json", "pytorch_model.bin"):  # a bundle member; the weights, hashed early
        assert manifest["source"]["files"][name]["sha256"] == hashlib.sha256((src / name).read_bytes()).hexdigest()
    local = recipe_from_dict({"name": "m", "version": "1", "source": str(src)})
    build(local, tmp_path / "local")
    assert weight_bytes(tmp_path / "out") == weight_bytes(tmp_path / "local")
    verify(tmp_path / "out")


def test_manifest_pins_every_input_shard(tmp_path: Path) -> None:
    from packer.demo import write_demo
    from packer.recipe import WeightsConfig
    from packer.weights.convert import convert

    demo = tmp_path / "demo"
    demo.mkdir()
    write_demo(demo)
    src = tmp_path / "src"
    convert(demo / "pytorch_model.bin", src, WeightsConfig(max_shard_size=8_000_000))
    (src / "config.json").write_bytes((demo / "config.json").read_bytes())
    build(recipe_from_dict({"name": "m", "version": "1", "source": str(src)}), tmp_path / "out")
    pinned = json.loads((tmp_path / "out" / "manifest.json").read_bytes())["source"]["files"]
    shards = sorted(p.name for p in src.glob("model-*.safetensors"))
    assert len(shards) > 2 and set(pinned) == {*shards, "model.safetensors.index.json", "config.json"}
    for name, entry in pinned.items():
        data = (src / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


def test_checkpoints_are_hashed_while_the_weights_stage_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import packer.build_stages as stages_module
    import packer.hashing as hashing
    from packer.demo import write_demo

    src = tmp_path / "src"
    src.mkdir()
    write_demo(src)
    hashed_on: list[tuple[str, str]] = []
    real = hashing.sha256_file

    def spy(path: Path, stop: object = None) -> tuple[int, str]:
        hashed_on.append((Path(path).name, threading.current_thread().name))
        return real(path, stop)  # type: ignore[arg-type]

    monkeypatch.setattr(stages_module, "sha256_file", spy)  # hashed when needed (the inputs stage)
    monkeypatch.setattr(hashing, "sha256_file", spy)  # hashed ahead (sha256_file_or_none)
    build(recipe_from_dict({"name": "m", "version": "1", "source": str(src)}), tmp_path / "out", sandbox=False)
    threads = {name: [t for n, t in hashed_on if n == name] for name, _ in hashed_on}
    assert len(threads["pytorch_model.bin"]) == 1  # once, in the background
    assert threads["pytorch_model.bin"][0].startswith("packer-inputs")
    assert threads["tokenizer.json"] == [threading.main_thread().name]  # bundle members: after


def test_input_mtimes_do_not_change_the_output(tmp_path: Path) -> None:
    from packer.demo import write_demo

    src = tmp_path / "src"
    src.mkdir()
    write_demo(src)
    recipe = recipe_from_dict({"name": "m", "version": "1", "source": "src"}, base_dir=tmp_path)
    build(recipe, tmp_path / "a")
    for i, p in enumerate(sorted(src.iterdir())):
        os.utime(p, (1_000_000 + i, 2_000_000_000 + i))
    build(recipe, tmp_path / "b")
    assert tree(tmp_path / "a") == tree(tmp_path / "b")


def test_plain_build_never_imports_torch(tmp_path: Path) -> None:
    # torch alone takes over a second to import: longer than converting the demo
    code = ("import sys\nfrom packer.building import build\nfrom packer.recipe import demo_recipe\n"
            f"build(demo_recipe(), {str(tmp_path / 'out')!r}, sandbox=False)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("sandbox", [True, False])
def test_weights_progress_is_reported_with_and_without_the_sandbox(tmp_path: Path, sandbox: bool) -> None:
    from packer.demo import write_demo

    src = tmp_path / "src"
    src.mkdir()
    write_demo(src)
    got: list[int] = []
    result = build(recipe_from_dict({"name": "m", "version": "1", "source": str(src)}), tmp_path / "out",
                   sandbox=sandbox, progress=got.append)
    weights = result.manifest["files"]["weights/model.safetensors"]["size"]
    tensors = result.manifest["weights"]["total_size"]
    assert got and all(n > 0 for n in got)  # increments, never a running total
    # in process: the tensor bytes as written; sandboxed: the bytes the child wrote (headers too)
    assert sum(got) == (weights if sandbox else tensors)


def test_dockerfile_comments_name_each_file_once(demo_out: Path) -> None:
    text = (demo_out / "Dockerfile").read_text()
    manifest = json.loads((demo_out / "manifest.json").read_bytes())
    members = ", ".join(m["name"] for m in manifest["bundle"]["members"])
    assert f"# model files: {members} (from bundle.tar.zst); weights/packer-chunks.json\n" in text
    assert text.count("bundle.tar.zst") == 2  # the model files' source and the bundle layer's file
