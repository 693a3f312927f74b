"""The plain model directory of a build (``model_dir()``): each library's own file names, all links.

The bundle's files at their relative paths (``config.json``, ``tokenizer/``, ``scheduler/
scheduler_config.json``, ``unet/config.json``, ``2_Dense/config.json``...) and each weight
file at its place in the build's model tree (:func:`packer.runtime.components.model_tree`):
``model.safetensors`` for a plain model, ``unet/diffusion_pytorch_model.safetensors`` and
``text_encoder/model.safetensors`` for a diffusers pipeline, ``2_Dense/model.safetensors``
for a sentence-transformers module, ``adapter_model.safetensors`` for a PEFT adapter.
Folders are real directories; every file is a symbolic link. A signed build's ``model.sig``
is linked in too (``packer.runtime.signature.model_layout`` is this layout's list of files and
digests, what ``model.sig`` signs), so ``model_signing verify key DIR --signature
DIR/model.sig --allow_symlinks`` checks the directory.

A weight file that is a plain file (an image's model directory, ``PACKER_WEIGHTS_DIR``, a
``weights/`` folder) is linked. One the build holds only inside its image layer blob (OUT as
``packer build`` writes it) is no file a library can open, so it is materialized once, beside
the directory, in ``<directory>.weights/``: ``os.copy_file_range`` from the blob at its page
offset (the kernel clones the extents where the file system shares them, btrfs and XFS; else
it copies), the link pointing there. That folder also links the build's ``packer_loader.py``,
so the vLLM load format, which follows the weight links to find the build, finds it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .chunks import table_in_tree
from .components import model_tree
from .env import ArtifactMismatchError
from .reading import walk_tree
from .served import check_copies, check_links
from .signature import SIGNATURE_FILE

LOADER_FILE = "packer_loader.py"

if TYPE_CHECKING:
    from .loading import Loader
    from .place import FilePlace


def _plan(bundle: Path, pairs: list[tuple[str, str]], loader: Loader,
          copies: dict[str, FilePlace], copy_dir: Path) -> dict[str, str]:
    """``{path in the directory: link target}``: the bundle's files, then the weights over the
    tree (a materialized one, ``copies``, to its copy in ``copy_dir``)."""
    taken = {dst for dst, _ in pairs}
    links = {}
    for rel, path, mode in walk_tree(bundle):
        if not stat.S_ISDIR(mode) and rel not in taken:
            links[rel] = os.path.abspath(path)
    for dst, rel in pairs:
        links[dst] = os.path.abspath(copy_dir / dst if dst in copies else loader.path(rel))
    return links


def _copies(loader: Loader, pairs: list[tuple[str, str]]) -> dict[str, FilePlace]:
    """``{path in the directory: its place}`` of the weight files held inside a layer blob."""
    held = {dst: loader.held(rel) for dst, rel in pairs}
    return {dst: place for dst, place in held.items() if place is not None}


def materialize(src: Path, offset: int, size: int, dest: Path) -> None:
    """``dest`` (created): the ``size`` bytes at ``offset`` of ``src``, by ``copy_file_range``.

    The page-aligned part first, then the tail, so a file system that shares extents (btrfs,
    XFS with reflinks) can clone whole blocks instead of copying them; elsewhere the kernel
    copies, and where it cannot (another file system type, an old kernel), pread/pwrite does.

    Raises:
        ArtifactMismatchError: ``src`` ends before ``offset + size``.
        OSError: ``dest`` cannot be written.
    """
    from .reading import open_regular

    fd = open_regular(src)
    try:
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            aligned = size - size % 4096
            for start, end in ((0, aligned), (aligned, size)):
                _copy_range(fd, out, offset + start, start, end - start, src)
        finally:
            os.close(out)
    finally:
        os.close(fd)


def _copy_range(src: int, dst: int, at: int, to: int, n: int, where: Path) -> None:
    kernel = hasattr(os, "copy_file_range")
    while n > 0:
        got = 0
        if kernel:
            try:
                got = os.copy_file_range(src, dst, n, at, to)
            except OSError:  # EXDEV, ENOSYS, EINVAL...: plain reads and writes instead
                kernel = False
                continue
        else:
            data = os.pread(src, min(n, 8 * 2**20), at)
            got = os.pwrite(dst, data, to) if data else 0
        if got <= 0:
            raise ArtifactMismatchError(f"{os.path.abspath(where)}: ends at byte {at}, before the weight file it holds")
        at, to, n = at + got, to + got, n - got


def _fill_copies(loader: Loader, copies: dict[str, FilePlace], copy_dir: Path) -> None:
    """Make ``copy_dir`` once: the materialized weight files and the link to the build's loader."""
    if copy_dir.is_dir():
        return

    def fill(tmp: Path) -> None:
        for dst, place in copies.items():
            (tmp / dst).parent.mkdir(parents=True, exist_ok=True)
            materialize(*place.path(loader.root), tmp / dst)
        os.symlink(os.path.abspath(loader.root / LOADER_FILE), tmp / LOADER_FILE)

    _made_once(copy_dir, fill)


def _made_once(dest: Path, fill: Callable[[Path], None]) -> None:
    """Make the folder ``dest`` by ``fill`` under a temporary name, then rename it into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        fill(tmp)
        os.chmod(tmp, 0o755)
        os.rename(tmp, dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not dest.is_dir():  # another process may have won the rename
            raise


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
        ArtifactMismatchError: no bundle, a weight file missing or of another size, a
            directory made before that holds other entries than the links it was made with,
            or materialized weights (``<directory>.weights/``) of another size (sha256 under
            ``PACKER_REQUIRE_SIGNATURE``) or with other entries.
    """
    bundle = loader.bundle_dir()
    pairs = [*model_tree(loader.manifest["weights"]), *table_in_tree(loader.manifest["weights"])]
    for _, rel in pairs:
        loader.check_file(rel, verify=False)
    if loader.path(SIGNATURE_FILE).is_file():  # a signed build: model_signing finds model.sig inside
        pairs.append((SIGNATURE_FILE, SIGNATURE_FILE))
    key = hashlib.sha256("\n".join([str(bundle), *(f"{dst}={loader.path(rel).resolve()}" for dst, rel in pairs)])
                         .encode())
    base = Path(root) if root is not None else bundle.parent
    out = base / f"model-{key.hexdigest()[:20]}"
    copies = _copies(loader, pairs)
    copy_dir = out.with_name(out.name + ".weights")
    links = _plan(bundle, pairs, loader, copies, copy_dir)
    if copies:
        base.mkdir(parents=True, exist_ok=True)
        _fill_copies(loader, copies, copy_dir)
        files = {dst: place.as_json() for dst, place in copies.items()}
        check_copies(copy_dir, files, {LOADER_FILE: os.path.abspath(loader.root / LOADER_FILE)},
                     hashes=bool(loader.settings.require_signature))
    if out.is_dir():  # made before, maybe by another process: reused only as it was made
        check_links(out, links)
        return out
    base.mkdir(parents=True, exist_ok=True)
    _made_once(out, lambda tmp: _fill(tmp, links))
    return out
