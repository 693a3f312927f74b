"""A build's view over local files: OUT, an image's model directory, weights mounted elsewhere.

A weight file is a plain file where one exists (under ``weights_dir``, as in OUT, or at the top
of an image's model directory beside the config), else the span of its image layer blob the
manifest places it in (a build that keeps one copy). Its bytes are an open file's descriptor:
mapped, read with ``preadv``, hashed by :mod:`.proof` when a reader asks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .env import ArtifactMismatchError
from .place import FilePlace
from .reading import PositionalSource, open_regular
from .shards import Shard, open_shard
from .view import BuildView

if TYPE_CHECKING:
    from types import ModuleType

    import torch

    from .timeline import Timeline


class LocalView(BuildView):
    """The build under ``root`` on this machine; weight files under ``weights_dir`` when given.

    Args:
        manifest: the build's manifest.
        root: the artifact root (OUT or a model directory).
        weights_dir: the directory that holds the ``model*.safetensors`` files (mounted weights).
        named: the manifest as refusals name it (:class:`~.view.BuildView`).
    """

    def __init__(self, manifest: dict[str, Any], root: str | Path, weights_dir: str | Path | None = None, *,
                 named: str = "the manifest") -> None:
        super().__init__(manifest, root, named=named)
        self.weights_dir = Path(weights_dir) if weights_dir else None

    def locate(self, rel: str) -> tuple[Path, int]:
        """Where the artifact ``rel``'s bytes are: ``(file, offset of its first byte in it)``.

        A plain file where one exists (under ``weights_dir``, as in OUT, or at the top of an
        image's model directory), offset 0; else, for a weight file the build holds in its
        image layer blob (:meth:`held`), that blob under the root and the page offset of the
        file's bytes in it.

        Raises:
            ArtifactMismatchError: ``rel`` is not a plain relative path, or its files entry is
                malformed (:func:`~.place.parse_place`).
        """
        place = self.held(rel)
        if place is not None:
            return place.path(self.root)[:2]
        return self._plain(rel) or self.root / rel, 0

    def held(self, rel: str) -> FilePlace | None:
        """The place of ``rel`` when its bytes are read inside a layer blob: no plain file of it
        is where :meth:`locate` looks first, and the manifest holds it in one.

        Raises:
            ArtifactMismatchError: as :meth:`locate`.
        """
        place = self.place(rel)
        if place is None or not place.in_blob or self._plain(rel) is not None:
            return None
        return place

    def _plain(self, rel: str) -> Path | None:
        """Where a plain file of ``rel`` is, or None: a weight file found in none of its places."""
        if not rel.startswith("weights/"):
            return self.root / rel
        if self.weights_dir is not None:
            return self.weights_dir / rel[len("weights/"):]
        nested, flat = self.root / rel, self.root / rel[len("weights/"):]
        if nested.exists():
            return nested
        return flat if flat.exists() else None

    def open_weight(self, rel: str, tensors: dict[str, Any], *, random_access: bool = False) -> Shard:
        """The weight file ``rel`` opened (see :func:`~.shards.open_shard`): a descriptor of its
        file, or of the layer blob holding it (messages then name its path in the build)."""
        path, base = self.locate(rel)
        return open_shard(rel, path, self.manifest["files"][rel], tensors, random_access=random_access,
                          base=base, label=self.root / rel if base else None)

    def open_bytes(self, rel: str) -> tuple[int | PositionalSource, int, str]:
        path, base = self.locate(rel)
        try:
            fd = open_regular(path)  # a FIFO or a device is refused by type, never read
        except FileNotFoundError:
            raise ArtifactMismatchError(f"{rel}: missing (looked for {path})") from None
        where = f"{os.path.abspath(path)} ({rel} at offset {base})" if base else os.path.abspath(path)
        return fd, base, where

    def proof_buffers(self, torch: ModuleType, shards: list[Shard],
                      timeline: Timeline) -> list[tuple[torch.Tensor, int]]:
        """The private mappings of the files: a chunk is hashed from the mapping when first used."""
        from .cpu import map_shards

        return map_shards(torch, shards, timeline)
