"""The build side's door to :mod:`packer.runtime.place`: where a build's file's bytes are.

One rule set reads a manifest files entry (``size``, ``sha256`` and, for a weight file held in
its layer blob, ``blob`` and ``offset``), and it is the runtime's: the build side may import
the runtime (as :mod:`packer.reading` shares its nesting rule), never the other way round. Here
it raises the caller's :class:`~packer.errors.PackerError` subclass, and a whole files map is
read at once; :func:`held_place` asks a build's view (:class:`~packer.runtime.view_local.LocalView`)
where a file's bytes lie, as the loader does (``packer inspect``). Nothing else under ``packer/``
reads ``blob`` or ``offset`` from an entry or spells the blob folder (tests/test_file_place.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from packer.errors import VerifyError
from packer.runtime.env import ArtifactMismatchError
from packer.runtime.place import BLOBS, MAX_END, PAGE, FilePlace, PlaceError, blob_hex, blob_rel, parse_place
from packer.util.idents import ErrorClass

__all__ = ["BLOBS", "MAX_END", "PAGE", "FilePlace", "PlaceError", "blob_hex", "blob_rel", "parse_place",
           "held_place", "place_of", "places_of"]


def place_of(rel: object, entry: object, *, where: object, error: ErrorClass = VerifyError) -> FilePlace:
    """The place of the file ``rel`` as the files entry ``entry`` gives it (:func:`parse_place`).

    Args:
        rel: the entry's key (its path relative to OUT).
        entry: the entry as the manifest holds it, unchecked.
        where: the manifest it came from, for the message.
        error: the class to raise.

    Raises:
        error: ``<where>: files[<rel>]: <reason>``, one line.
    """
    try:
        return parse_place(rel, entry)
    except PlaceError as e:
        raise error(f"{where}: {e}") from None


def places_of(files: Mapping[str, Any], *, where: object, error: ErrorClass = VerifyError) -> dict[str, FilePlace]:
    """:func:`place_of` of every entry of a manifest's ``files`` map, by path."""
    return {rel: place_of(rel, entry, where=where, error=error) for rel, entry in files.items()}


def held_place(out: Path, manifest: dict[str, Any], rel: str, *, where: object,
               error: ErrorClass = VerifyError) -> FilePlace | None:
    """Where the build at ``out`` keeps the file ``rel`` when its bytes are a span of a layer blob,
    as the build's view answers (:meth:`~packer.runtime.view_local.LocalView.held`, the loader's
    and ``model_dir()``'s answer).

    Args:
        out: the build's directory.
        manifest: its manifest (read and shape-checked by the caller).
        rel: the file's path relative to ``out``.
        where: the manifest as messages name it.
        error: the class to raise.

    Returns:
        The file's place, or None: a plain file of it is where the view looks first, or the
        manifest holds it in no blob (or does not list it).

    Raises:
        error: ``<where>: files[<rel>]: <reason>``, one line: ``rel`` or its entry malformed.
    """
    from packer.runtime.view_local import LocalView  # the view's tower: only a reader of a build needs it

    try:
        return LocalView(manifest, out, named=str(where)).held(rel)
    except ArtifactMismatchError as e:
        raise error(str(e)) from None
