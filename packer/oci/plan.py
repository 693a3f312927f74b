"""The layer plan: which OUT files go in which layer, least-changing at the bottom.

Pure: no I/O. Order, bottom to top:

1. one uncompressed layer per weight file (``weights/*.safetensors``): identical weights
   give identical layers, deduplicated across builds and registries, and nothing is gained
   by compressing float data;
2. one compressed layer with ``bundle.tar.zst``, ``manifest.json`` (the artifact manifest)
   and any other small artifact file (e.g. the shard index);
3. one compressed layer with ``packer_loader.py``, the file most likely to change.

``image.weights = "external"`` leaves every ``weights/`` file out; ``image.single_layer``
puts everything in one layer compressed with ``image.compression``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from packer.errors import ImageError
from packer.formats import LOADER_NAME, SAFETENSORS_SUFFIX
from packer.fsutil import FileEntry
from packer.oci.tar_writer import FileRange, Owner, SourceFile, tar_members, tar_pieces
from packer.recipe import ImageConfig
from packer.tarfmt import source_date_epoch

WEIGHTS_DIR = "weights/"


@dataclass(frozen=True)
class PlannedFile:
    """One file of a layer: its path relative to OUT (its source) and in the image."""

    rel_path: str
    dest: str
    size: int
    sha256: str


@dataclass(frozen=True)
class PlannedLayer:
    """One layer: a short name, its files and its compression."""

    name: str
    files: tuple[PlannedFile, ...]
    compression: str

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def created_by(self, prefix: str) -> str:
        """The history line: what packer added, and where."""
        names = ", ".join(f.rel_path for f in self.files)
        return f"packer: ADD {names} {prefix}/ ({self.name} layer)"


@dataclass(frozen=True)
class ImagePlan:
    """The whole image plan, printable by ``--dry-run``."""

    tag: str
    prefix: str
    owner: Owner
    compression: str
    weights: str
    base: str | None
    platform: str
    layers: tuple[PlannedLayer, ...]

    def as_json(self) -> dict[str, Any]:
        """JSON-able summary (for ``--dry-run`` and logs)."""
        return {
            "tag": self.tag, "prefix": self.prefix, "owner": str(self.owner),
            "compression": self.compression, "weights": self.weights, "base": self.base,
            "platform": self.platform,
            "layers": [
                {"name": la.name, "compression": la.compression, "size": la.size,
                 "files": [f.dest for f in la.files]}
                for la in self.layers
            ],
        }


def _prefix(cfg: ImageConfig) -> str:
    return cfg.prefix.rstrip("/") or "/"


def _dest(prefix: str, rel_path: str) -> str:
    return f"{prefix.rstrip('/')}/{rel_path}"


def weight_layer_framing(
    cfg: ImageConfig, rel_path: str, size: int, *, mtime: int | None = None
) -> tuple[bytes, bytes]:
    """The bytes around a weight file's content in its own uncompressed layer.

    ``prefix + content + suffix`` is exactly the layer tar the image stage writes for that
    file (parent directories, the file's header, padding, end-of-archive blocks), so the
    weights stage can hash the layer while it writes the file and the image stage only
    copies. Pure apart from reading ``SOURCE_DATE_EPOCH`` when ``mtime`` is None.

    Args:
        cfg: the recipe's ``[image]`` section (prefix and owner matter).
        rel_path: the file's path relative to OUT, e.g. ``weights/model.safetensors``.
        size: the file's final size in bytes.
        mtime: the entries' mtime; None reads ``SOURCE_DATE_EPOCH`` as the image stage does.

    Returns:
        ``(prefix, suffix)``.

    Raises:
        ImageError: a bad owner, path or ``SOURCE_DATE_EPOCH``.
    """
    if mtime is None:
        mtime = source_date_epoch(ImageError)
    prefix = _prefix(cfg)
    src = SourceFile(_dest(prefix, rel_path), size, source=Path(rel_path))  # never read here
    members = tar_members([src], owner=Owner.parse(cfg.owner), prefix=prefix)
    pieces = list(tar_pieces(members, mtime=mtime))
    # the file's content is the one FileRange piece; an empty file has none
    cut = next((i for i, p in enumerate(pieces) if isinstance(p, FileRange)), len(pieces))
    head = [p for p in pieces[:cut] if isinstance(p, bytes)]
    tail = [p for p in pieces[cut + 1 :] if isinstance(p, bytes)]
    return b"".join(head), b"".join(tail)


def plan_layers(
    files: Sequence[FileEntry],
    cfg: ImageConfig,
    *,
    name: str,
    version: str,
    manifest: FileEntry,
) -> ImagePlan:
    """Plan the image's layers.

    Args:
        files: the artifact files (paths relative to OUT); ``manifest.json`` must not be one.
        cfg: the recipe's ``[image]`` section.
        name: model name; with ``version`` it makes the default tag ``name:version``.
        manifest: the artifact manifest as a file entry (path ``manifest.json``).

    Returns:
        The :class:`ImagePlan`.

    Raises:
        ImageError: an unsafe path, or no files left to put in the image.
    """
    prefix = _prefix(cfg)
    owner = Owner.parse(cfg.owner)
    weights: list[PlannedFile] = []
    meta: list[PlannedFile] = []
    top: list[PlannedFile] = []
    for entry in sorted([*files, manifest], key=lambda e: e.path):
        p = PurePosixPath(entry.path)
        if p.is_absolute() or ".." in p.parts or not entry.path:
            raise ImageError(f"artifact file {entry.path!r}: expected a relative path inside OUT")
        pf = PlannedFile(entry.path, _dest(prefix, entry.path), entry.size, entry.sha256)
        if entry.path.startswith(WEIGHTS_DIR):
            if cfg.weights == "external":
                continue
            (weights if entry.path.endswith(SAFETENSORS_SUFFIX) else meta).append(pf)
        elif entry.path == LOADER_NAME:
            top.append(pf)
        else:
            meta.append(pf)
    if cfg.single_layer:
        everything = tuple(sorted(weights + meta + top, key=lambda f: f.dest))
        layers: tuple[PlannedLayer, ...] = (PlannedLayer("model", everything, cfg.compression),)
    else:
        layers = tuple(
            [PlannedLayer(f"weights {PurePosixPath(w.rel_path).name}", (w,), "none")
             for w in weights]
            + ([PlannedLayer("bundle", tuple(meta), cfg.compression)] if meta else [])
            + ([PlannedLayer("loader", tuple(top), cfg.compression)] if top else [])
        )
    return ImagePlan(
        tag=cfg.tag or f"{name}:{version}", prefix=prefix, owner=owner,
        compression=cfg.compression, weights=cfg.weights, base=cfg.base,
        platform=cfg.platform, layers=layers,
    )
