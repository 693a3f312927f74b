"""``packer stream``: a model directory whose weights stream from a registry.

The build side's door to the runtime's view of a registry image
(:func:`packer.runtime.view_open.open_view`): the image's small files (config, tokenizer, chunk
table, manifest, loader) are fetched, each layer proven by its digest, into a new directory with
``packer-stream.json``; its ``packer_loader.py`` (and the vLLM load format,
which runs it) then reads every weight from the registry, chunk by chunk, proven.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from packer.errors import ImageError, UsageError
from packer.runtime.env import ArtifactMismatchError, is_ref
from packer.runtime.view_open import open_view
from packer.util.fsutil import remove_tree
from packer.util.show import shell_word


def lay_out(ref: str, dest: Path | None = None) -> tuple[Path, str]:
    """Fetch the small files of the image ``ref`` into ``dest`` (default: a new private directory).

    Args:
        ref: ``oci://HOST[:PORT]/REPO@sha256:<hex>`` (or ``:TAG``, resolved once and reported).
        dest: a directory that does not exist or is empty; nothing is left in it on failure.

    Returns:
        ``(the directory, the digest-pinned reference its weights stream from)``.

    Raises:
        UsageError: ``ref`` is no ``oci://`` reference, or ``dest`` is not empty (exit code 2).
        ImageError: the registry or the image refused (one line: reference and reason).
    """
    if not is_ref(ref):
        raise UsageError(f"stream: {ref[:100]!r} is not an oci:// reference; expected oci://HOST/REPO@sha256:<hex>")
    made = dest is not None and not dest.exists()
    if dest is not None and dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(f"stream: {dest} exists and is not an empty directory")
    if dest is not None and not dest.parent.is_dir():  # checked before the registry is asked anything
        parent = dest.parent
        raise UsageError(f"stream: {parent} does not exist; create it first (mkdir -p {shell_word(str(parent))}), "
                         "or name a --dir whose parent exists")
    try:
        view = open_view(None, ref, dest=dest, keep=True)
    except BaseException as e:
        if dest is not None:
            _clean(dest, made)
        if isinstance(e, ArtifactMismatchError):
            raise ImageError(f"stream: {e}") from None
        raise
    return view.root, view.origin


def _clean(dest: Path, made: bool) -> None:
    """Leave ``dest`` as it was: gone if this call made it, else empty (a cleanup error never
    replaces the error behind it)."""
    if made:
        remove_tree(dest, ignore_errors=True)
        return
    for child in list(dest.iterdir()) if dest.is_dir() else []:
        if child.is_dir() and not child.is_symlink():
            remove_tree(child, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(child)
