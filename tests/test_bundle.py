"""The bundle build side: member selection, symlinks, determinism, round trip, dry run, unbundle."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from packer.bundle import ARCHIVE_NAME, ZSTD_LEVEL, glob_regex, plan_bundle, run_bundle, unbundle, write_bundle
from packer.errors import BundleError
from packer.hashing import sha256_file
from packer.recipe import BundleConfig
from tests.bundle_validate import validate_bundle
from tests.hf_cache import populate_cache

TOKENIZER_FILES = {
    "config.json": b'{"model_type": "bert"}',
    "generation_config.json": b"{}",
    "tokenizer.json": b'{"version": "1.0", "model": {"vocab": {"a": 0}}}' * 50,
    "tokenizer_config.json": b'{"model_max_length": 512}',
    "special_tokens_map.json": b'{"unk_token": "[UNK]"}',
    "vocab.txt": b"[PAD]\n[UNK]\nhello\n",
    "merges.txt": b"#version: 0.2\nh e\n",
    "spiece.model": bytes(range(256)),
    "tokenizer.model.v3": b"\x0a\x0bsentencepiece",
    "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}",
    "cl100k.tiktoken": b"YQ== 0\n",
    "1_Pooling/config.json": b'{"pooling_mode_mean_tokens": true}',
    "tokenizer/vocab.json": b'{"a": 0}',
}
OTHER_FILES = {
    "model.safetensors": b"\0" * 64,
    "pytorch_model.bin": b"PK\x03\x04",
    "model.safetensors.index.json": b'{"weight_map": {}}',
    "training_args.bin": b"\x80\x04.",
    "optimizer.pt": b"\x80\x02.",
    "modeling_custom.py": b"import os\n",
    "extra.pkl": b"\x80\x04.",
    "README.md": b"# model\n",
    ".gitattributes": b"*.bin filter=lfs\n",
    "2_Dense/pytorch_model.bin": b"PK",
    "unknown/config.json": b"{}",
}


def _write(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    return _write(tmp_path / "model", {**TOKENIZER_FILES, **OTHER_FILES})


def test_default_selection(model: Path) -> None:
    plan = plan_bundle(model, BundleConfig())
    assert [m.name for m in plan.members] == sorted(TOKENIZER_FILES)
    assert all(m.mode == 0o644 and m.size == len(TOKENIZER_FILES[m.name]) for m in plan.members)
    assert plan.dirs == ("1_Pooling", "tokenizer")
    reasons = dict(plan.skipped)
    assert reasons["model.safetensors"] == reasons["pytorch_model.bin"] == "weights (never bundled)"
    assert reasons["2_Dense/pytorch_model.bin"] == "weights (never bundled)"
    assert reasons["modeling_custom.py"] == "code (never bundled)"
    assert reasons["extra.pkl"] == "pickle (never bundled)"
    assert reasons["model.safetensors.index.json"].startswith("weights index")
    assert reasons["README.md"] == "not a tokenizer/config file type"
    assert reasons[".gitattributes"] == "hidden"
    assert "unknown/config.json" not in reasons  # not a known sub-folder: not even walked


@pytest.mark.parametrize(("marker", "text"), [
    ("model_index.json", '{"_class_name": "P", "my_scheduler": ["diffusers", "DDIMScheduler"],'
                         ' "odd_unet": ["diffusers", "UNet2DModel"]}'),
    ("modules.json", '[{"path": ""}, {"path": "my_scheduler"}, {"path": "odd_unet/"}]'),
])
def test_folders_the_layout_file_names_are_bundled(tmp_path: Path, marker: str, text: str) -> None:
    """Not only the component folder names packer knows: whatever model_index.json or modules.json names."""
    (tmp_path / marker).write_text(text)
    for rel in ("my_scheduler/scheduler_config.json", "odd_unet/config.json", "unnamed/config.json"):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("{}")
    names = [m.name for m in plan_bundle(tmp_path, BundleConfig()).members]
    assert names == [marker, "my_scheduler/scheduler_config.json", "odd_unet/config.json"]


def test_a_layout_file_naming_a_path_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text('{"../up": ["diffusers", "UNet2DModel"]}')
    with pytest.raises(BundleError, match="model_index.json: component '../up' is not a plain folder name"):
        plan_bundle(tmp_path, BundleConfig())


def test_include_exclude(model: Path) -> None:
    cfg = BundleConfig(include=["README.md", "unknown/*.json", "**/*.bin", "*.py"],
                       exclude=["merges.txt", "1_Pooling/**", "tokenizer.model.*"])
    plan = plan_bundle(model, cfg)
    names = [m.name for m in plan.members]
    assert "README.md" in names and "unknown/config.json" in names
    assert "merges.txt" not in names and "1_Pooling/config.json" not in names and "tokenizer.model.v3" not in names
    assert not [n for n in names if n.endswith((".bin", ".py"))]  # include never overrides the never-list
    reasons = dict(plan.skipped)
    assert reasons["merges.txt"] == "excluded by 'merges.txt'"
    assert reasons["training_args.bin"] == "weights (never bundled)"


@pytest.mark.parametrize(("glob", "path", "hit"), [
    ("*.json", "a/b/c.json", True), ("a/*.json", "a/b/c.json", False), ("a/**/c.json", "a/b/c.json", True),
    ("a/**", "a/b/c.json", True), ("c.jso?", "c.json", True), ("x/*.json", "x.json", False),
])
def test_glob_semantics(glob: str, path: str, hit: bool) -> None:
    assert bool(glob_regex(glob).match(path)) is hit


def test_hf_cache_symlinks_followed(tmp_path: Path) -> None:
    files = {**TOKENIZER_FILES, "model.safetensors": b"\0" * 16}
    snap = populate_cache(tmp_path / "hub", "org/tiny", files)
    assert (snap / "config.json").is_symlink()
    plan = plan_bundle(snap, BundleConfig())  # the cache repo folder is found by itself
    assert [m.name for m in plan.members] == sorted(TOKENIZER_FILES)
    assert all("/blobs/" in m.source.as_posix() for m in plan.members)
    repo = snap.parent.parent
    assert plan_bundle(snap, BundleConfig(), allowed_root=repo).members == plan.members
    with pytest.raises(BundleError, match="leads outside"):
        plan_bundle(snap, BundleConfig(), allowed_root=snap)
    written = write_bundle(plan, tmp_path / ARCHIVE_NAME)
    assert validate_bundle(written.path) == {k: v for k, v in TOKENIZER_FILES.items()}


def test_escaping_links_rejected(model: Path, tmp_path: Path) -> None:
    (tmp_path / "secret.json").write_bytes(b"{}")
    os.symlink(tmp_path / "secret.json", model / "leak.json")
    with pytest.raises(BundleError, match=r"leak\.json.*leads outside"):
        plan_bundle(model, BundleConfig())
    os.unlink(model / "leak.json")
    os.symlink("../../secret.json", model / "1_Pooling" / "up.json")
    with pytest.raises(BundleError, match="leads outside"):
        plan_bundle(model, BundleConfig())
    os.unlink(model / "1_Pooling" / "up.json")
    (tmp_path / "pool").mkdir()
    os.symlink(tmp_path / "pool", model / "3_Pooling")  # a known sub-folder that leads outside
    with pytest.raises(BundleError, match="3_Pooling.*leads outside"):
        plan_bundle(model, BundleConfig())
    os.unlink(model / "3_Pooling")
    os.symlink("config.json", model / "alias.json")  # stays inside: followed
    plan = plan_bundle(model, BundleConfig())
    assert next(m for m in plan.members if m.name == "alias.json").source == (model / "config.json").resolve()
    os.symlink("missing.json", model / "dangling.json")
    with pytest.raises(BundleError, match="broken symlink"):
        plan_bundle(model, BundleConfig())


def test_colliding_names_rejected(tmp_path: Path) -> None:
    _write(tmp_path / "m", {"Vocab.txt": b"a", "vocab.txt": b"b"})
    with pytest.raises(BundleError, match="collide"):
        plan_bundle(tmp_path / "m", BundleConfig())
    _write(tmp_path / "n", {"caf\u00e9.json": b"1", "cafe\u0301.json": b"2"})
    with pytest.raises(BundleError, match="collide"):
        plan_bundle(tmp_path / "n", BundleConfig())


def test_empty_source_gives_an_empty_bundle(tmp_path: Path) -> None:
    _write(tmp_path / "m", {"model.safetensors": b"\0"})
    written = write_bundle(plan_bundle(tmp_path / "m", BundleConfig()), tmp_path / ARCHIVE_NAME)
    assert written.members == () and validate_bundle(written.path) == {}


def test_fifo_rejected(model: Path) -> None:
    os.mkfifo(model / "pipe.json")
    with pytest.raises(BundleError, match="not a regular file"):
        plan_bundle(model, BundleConfig())


def _build(src: Path, out: Path, threads: int = -1) -> bytes:
    out.mkdir(parents=True, exist_ok=True)
    write_bundle(plan_bundle(src, BundleConfig()), out / ARCHIVE_NAME, threads=threads)
    return (out / ARCHIVE_NAME).read_bytes()


def test_deterministic_across_umask_mtime_cwd_threads(model: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    big = os.urandom(1 << 16).hex().encode() * 48  # ~6 MB: several zstd jobs when multi-threaded
    (model / "tokenizer.json").write_bytes(big)
    first = _build(model, tmp_path / "a", threads=1)
    copy = shutil.copytree(model, tmp_path / "copy")
    for p in copy.rglob("*"):
        os.utime(p, (1_700_000_000, 1_700_000_000))
        os.chmod(p, 0o700 if p.is_dir() else 0o600)
    old = os.umask(0o077)
    monkeypatch.chdir(tmp_path)
    try:
        second = _build(copy, tmp_path / "b", threads=4)
    finally:
        os.umask(old)
    assert hashlib.sha256(first).digest() == hashlib.sha256(second).digest()
    assert validate_bundle(tmp_path / "a" / ARCHIVE_NAME)["tokenizer.json"] == big


def test_source_date_epoch(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    _build(model, tmp_path / "a")
    validate_bundle(tmp_path / "a" / ARCHIVE_NAME, mtime=1_700_000_000)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(BundleError, match="SOURCE_DATE_EPOCH"):
        _build(model, tmp_path / "b")


def test_run_bundle_section_and_round_trip(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_bundle(model, BundleConfig(), out / "stage", rel_root=out)
    (entry,) = result.files
    path = out / entry.path
    assert entry.path == "stage/bundle.tar.zst" and (entry.size, entry.sha256) == sha256_file(path)
    files = validate_bundle(path, names=sorted(TOKENIZER_FILES))
    section = result.section
    assert section["file"] == entry.path and section["sha256"] == entry.sha256 and section["size"] == entry.size
    assert section["zstd_level"] == ZSTD_LEVEL
    assert section["members"] == [{"name": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()}
                                  for n, d in sorted(files.items())]
    assert result.bytes_processed == sum(len(d) for d in TOKENIZER_FILES.values())
    assert not any("weights" in n for n in result.notes)  # the weights stage reports those
    assert any("modeling_custom.py" in n for n in result.notes) and any("extra.pkl" in n for n in result.notes)
    names = unbundle(path, tmp_path / "x")
    assert names == sorted(TOKENIZER_FILES)
    for n in names:
        assert (tmp_path / "x" / n).read_bytes() == TOKENIZER_FILES[n]
        assert (tmp_path / "x" / n).stat().st_mode & 0o777 == 0o644 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_dry_run_writes_nothing(model: Path, tmp_path: Path) -> None:
    result = run_bundle(model, BundleConfig(), tmp_path / "out", dry_run=True)
    assert not (tmp_path / "out").exists() and result.files == ()
    assert [m["name"] for m in result.section["members"]] == sorted(TOKENIZER_FILES)
    assert {"name": "modeling_custom.py", "reason": "code (never bundled)"} in result.section["skipped"]


def test_unbundle_target_rules(model: Path, tmp_path: Path) -> None:
    archive = Path(run_bundle(model, BundleConfig(), tmp_path).section["file"])
    archive = tmp_path / archive
    (tmp_path / "empty").mkdir()
    assert unbundle(archive, tmp_path / "empty") == sorted(TOKENIZER_FILES)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("x")
    with pytest.raises(BundleError, match="not an empty directory"):
        unbundle(archive, tmp_path / "full")
    bad = tmp_path / "bad.tar.zst"
    bad.write_bytes(archive.read_bytes() + b"junk")
    with pytest.raises(BundleError, match=r"bad\.tar\.zst: 4 bytes of trailing data"):
        unbundle(bad, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_gnu_tar_reads_it(model: Path, tmp_path: Path) -> None:
    if not shutil.which("tar") or not shutil.which("zstd"):
        pytest.skip("GNU tar or zstd not installed")
    _build(model, tmp_path / "a")
    listing = subprocess.run(["tar", "--zstd", "-tvf", str(tmp_path / "a" / ARCHIVE_NAME)],
                             check=True, capture_output=True, text=True).stdout
    assert "1_Pooling/config.json" in listing and "0/0" in listing and "1970-01-01" in listing


def test_verify_bundle_names_the_first_mismatch(model: Path, tmp_path: Path) -> None:
    from packer.bundle import verify_bundle
    from packer.errors import VerifyError

    section = run_bundle(model, BundleConfig(), tmp_path).section
    verify_bundle(tmp_path, section)
    lied = {**section, "members": [{**m, "sha256": "0" * 64} if m["name"] == "vocab.txt" else m
                                   for m in section["members"]]}
    with pytest.raises(VerifyError, match="member 'vocab.txt' does not match"):
        verify_bundle(tmp_path, lied)
    with pytest.raises(VerifyError, match="members differ"):
        verify_bundle(tmp_path, {**section, "members": section["members"][1:]})
    (tmp_path / ARCHIVE_NAME).write_bytes((tmp_path / ARCHIVE_NAME).read_bytes() + b"x")
    with pytest.raises(VerifyError, match="does not read back as a bundle: .*trailing data"):
        verify_bundle(tmp_path, section)
