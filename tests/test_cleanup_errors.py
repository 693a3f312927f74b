"""No cleanup raises over the error that caused it: failures injected after a partial write.

Each writer is made to fail part-way (a source changes, a tensor cannot be written, a piece
of a layer stream raises) while its cleanup fails too (unlink or close raising). The error
the user sees must stay the first one, in one line; the cleanup failure is chained onto it
as a note. The long tokenizer name of issue 13 is the end-to-end case: it once ended in a
zstd "Src size is incorrect" traceback.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from packer.bundle import ARCHIVE_NAME, BundleMember, plan_bundle, unbundle, write_bundle
from packer.bundle import write as bundle_write
from packer.bundle.tar import MemberDigest
from packer.errors import BundleError, ImageError, WeightsError
from packer.oci.layer import write_layer
from packer.recipe import BundleConfig, WeightsConfig
from packer.runtime.bundle_reader import Bundle
from packer.util.fsutil import atomic_write_bytes
from packer.weights import convert as convert_mod
from packer.weights.convert import convert
from tests.bundle_validate import validate_bundle

LONG = "tokenizer_" + "x" * 105 + ".json"  # 120 bytes, no '/': more than a ustar header holds


def _tokenizer_dir(root: Path) -> Path:
    root.mkdir()
    (root / "config.json").write_text('{"model_type": "gpt2"}')
    (root / LONG).write_text('{"long": true}')  # sorts after config.json
    return root


def _failing_unlink(monkeypatch: pytest.MonkeyPatch, module: object) -> None:
    def unlink(path: object, *a: object, **k: object) -> None:
        raise PermissionError(errno.EACCES, "cleanup refused", str(path))

    monkeypatch.setattr(module, "os", _Os(unlink))


class _Os:
    """``os`` with ``unlink`` replaced: the rest is the real module."""

    def __init__(self, unlink: object) -> None:
        self._unlink = unlink

    def __getattr__(self, name: str) -> object:
        return self._unlink if name == "unlink" else getattr(os, name)


def test_long_tokenizer_name_bundles_and_reads_back(tmp_path: Path) -> None:
    src = _tokenizer_dir(tmp_path / "src")
    out = tmp_path / "b" / ARCHIVE_NAME
    out.parent.mkdir()
    run = subprocess.run([sys.executable, "-m", "packer", "bundle", str(src), "-o", str(out)],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    bundle = Bundle.open(out)
    assert bundle.names() == ["config.json", LONG]
    assert bundle.read(LONG) == b'{"long": true}'
    validate_bundle(out)
    again = tmp_path / "again.tar.zst"
    write_bundle(plan_bundle(src, BundleConfig()), again)
    assert again.read_bytes() == out.read_bytes()  # reproducible with the PAX record
    assert unbundle(out, tmp_path / "x") == ["config.json", LONG]
    assert (tmp_path / "x" / LONG).read_text() == '{"long": true}'


def test_bundle_failing_after_a_partial_write_keeps_its_message(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    src = _tokenizer_dir(tmp_path / "src")
    real = bundle_write.copy_member
    calls: list[str] = []

    def copy(member: BundleMember, out: object) -> MemberDigest:
        calls.append(member.name)
        if len(calls) == 2:  # the first member is in the frame already
            raise BundleError(f"{member.source}: changed size while being bundled; retry")
        return real(member, out)

    monkeypatch.setattr(bundle_write, "copy_member", copy)
    from packer.util import fsutil  # the archive is written through fsutil.atomic_open

    _failing_unlink(monkeypatch, fsutil)
    dest = tmp_path / ARCHIVE_NAME
    with pytest.raises(BundleError) as e:
        write_bundle(plan_bundle(src, BundleConfig()), dest)
    assert str(e.value) == f"{src / LONG}: changed size while being bundled; retry"
    assert any("cleanup also failed: PermissionError" in n for n in e.value.__notes__)
    assert not dest.exists()


def test_atomic_write_failing_cleanup_keeps_the_first_error(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from packer.util import fsutil

    def fsync(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fsutil.os, "fsync", fsync)
    _failing_unlink(monkeypatch, fsutil)
    with pytest.raises(OSError, match="No space left on device") as e:
        atomic_write_bytes(tmp_path / "manifest.json", b"{}" * 1000)
    assert any("cleanup also failed" in n for n in e.value.__notes__)
    assert not (tmp_path / "manifest.json").exists()


def test_layer_failing_mid_stream_keeps_its_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from packer.util import fsutil  # the blob and the tee are written through fsutil.TempFile

    def pieces() -> Iterator[bytes]:
        yield b"x" * 4096  # a partial write
        raise ImageError("layer entry /opt/model/a: source changed size while read")

    _failing_unlink(monkeypatch, fsutil)
    for compression in ("none", "gzip", "zstd"):
        with pytest.raises(ImageError) as e:
            write_layer(pieces(), tmp_path, compression=compression, tee=tmp_path / "t.tar")
        assert str(e.value) == "layer entry /opt/model/a: source changed size while read"
        assert any("cleanup also failed: PermissionError" in n for n in e.value.__notes__)


def test_layer_failing_rename_leaves_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from packer.util import fsutil  # the blob is renamed into place by fsutil.TempFile

    def replace(a: object, b: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(fsutil, "os", type("O", (), {"__getattr__": lambda s, n: replace if n == "replace"
                                                     else getattr(os, n)})())
    with pytest.raises(OSError, match="cross-device"):
        write_layer([b"y" * 1024], tmp_path, compression="none")
    assert list(tmp_path.iterdir()) == []


def test_convert_failing_after_a_partial_write_keeps_its_message(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    torch.save({"a": torch.ones(1000), "b": torch.zeros(1000)}, tmp_path / "m.pt")
    def write_shard(shard: object, path: Path, *a: object, **k: object) -> object:
        path.write_bytes(b"partial")  # bytes landed, then the failure
        raise WeightsError(f"{path.name}: tensor 'b': bytes read back at offset 8 differ from what was written")

    monkeypatch.setattr(convert_mod, "write_shard", write_shard)

    def discard(self: object) -> None:
        raise PermissionError(errno.EACCES, "cleanup refused")

    monkeypatch.setattr(convert_mod.StagedFiles, "discard", discard)
    with pytest.raises(WeightsError) as e:
        convert(tmp_path / "m.pt", tmp_path / "out", WeightsConfig())
    assert "tensor 'b': bytes read back at offset 8 differ" in str(e.value)
    assert "\n" not in str(e.value)
    assert any("cleanup also failed: PermissionError" in n for n in e.value.__notes__)


@pytest.mark.slow
def test_build_with_a_long_tokenizer_name_and_a_user_config_object(tmp_path: Path) -> None:
    # issue 13 end to end through `packer build`: no traceback, exit codes, verify passes
    from packer.demo import write_demo
    from tests.test_checkpoint_placeholders import stand_in

    src = tmp_path / "src"
    src.mkdir()
    write_demo(src)
    (src / LONG).write_text('{"long": true}')
    sd = torch.load(src / "pytorch_model.bin", weights_only=True)
    with stand_in("mytrainer.config", "TrainConfig") as cfg_cls:
        torch.save({"state_dict": sd, "config": cfg_cls()}, src / "pytorch_model.bin")
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'name = "m"\nversion = "1"\nsource = "{src}"\n[weights]\nkey = "state_dict"\n')

    def packer(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "packer", *args], capture_output=True, text=True,
                              check=False)

    refused = packer("build", str(recipe), "-o", str(tmp_path / "out"))
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "--allow-global mytrainer.config.TrainConfig" in refused.stderr
    built = packer("build", str(recipe), "-o", str(tmp_path / "out"), "--allow-global", "mytrainer.*")
    assert built.returncode == 0, built.stderr
    assert "config (mytrainer.config.TrainConfig)" in built.stdout + built.stderr
    assert packer("verify", str(tmp_path / "out")).returncode == 0
    assert LONG in Bundle.open(tmp_path / "out" / ARCHIVE_NAME).names()
