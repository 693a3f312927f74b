"""The whole weights stage on real torch.save'd / safetensors inputs, torch.load as the oracle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from packer.errors import CheckpointError, PackerError, VerifyError, WeightsError
from packer.recipe import Rename, WeightsConfig
from packer.weights import convert as convert_mod
from packer.weights.convert import convert
from packer.weights.verify import verify_weights
from tests.ckpt_factory import (
    SAVE_DTYPES,
    nested_checkpoint,
    random_tensor,
    save,
    state_dicts,
    tensor_bytes,
    views_state_dict,
)
from tests.weights_validate import aliases_of, validate_output


def oracle(path: Path, key: str | None = None, saved: Any = None) -> dict[str, torch.Tensor]:
    """torch.load(weights_only=True)'s tensors; ``saved`` where torch cannot load its own
    legacy files (float8 and uint16+ storages have no dtype there)."""
    try:
        loaded = torch.load(path, weights_only=True, map_location="cpu")
    except AttributeError:
        assert saved is not None
        loaded = saved
    for part in (key.split(".") if key else []):
        loaded = loaded[part]
    return {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}


def check(out: Path, expected: dict[str, torch.Tensor], section: dict[str, Any]) -> None:
    """Validate the output and compare every tensor (aliases restored) with ``expected``."""
    found = validate_output(out)
    aliases = aliases_of(out)
    assert aliases == section["aliases"]
    assert set(found) | set(aliases) == set(expected)
    for name, t in expected.items():
        got = found[aliases.get(name, name)]
        assert got["shape"] == list(t.shape), name
        assert got["bytes"] == tensor_bytes(t), name
    verify_weights(out, section)


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_views_aliases_and_skipped(tmp_path: Path, fmt: str) -> None:
    src = save(views_state_dict(), tmp_path / "model.pt", fmt)
    progress: list[int] = []
    result = convert(src, tmp_path / "out", WeightsConfig(), progress=progress.append)
    check(tmp_path / "out", oracle(src), result.section)
    assert sum(progress) == result.section["total_size"] > 0
    assert result.section["aliases"] == {"lm_head.weight": "embed.weight"}
    assert result.section["skipped"] == ["note", "step"]
    assert result.section["inputs"] == [{"path": "model.pt", "format": f"torch-{fmt}"}]
    assert any("skipped 2 non-tensor entries: step, note" in n for n in result.notes)
    assert [f.path for f in result.files] == ["model.safetensors"]
    assert result.bytes_processed == (tmp_path / "out" / "model.safetensors").stat().st_size


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_every_dtype(tmp_path: Path, fmt: str) -> None:
    sd = {str(dt).removeprefix("torch."): random_tensor(dt, (3, 2), i).t()
          for i, dt in enumerate(SAVE_DTYPES)}
    src = save(sd, tmp_path / "w.pth", fmt)
    result = convert(src, tmp_path / "out", WeightsConfig())
    check(tmp_path / "out", oracle(src, saved=sd), result.section)


def test_nested_key_and_error_listing_keys(tmp_path: Path) -> None:
    src = save(nested_checkpoint(), tmp_path / "last.ckpt")
    with pytest.raises(CheckpointError, match=r"choose a key: .*state_dict \(2 tensors\)"):
        convert(src, tmp_path / "out", WeightsConfig())
    assert not (tmp_path / "out").exists()
    result = convert(src, tmp_path / "out", WeightsConfig(key="model.ema"))
    check(tmp_path / "out", oracle(src, "model.ema"), result.section)
    assert result.section["skipped"] == []
    assert "last.ckpt: not converted (beside the selected key): epoch, state_dict, optimizer, hparams" in result.notes


def test_directory_prefers_safetensors_and_rel_root(tmp_path: Path) -> None:
    sd = {"a": random_tensor(torch.float16, (4, 4), 1), "b": random_tensor(torch.int32, (3,), 2)}
    repo = tmp_path / "repo"
    repo.mkdir()
    save({"a": sd["a"]}, repo / "pytorch_model.bin")
    save_file(sd, repo / "model.safetensors")
    staging = tmp_path / "staging"
    result = convert(repo, staging / "weights", WeightsConfig(), rel_root=staging)
    assert result.section["inputs"] == [{"path": "model.safetensors", "format": "safetensors"}]
    assert result.section["files"] == ["weights/model.safetensors"]
    assert [f.path for f in result.files] == ["weights/model.safetensors"]
    assert result.section["tensors"]["a"]["file"] == "weights/model.safetensors"
    check(staging / "weights", sd, plan_section(result.section, "weights/"))
    verify_weights(staging, result.section)
    bin_only = convert(repo, tmp_path / "b", WeightsConfig(files=("*.bin",)))
    assert bin_only.section["inputs"] == [{"path": "pytorch_model.bin", "format": "torch-zip"}]


def plan_section(section: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The section with ``prefix`` taken off its paths (for checks inside the weights dir)."""
    strip = lambda p: p.removeprefix(prefix)  # noqa: E731
    out = dict(section, files=[strip(f) for f in section["files"]])
    out["index"] = strip(section["index"]) if section["index"] else None
    out["tensors"] = {n: dict(t, file=strip(t["file"])) for n, t in section["tensors"].items()}
    return out


def sharded_bin(repo: Path, fmt: str = "zip") -> dict[str, torch.Tensor]:
    repo.mkdir()
    emb = random_tensor(torch.bfloat16, (16, 8), 0)
    shards = [
        {"model.embed_tokens.weight": emb, "model.layers.0.w": random_tensor(torch.float32, (8, 8), 1)},
        {"lm_head.weight": emb, "model.layers.1.w": random_tensor(torch.float32, (8, 8), 2).t()},
    ]
    weight_map = {}
    for i, part in enumerate(shards, 1):
        name = f"pytorch_model-{i:05d}-of-00002.bin"
        save(part, repo / name, fmt)
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (repo / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return {k: v for part in shards for k, v in part.items()}


def test_sharded_input_and_output_with_index(tmp_path: Path) -> None:
    expected = sharded_bin(tmp_path / "repo")
    # one shard each holds the tied embedding: across files it is two tensors, not an alias
    result = convert(tmp_path / "repo", tmp_path / "out", WeightsConfig(max_shard_size=600))
    assert result.section["files"] == ["model-00001-of-00002.safetensors",
                                       "model-00002-of-00002.safetensors"]  # 4 x 256 bytes
    assert result.section["index"] == "model.safetensors.index.json"
    check(tmp_path / "out", expected, result.section)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_bytes())
    assert index["metadata"] == {"total_size": 2 * 256 + 2 * 256}
    assert [f.path for f in result.files][-1] == "model.safetensors.index.json"
    assert [(i["path"], i["format"]) for i in result.section["inputs"]] == [
        ("pytorch_model-00001-of-00002.bin", "torch-zip"), ("pytorch_model-00002-of-00002.bin", "torch-zip"),
        ("pytorch_model.bin.index.json", "index")]


def test_sharded_safetensors_input_reshards_casts_renames(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    parts = [{"module.a": random_tensor(torch.float32, (8,), 1)},
             {"module.b": random_tensor(torch.float32, (4,), 2), "module.n": torch.arange(3)}]
    weight_map = {}
    for i, part in enumerate(parts, 1):
        save_file(part, repo / f"model-{i:05d}-of-00002.safetensors")
        weight_map.update(dict.fromkeys(part, f"model-{i:05d}-of-00002.safetensors"))
    (repo / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg = WeightsConfig(strip_prefixes=("module.",), renames=(Rename("^n$", "count"),),
                        dtype="bfloat16")
    result = convert(repo, tmp_path / "out", cfg)
    expected = {"a": parts[0]["module.a"].bfloat16(), "b": parts[1]["module.b"].bfloat16(),
                "count": parts[1]["module.n"]}
    check(tmp_path / "out", expected, result.section)
    assert {n: t["dtype"] for n, t in result.section["tensors"].items()} == {
        "a": "BF16", "b": "BF16", "count": "I64"}


def test_deterministic_and_modes(tmp_path: Path) -> None:
    expected = sharded_bin(tmp_path / "repo", "legacy")
    old = os.umask(0o027)
    try:
        first = convert(tmp_path / "repo", tmp_path / "a", WeightsConfig(max_shard_size=600))
        second = convert(tmp_path / "repo", tmp_path / "b", WeightsConfig(max_shard_size=600))
        for p in (tmp_path / "a").iterdir():
            assert os.stat(p).st_mode & 0o777 == 0o640
        check(tmp_path / "a", expected, first.section)
    finally:
        os.umask(old)
    assert first.files == second.files and first.section == second.section
    for f in first.files:
        assert (tmp_path / "a" / f.path).read_bytes() == (tmp_path / "b" / f.path).read_bytes()
    again = convert(tmp_path / "repo", tmp_path / "a", WeightsConfig(max_shard_size=600))
    assert again.files == first.files  # rewriting in place gives the same files


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    src = save(views_state_dict(), tmp_path / "m.pt")
    planned = convert(src, tmp_path / "out", WeightsConfig(), dry_run=True)
    assert not (tmp_path / "out").exists() and planned.files == ()
    assert planned.section == convert(src, tmp_path / "out", WeightsConfig()).section


def test_index_problems(tmp_path: Path) -> None:
    sharded_bin(tmp_path / "repo")
    index_path = tmp_path / "repo" / "pytorch_model.bin.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost"] = "pytorch_model-00001-of-00002.bin"
    index_path.write_text(json.dumps(index))
    with pytest.raises(WeightsError, match=r"index.json: tensor 'ghost' is indexed in "):
        convert(tmp_path / "repo", tmp_path / "out", WeightsConfig())
    del index["weight_map"]["ghost"], index["weight_map"]["lm_head.weight"]
    index_path.write_text(json.dumps(index))
    result = convert(tmp_path / "repo", tmp_path / "out", WeightsConfig())
    assert any("1 tensors not in pytorch_model.bin.index.json (converted anyway): lm_head.weight"
               in n for n in result.notes)
    (tmp_path / "repo" / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(WeightsError, match=r"lists shard 'pytorch_model-00002-of-00002.bin', which"):
        convert(tmp_path / "repo", tmp_path / "out2", WeightsConfig())
    assert not (tmp_path / "out2").exists()


def test_bad_inputs_leave_nothing(tmp_path: Path) -> None:
    src = save(views_state_dict(), tmp_path / "m.pt")
    data = src.read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cut.pt"):
        convert(tmp_path / "cut.pt", tmp_path / "out", WeightsConfig())
    with pytest.raises(WeightsError, match=r"no such file"):
        convert(tmp_path / "nope", tmp_path / "out", WeightsConfig())
    with pytest.raises(WeightsError, match=r"m.pt:base and m.pt:lm_head.weight both become"):
        convert(src, tmp_path / "out", WeightsConfig(renames=(Rename(r"^lm_head\.weight$", "base"),)))
    assert not (tmp_path / "out").exists()


def test_failure_after_writing_removes_everything(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    sharded_bin(tmp_path / "repo")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")

    def broken(*args: object, **kwargs: object) -> None:
        raise VerifyError("simulated mismatch")

    monkeypatch.setattr(convert_mod, "verify_written", broken)
    with pytest.raises(PackerError, match=r"simulated mismatch"):
        convert(tmp_path / "repo", out, WeightsConfig(max_shard_size=600))
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_stale_shards_in_destination_are_refused(tmp_path: Path) -> None:
    src = save({"a": torch.ones(2)}, tmp_path / "m.pt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00001-of-00009.safetensors").write_bytes(b"old")
    with pytest.raises(WeightsError, match=r"holds model-00001-of-00009.safetensors"):
        convert(src, out, WeightsConfig())
    assert sorted(p.name for p in out.iterdir()) == ["model-00001-of-00009.safetensors"]


def test_verify_weights_catches_tampering(tmp_path: Path) -> None:
    sharded_bin(tmp_path / "repo")
    result = convert(tmp_path / "repo", tmp_path / "out", WeightsConfig(max_shard_size=600))
    bad = json.loads(json.dumps(result.section))
    bad["tensors"]["model.layers.0.w"]["shape"] = [64]
    with pytest.raises(VerifyError, match=r"tensor 'model.layers.0.w' differs from the manifest"):
        verify_weights(tmp_path / "out", bad)
    index = tmp_path / "out" / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('"total_size":1024', '"total_size":1'))
    with pytest.raises(VerifyError, match=r"metadata.total_size 1 != 1024"):
        verify_weights(tmp_path / "out", result.section)


def test_plain_conversion_imports_no_torch(tmp_path: Path) -> None:
    src = save(views_state_dict(), tmp_path / "m.pt", "legacy")
    code = (
        "import sys\nfrom pathlib import Path\nfrom packer.recipe import WeightsConfig\n"
        "from packer.weights.convert import convert\n"
        f"convert(Path({str(src)!r}), Path({str(tmp_path / 'out')!r}), WeightsConfig())\n"
        "assert 'torch' not in sys.modules, 'torch imported'\nprint('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr
    check(tmp_path / "out", oracle(src), convert(src, tmp_path / "o2", WeightsConfig()).section)


@settings(max_examples=25)
@given(case=state_dicts(), fmt=st.sampled_from(["zip", "legacy"]), cast=st.booleans())
def test_property_agrees_with_torch_load(tmp_path_factory: pytest.TempPathFactory,
                                         case: Any, fmt: str, cast: bool) -> None:
    obj, key, flat = case
    tmp = tmp_path_factory.mktemp("conv")
    src = save(obj, tmp / "ck.pt", fmt)
    cfg = WeightsConfig(key=key, dtype="float32" if cast else None, max_shard_size=48)
    result = convert(src, tmp / "out", cfg)
    expected = oracle(src, key, saved={"state_dict": flat, "model": {"ema": flat}, **flat})
    if cast:
        floats = (torch.float64, torch.float16, torch.bfloat16)
        expected = {k: v.float() if v.dtype in floats else v for k, v in expected.items()}
    check(tmp / "out", expected, result.section)


def test_find_inputs_rules(tmp_path: Path) -> None:
    from packer.weights.inputs import find_inputs

    repo = tmp_path / "repo"
    repo.mkdir()
    with pytest.raises(WeightsError, match=r"no checkpoint found"):
        find_inputs(repo)
    (repo / "model.ckpt").write_bytes(b"x")
    assert find_inputs(repo).files == (repo / "model.ckpt",)
    (repo / "optimizer.pt").write_bytes(b"x")
    with pytest.raises(WeightsError, match=r"several checkpoint files \(model.ckpt, optimizer.pt\)"):
        find_inputs(repo)
    assert find_inputs(repo, ("*.ckpt",)).files == (repo / "model.ckpt",)
    with pytest.raises(WeightsError, match=r"pattern '\*.bin' matches no file"):
        find_inputs(repo, ("*.bin",))
    (repo / "pytorch_model.bin").write_bytes(b"x")
    (repo / "model.safetensors").write_bytes(b"x")
    assert find_inputs(repo).files == (repo / "model.safetensors",)
    assert find_inputs(repo, pickles_first=True).files == (repo / "pytorch_model.bin",)
    (repo / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x"}}))
    with pytest.raises(WeightsError, match=r"shard: '../x' is not a relative file name"):
        find_inputs(repo)
    (repo / "model.safetensors.index.json").write_text("{")
    with pytest.raises(WeightsError, match=r"model.safetensors.index.json: not a checkpoint index"):
        find_inputs(repo)


def _hub_checkpoint(tmp_path: Path, name: str = "pytorch_model.bin", **files: bytes) -> tuple[Path, bytes]:
    """A hub cache snapshot holding a real checkpoint (and ``files``)."""
    from tests.hf_cache import populate_cache

    save({"w": torch.arange(4.0)}, tmp_path / "ck.bin", "zip")
    data = (tmp_path / "ck.bin").read_bytes()
    return populate_cache(tmp_path / "hub", "acme/tiny", {name: data, **files}), data


@pytest.mark.parametrize("target", ["outside the cache", "another repo's blobs", "another snapshot"])
def test_snapshot_links_only_into_its_own_blobs(tmp_path: Path, target: str) -> None:
    """A snapshot's checkpoint that links elsewhere is refused, as the bundle refuses config.json."""
    from packer.weights.inputs import find_inputs
    from tests.hf_cache import populate_cache

    snap, data = _hub_checkpoint(tmp_path)
    assert find_inputs(snap).files == (snap / "pytorch_model.bin",)  # its own blob: followed
    other = populate_cache(tmp_path / "hub", "evil/other", {"pytorch_model.bin": data},
                           commit="f" * 40)
    elsewhere = {"outside the cache": tmp_path / "ck.bin",
                 "another repo's blobs": (other / "pytorch_model.bin").resolve(),
                 "another snapshot": other / "pytorch_model.bin"}[target]
    (snap / "pytorch_model.bin").unlink()
    os.symlink(os.path.relpath(elsewhere, snap), snap / "pytorch_model.bin")
    with pytest.raises(WeightsError, match=r"pytorch_model.bin: checkpoint 'pytorch_model.bin' leads outside "
                                           r".*models--acme--tiny/snapshots/0+.* or .*models--acme--tiny/blobs"):
        find_inputs(snap)
    result = subprocess.run([sys.executable, "-m", "packer", "convert", "--no-sandbox", str(snap),
                             "-o", str(tmp_path / "out")], capture_output=True, text=True, check=False)
    assert result.returncode == 1 and not (tmp_path / "out").exists()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "leads outside" in lines[0], result.stderr


def test_sharded_hub_snapshot_converts(tmp_path: Path) -> None:
    """Index and shards in a hub snapshot all link into the repository's blobs/."""
    save({"w": torch.arange(4.0)}, tmp_path / "ck.bin", "zip")
    index = json.dumps({"weight_map": {"w": "pytorch_model-00001-of-00001.bin"}}).encode()
    snap, _ = _hub_checkpoint(tmp_path, "pytorch_model-00001-of-00001.bin",
                              **{"pytorch_model.bin.index.json": index})
    result = convert(snap, tmp_path / "out", WeightsConfig())
    check(tmp_path / "out", {"w": torch.arange(4.0)}, result.section)
