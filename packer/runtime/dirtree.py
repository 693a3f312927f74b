"""The plain model directory of a build (``model_dir()``): each library's own file names, all links.

The bundle's files at their relative paths (``config.json``, ``tokenizer/``, ``scheduler/
scheduler_config.json``, ``unet/config.json``, ``2_Dense/config.json``...) and each weight
file at its place in the build's model tree (:func:`packer.runtime.components.model_tree`):
``model.safetensors`` for a plain model, ``unet/diffusion_pytorch_model.safetensors`` and
``text_encoder/model.safetensors`` for a diffusers pipeline, ``2_Dense/model.safetensors``
for a sentence-transformers module, ``adapter_model.safetensors`` for a PEFT adapter.
Folders are real directories; every file is a symbolic link (nothing is copied). A signed
build's ``model.sig`` is linked in too (``packer.runtime.signature.model_layout`` is this
layout's list of files and digests, what ``model.sig`` signs), so ``model_signing verify key
DIR --signature DIR/model.sig --allow_symlinks`` checks the directory.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from .components import model_tree
from .served import check_links
from .signature import SIGNATURE_FILE

if TYPE_CHECKING:
    from .loading import Loader


def _plan(bundle: Path, pairs: list[tuple[str, str]], loader: Loader) -> dict[str, str]:
    """``{path in the directory: link target}``: the bundle's files, then the weights over the tree."""
    taken = {dst for dst, _ in pairs}
    links = {}
    for top, dirs, files in os.walk(bundle):
        dirs.sort()
        rel_top = Path(top).relative_to(bundle)
        for name in sorted(files):
            rel = (rel_top / name).as_posix()
            if rel not in taken:
                links[rel] = os.path.abspath(Path(top) / name)
    for dst, rel in pairs:
        links[dst] = os.path.abspath(loader.path(rel))
    return links


def _fill(tmp: Path, links: dict[str, str]) -> None:
    """Make the links (real folders for their folders)."""
    for rel, target in links.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, tmp / rel)


def lay_out(loader: Loader, *, root: str | Path | None = None) -> Path:
    """Make (once per node and content) the model directory of ``loader``'s build; return it.

    Args:
        loader: the :class:`Loader` of the whole build (not of one component).
        root: where to make it (default: beside the extracted bundle).

    Returns:
        the directory, named after the bundle and the weight files it links.

    Raises:
        ArtifactMismatchError: no bundle, a weight file missing or of another size, or a
            directory made before that holds other entries than the links it was made with.
    """
    bundle = loader.bundle_dir()
    pairs = model_tree(loader.manifest["weights"])
    for _, rel in pairs:
        loader.check_file(rel, verify=False)
    if loader.path(SIGNATURE_FILE).is_file():  # a signed build: model_signing finds model.sig inside
        pairs.append((SIGNATURE_FILE, SIGNATURE_FILE))
    key = hashlib.sha256("\n".join([str(bundle), *(f"{dst}={loader.path(rel).resolve()}" for dst, rel in pairs)])
                         .encode())
    base = Path(root) if root is not None else bundle.parent
    out = base / f"model-{key.hexdigest()[:20]}"
    links = _plan(bundle, pairs, loader)
    if out.is_dir():  # made before, maybe by another process: reused only as it was made
        check_links(out, links)
        return out
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=base))
    try:
        _fill(tmp, links)
        os.chmod(tmp, 0o755)
        os.rename(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not out.is_dir():  # another process may have won the rename
            raise
    return out
