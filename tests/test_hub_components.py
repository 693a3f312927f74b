"""Multi-component sources in huggingface_hub's cache layout build and load back.

In the cache every file of a snapshot is a link into its repository's ``blobs/``, the files of
a component folder (``unet/``, ``2_Dense/``) included: those links lead inside
(:func:`packer.util.idents.link_roots`), while a link into another repository still leads outside.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from tests.component_fixtures import diffusers_pipeline, import_loader, sentence_transformer
from tests.hf_cache import populate_cache

pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("build_env")  # tests/conftest.py: no start-up log, a private bundle cache


def hub_build(tmp_path: Path, repo: str) -> subprocess.CompletedProcess[str]:
    """``packer build`` of ``hf://REPO@main`` from the offline cache ``tmp_path/hub`` into ``tmp_path/out``
    (a child: huggingface_hub reads HF_HUB_CACHE when it is imported)."""
    (tmp_path / "r.toml").write_text(f'name = "m"\nversion = "1"\nsource = "hf://{repo}@main"\n')
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "packer", "build", "-q", "--json", "-o", str(tmp_path / "out"),
                           str(tmp_path / "r.toml")], capture_output=True, text=True, env=env, timeout=600,
                          check=False)


def built(tmp_path: Path, repo: str) -> dict[str, Any]:
    proc = hub_build(tmp_path, repo)
    assert proc.returncode == 0, proc.stderr
    return cast(dict[str, Any], json.loads((tmp_path / "out" / "manifest.json").read_bytes()))


def _cached(tmp_path: Path, saved: Path, repo: str) -> Path:
    """``saved``'s files as one commit of ``repo`` in the hub cache; the snapshot folder."""
    files = {p.relative_to(saved).as_posix(): p.read_bytes() for p in sorted(saved.rglob("*")) if p.is_file()}
    snap = populate_cache(tmp_path / "hub", repo, files)
    assert all(p.is_symlink() for p in snap.rglob("*") if not p.is_dir())
    return snap


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_diffusers_pipeline_in_the_hub_cache(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

    diffusers_pipeline(tmp_path / "saved")
    snap = _cached(tmp_path, tmp_path / "saved", "acme/tiny-sd")
    out = tmp_path / "out"
    manifest = built(tmp_path, "acme/tiny-sd")
    assert set(manifest["weights"]["components"]) == {"text_encoder", "unet", "vae"}
    assert manifest["source"]["revision"] == snap.name
    pl = import_loader(out)
    for name, cls in (("unet", UNet2DConditionModel), ("vae", AutoencoderKL), ("text_encoder", CLIPTextModel)):
        want = cls.from_pretrained(snap / name).state_dict()
        _same(pl.load_weights("cpu", component=name), want)
    assert (pl.model_dir() / "unet" / "diffusion_pytorch_model.safetensors").is_file()


def test_a_sentence_transformers_stack_in_the_hub_cache(tmp_path: Path) -> None:
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer

    sentence_transformer(tmp_path / "saved")
    snap = _cached(tmp_path, tmp_path / "saved", "acme/tiny-st")
    out = tmp_path / "out"
    manifest = built(tmp_path, "acme/tiny-st")
    assert set(manifest["weights"]["components"]) == {"model", "2_Dense"}
    pl = import_loader(out)
    sentences = ["w1 w2 w3", "w4 w5"]
    want = SentenceTransformer(str(snap), device="cpu")
    got = SentenceTransformer(str(pl.model_dir()), device="cpu")
    assert torch.equal(got.encode(sentences, convert_to_tensor=True), want.encode(sentences, convert_to_tensor=True))
    _same(pl.load_weights("cpu", component="2_Dense"), want[2].state_dict())


def test_a_component_linking_into_another_repo_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    diffusers_pipeline(tmp_path / "saved")
    snap = _cached(tmp_path, tmp_path / "saved", "acme/tiny-sd")
    other = populate_cache(tmp_path / "hub", "evil/other", {"w.bin": b"x"}, commit="f" * 40)
    weights = next(p for p in (snap / "unet").iterdir() if p.name.startswith("diffusion_pytorch_model"))
    weights.unlink()
    os.symlink(os.path.relpath(os.path.realpath(other / "w.bin"), weights.parent), weights)
    proc = hub_build(tmp_path, "acme/tiny-sd")
    assert proc.returncode == 1 and "leads outside" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
