"""A component folder of the source that is itself a link leading out of the source is refused
before any stage reads under it: each stage confines a component's files to where its folder
resolves, so such a folder would make its target the root (issue 49: the link rule for every
tree packer copies into OUT or an image, not only warm states)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from packer.components import detect_layout
from packer.errors import PackerError, WeightsError
from tests.built import build_dir


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("diffusers")
    from tests.component_fixtures import diffusers_pipeline

    tmp = tmp_path_factory.mktemp("component-links")
    diffusers_pipeline(tmp / "src")
    return tmp / "src"


def _linked(pipeline: Path, tmp: Path, inside: bool) -> Path:
    src = tmp / "src"
    shutil.copytree(pipeline, src)
    target = src / ".vae-real" if inside else tmp / "outside"
    shutil.move(str(src / "vae"), str(target))
    (src / "vae").symlink_to(target)
    return src


def test_a_component_folder_linked_out_of_the_source_is_refused(pipeline: Path, tmp_path: Path) -> None:
    src = _linked(pipeline, tmp_path, inside=False)
    with pytest.raises(WeightsError, match=r"component folder 'vae' leads outside .* \(to .*outside\)"):
        detect_layout(src)
    secret = (tmp_path / "outside" / "diffusion_pytorch_model.bin").read_bytes()[-4096:]
    with pytest.raises(PackerError):
        build_dir(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_relative_to(tmp_path / "outside")
                and not p.is_relative_to(src) and secret in p.read_bytes()]


def test_a_component_folder_linked_inside_the_source_is_taken(pipeline: Path, tmp_path: Path) -> None:
    src = _linked(pipeline, tmp_path, inside=True)
    assert "vae" in [c.name for c in detect_layout(src).components]
