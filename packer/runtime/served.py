"""What is served is what is pinned: the directories a server reads, checked file by file.

The loader verifies the weights as it loads them, but a serving engine or transformers also
reads plain files by itself: the extracted bundle (config, tokenizer, chat template) and the
model directory laid out for engines. These directories are reused across processes (the
bundle cache, ``model_dir()``, an image's mounted model directory), so a reuse checks them
here instead of trusting that nobody wrote there since:

* :func:`check_extracted`: an extracted bundle holds exactly the manifest's members as
  regular files (no link, no extra file), each of its size, and its sha256 where asked
  (``PACKER_REQUIRE_SIGNATURE``);
* :func:`check_links`: a laid-out model directory holds exactly the links it was made with;
* :func:`check_copies`: the weight files materialized for it (from a layer blob) are exactly
  those, of their sizes (and sha256 where asked);
* :func:`check_signed_dir`: every file an engine may read in a model directory is one that the
  signature covers, byte for byte (the vLLM load format, under ``PACKER_REQUIRE_SIGNATURE``).

A fault is one :class:`~packer.runtime.env.ArtifactMismatchError` naming the absolute path.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from .env import ArtifactMismatchError
from .reading import check_rel, sha256_regular, walk_tree


def walk(root: Path) -> dict[str, tuple[str, Path]]:
    """``{relative posix path: (kind, path)}`` below ``root``, links not followed into folders.

    ``kind`` is ``dir``, ``file`` (a regular file), ``link`` (to a regular file) or ``other``
    (a link to a folder, a dangling link, a FIFO...). Folders come with their contents.

    Raises:
        ArtifactMismatchError: ``root`` or a folder below it cannot be listed, a link loop, or
            folders nested deeper than :data:`~packer.runtime.reading.MAX_TREE_DEPTH`.
    """
    return {rel: (_kind(path), path) for rel, path, _mode in walk_tree(root)}


def _kind(path: Path) -> str:
    mode = os.lstat(path).st_mode
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        try:
            return "link" if stat.S_ISREG(os.stat(path).st_mode) else "other"
        except OSError:  # dangling, or a loop: refused by whoever looks at it
            return "other"
    return "other"


def _refuse(path: Path, why: str, fix: str) -> ArtifactMismatchError:
    return ArtifactMismatchError(f"{os.path.abspath(path)}: {why}; {fix}")


def check_extracted(root: Path, members: Iterable[Mapping[str, Any]], *, hashes: bool) -> None:
    """Refuse an extracted bundle at ``root`` that is not exactly ``members`` (the manifest's).

    Args:
        root: the bundle cache's directory of this bundle.
        members: the manifest's ``bundle.members`` (``name``, ``size``, ``sha256``).
        hashes: also compare every member's sha256 (else name, type and size only).

    Raises:
        ArtifactMismatchError: a member missing, a link or another type, another size or
            sha256, or a file the bundle does not hold.
    """
    fix = f"the bundle cache was changed after extraction: remove {os.path.abspath(root)}"
    want = {check_rel(m["name"], "the manifest's bundle members"): m for m in members}
    found = walk(root)
    for rel, (kind, path) in found.items():
        if kind == "dir":
            continue
        if rel not in want:
            raise _refuse(path, "not a member of this build's bundle", fix)
        if kind != "file":
            raise _refuse(path, "not a regular file (extraction writes only regular files)", fix)
    _check_pinned(root, want, found, hashes, fix)


def _check_pinned(root: Path, want: Mapping[str, Mapping[str, Any]], found: Mapping[str, tuple[str, Path]],
                  hashes: bool, fix: str) -> None:
    """Every file of ``want`` is a regular file of its ``size`` (and ``sha256`` with ``hashes``)."""
    for rel, m in want.items():
        path = root / rel
        if found.get(rel, ("",))[0] != "file":
            raise _refuse(path, "missing", fix)
        size, digest = sha256_regular(path) if hashes else (path.stat().st_size, "")
        if size != m["size"] or digest not in ("", m["sha256"]):
            got = f"{size} bytes, sha256 {digest[:16]}..." if digest else f"{size} bytes"
            raise _refuse(path, f"{got}; the manifest pins {m['size']} bytes, sha256 {m['sha256'][:16]}...", fix)


def check_links(root: Path, want: Mapping[str, str]) -> None:
    """Refuse a laid-out model directory that is not exactly the links ``want`` (``rel -> target``).

    Raises:
        ArtifactMismatchError: an entry missing, changed, or one that was not laid out.
    """
    fix = f"the model directory was changed after it was made: remove {os.path.abspath(root)}"
    found = walk(root)
    for rel, (kind, path) in found.items():
        if kind == "dir":
            continue
        if rel not in want:
            raise _refuse(path, "not a file of this build's model directory", fix)
        if not path.is_symlink() or os.readlink(path) != want[rel]:
            raise _refuse(path, f"not the link to {want[rel]} it was made as", fix)
    for rel in want:
        if rel not in found:
            raise _refuse(root / rel, "missing", fix)


def check_copies(root: Path, files: Mapping[str, Mapping[str, Any]], links: Mapping[str, str], *,
                 hashes: bool) -> None:
    """Refuse materialized weight files at ``root`` that are not exactly ``files`` (regular
    files of the manifest's ``size``, and ``sha256`` with ``hashes``) and the ``links``.

    Raises:
        ArtifactMismatchError: an entry missing, of another kind, size or sha256, or extra.
    """
    fix = f"the materialized weights were changed after they were made: remove {os.path.abspath(root)}"
    found = walk(root)
    for rel, (kind, path) in found.items():
        if kind == "dir":
            continue
        if rel in links:
            if not path.is_symlink() or os.readlink(path) != links[rel]:
                raise _refuse(path, f"not the link to {links[rel]} it was made as", fix)
        elif rel not in files:
            raise _refuse(path, "not a weight file of this build", fix)
        elif kind != "file":
            raise _refuse(path, "not a regular file", fix)
    _check_pinned(root, files, found, hashes, fix)
    for rel in links:
        if rel not in found:
            raise _refuse(root / rel, "missing", fix)


def check_signed_dir(root: Path, signed: Mapping[str, str], *, ignored: Callable[[str], bool],
                     hashed: Callable[[str], bool]) -> list[str]:
    """Refuse a model directory where a file an engine may read is not the signed one.

    Args:
        root: the model directory the engine was given.
        signed: ``{name: sha256 hex}`` that ``model.sig`` signs (verified by the caller).
        ignored: names the engine never reads (the loader and its runtime, the manifest...).
        hashed: signed names whose bytes are compared here; the others (the weights, which
            the loader hashes while it loads them) are compared by kind only.

    Returns:
        the signed names found, sorted.

    Raises:
        ArtifactMismatchError: a file the signature does not cover, a signed file whose
            sha256 differs, a FIFO, device, dangling link or link to a folder, a link loop.
    """
    fix = "serve the signed build's model directory as it was made (packer_loader.py --model-dir)"
    seen = []
    for rel, (kind, path) in walk(root).items():
        if kind == "dir" or ignored(rel):
            continue
        if rel not in signed:
            raise _refuse(path, "not covered by the build's signature (model.sig), and the engine may read it", fix)
        if kind not in ("file", "link"):
            raise _refuse(path, "not a regular file", fix)
        if hashed(rel):
            _, digest = sha256_regular(path)
            if digest != signed[rel]:
                raise _refuse(path, f"sha256 {digest[:16]}..., the signature says {signed[rel][:16]}...", fix)
        seen.append(rel)
    return seen
