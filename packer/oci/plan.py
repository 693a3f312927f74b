"""The layer plan: which OUT files go in which layer, least-changing at the bottom.

Pure: no I/O. The prefix (``/models`` by default) is a plain model directory: the files of
OUT's ``weights/`` sit at its top (:func:`image_rel`), beside the bundle's members as plain
files, so a read-only mount of the image is a directory transformers and vLLM read as is.
Order, bottom to top:

1. one uncompressed layer per weight file (``model*.safetensors``): identical weights
   give identical layers, deduplicated across builds and registries, and nothing is gained
   by compressing float data;
2. one compressed layer with the model files: the bundle's members (config, generation
   config, tokenizer files) as plain files, and the shard index;
3. one compressed layer with ``bundle.tar.zst``, ``manifest.json`` (the artifact manifest)
   and any other small artifact file;
4. one compressed layer with the loader's files (``packer_loader.py``, executable, and what
   the loader stage wrote beside it), the files most likely to change.

``image.weights = "external"`` leaves every ``weights/`` file out; ``image.single_layer``
puts everything in one layer compressed with ``image.compression``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

from packer.errors import ImageError
from packer.oci.tar_writer import FileRange, Owner, SourceFile, tar_members, tar_pieces
from packer.recipe import ImageConfig
from packer.util.formats import LOADER_NAME, SAFETENSORS_SUFFIX
from packer.util.fsutil import FileEntry
from packer.util.tarfmt import source_date_epoch

WEIGHTS_DIR = "weights/"
WEIGHT_ALIGN = 4096  # a weight file's data starts at a page boundary of its layer: mapped in place


@dataclass(frozen=True)
class PlannedFile:
    """One file of a layer: its path relative to OUT (its source) and in the image."""

    rel_path: str
    dest: str
    size: int
    sha256: str
    member: str | None = None  # a bundle member: its bytes come from the bundle at rel_path
    executable: bool = False
    align: int = 0  # its data starts at a multiple of this in its layer (weight layers)
    blob: str = ""  # its layer is written already: this blob (path in OUT) holds the file

    @property
    def label(self) -> str:
        """What the file is, for history lines and messages: its OUT path (and member)."""
        return f"{self.rel_path}:{self.member}" if self.member else self.rel_path


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
        names = ", ".join(f.label for f in self.files)
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
    return f"{prefix.rstrip('/')}/{image_rel(rel_path)}"


def image_rel(rel_path: str) -> str:
    """Where the OUT file ``rel_path`` lies below the image prefix.

    The files of OUT's ``weights/`` go to the top, beside the config (``model.safetensors``,
    the shard index), as a Hugging Face model directory has them; the rest keep their path.
    """
    return rel_path[len(WEIGHTS_DIR):] if rel_path.startswith(WEIGHTS_DIR) else rel_path


def model_files(artifact: Mapping[str, Any]) -> tuple[str, list[FileEntry]]:
    """The bundle's members, which the image also holds as plain files, from the artifact manifest.

    Args:
        artifact: the parsed artifact manifest (its ``bundle`` section, or none).

    Returns:
        ``(bundle path in OUT, members as FileEntry(name, size, sha256))``; ``("", [])`` without a bundle.

    Raises:
        ImageError: a member name that is not a plain relative path.
    """
    section = artifact.get("bundle") or {}
    if not section.get("members"):
        return "", []
    out = []
    for m in section["members"]:
        name = str(m.get("name", ""))
        p = PurePosixPath(name)
        if not name or p.is_absolute() or ".." in p.parts or "\\" in name or name != p.as_posix():
            raise ImageError(f"bundle member {name!r}: expected a relative path inside the model directory")
        out.append(FileEntry(name, int(m["size"]), str(m["sha256"])))
    return str(section["file"]), out


def weight_layer_framing(
    cfg: ImageConfig, rel_path: str, size: int, *, mtime: int | None = None
) -> tuple[bytes, bytes]:
    """The bytes around a weight file's content in its own uncompressed layer.

    ``prefix + content + suffix`` is exactly the layer tar the image stage writes for that
    file (parent directories, the file's header, padding, end-of-archive blocks), so the
    weights stage can write the layer blob itself, the one copy of the file, and the image
    stage only references it. ``len(prefix)`` is a multiple of :data:`WEIGHT_ALIGN` (a PAX
    comment pads the file's header), so the file can be mapped in place inside the blob.
    Pure apart from reading ``SOURCE_DATE_EPOCH`` when ``mtime`` is None.

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
    src = SourceFile(_dest(prefix, rel_path), size, source=Path(rel_path), align=WEIGHT_ALIGN)  # never read
    members = tar_members([src], owner=Owner.parse(cfg.owner), prefix=prefix)
    pieces = list(tar_pieces(members, mtime=mtime))
    # the file's content is the one FileRange piece; an empty file has none
    cut = next((i for i, p in enumerate(pieces) if isinstance(p, FileRange)), len(pieces))
    head = [p for p in pieces[:cut] if isinstance(p, bytes)]
    tail = [p for p in pieces[cut + 1 :] if isinstance(p, bytes)]
    return b"".join(head), b"".join(tail)


def _check_places(files: Sequence[PlannedFile]) -> None:
    """Two files for one place in the image (a bundle member named like a weight file or the
    manifest) would make one hide the other: refuse, naming both."""
    seen: dict[str, PlannedFile] = {}
    for f in files:
        other = seen.setdefault(f.dest.rstrip("/"), f)
        if other is not f:
            raise ImageError(f"image path {f.dest}: both {other.label} and {f.label} would go there; "
                             "leave one out (bundle.exclude) or rename it")


def plan_layers(
    files: Sequence[FileEntry],
    cfg: ImageConfig,
    *,
    name: str,
    version: str,
    manifest: FileEntry,
    members: Sequence[FileEntry] = (),
    bundle_path: str = "",
    loader_paths: Collection[str] = (LOADER_NAME,),
) -> ImagePlan:
    """Plan the image's layers.

    Args:
        files: the artifact files (paths relative to OUT); ``manifest.json`` must not be one.
        cfg: the recipe's ``[image]`` section.
        name: model name; with ``version`` it makes the default tag ``name:version``.
        manifest: the artifact manifest as a file entry (path ``manifest.json``).
        members: the bundle's members, placed as plain files (see :func:`model_files`).
        bundle_path: the bundle's path in OUT (where the members' bytes are read).
        loader_paths: the files the loader stage wrote (the top layer).

    Returns:
        The :class:`ImagePlan`.

    Raises:
        ImageError: an unsafe path, two files for one place, or no files left to put in the image.
    """
    prefix = _prefix(cfg)
    owner = Owner.parse(cfg.owner)
    groups: dict[str, list[PlannedFile]] = {"weights": [], "model files": [], "bundle": [], "loader": []}
    for entry in sorted([*files, manifest], key=lambda e: e.path):
        p = PurePosixPath(entry.path)
        if p.is_absolute() or ".." in p.parts or not entry.path:
            raise ImageError(f"artifact file {entry.path!r}: expected a relative path inside OUT")
        pf = PlannedFile(entry.path, _dest(prefix, entry.path), entry.size, entry.sha256,
                         executable=entry.path == LOADER_NAME, blob=entry.blob)
        if entry.blob and (cfg.weights == "external" or cfg.single_layer
                           or not entry.path.endswith(SAFETENSORS_SUFFIX)):
            raise ImageError(f"artifact file {entry.path}: held in the layer blob {entry.blob}, but this "
                             "image puts it elsewhere (image.weights / image.single_layer); rebuild")
        if entry.path.startswith(WEIGHTS_DIR):
            if cfg.weights == "external":
                continue
            if entry.path.endswith(SAFETENSORS_SUFFIX):
                groups["weights"].append(replace(pf, align=0 if cfg.single_layer else WEIGHT_ALIGN))
            else:
                groups["model files"].append(pf)
        else:
            groups["loader" if entry.path in loader_paths else "bundle"].append(pf)
    groups["model files"] += [PlannedFile(bundle_path, f"{prefix.rstrip('/')}/{m.path}", m.size, m.sha256,
                                          member=m.path) for m in members]
    _check_places([f for g in groups.values() for f in g])
    if cfg.single_layer:
        everything = tuple(sorted((f for g in groups.values() for f in g), key=lambda f: f.dest))
        layers: tuple[PlannedLayer, ...] = (PlannedLayer("model", everything, cfg.compression),)
    else:
        layers = tuple(
            [PlannedLayer(f"weights {PurePosixPath(w.rel_path).name}", (w,), "none")
             for w in groups["weights"]]
            + [PlannedLayer(n, tuple(sorted(groups[n], key=lambda f: f.dest)), cfg.compression)
               for n in ("model files", "bundle", "loader") if groups[n]]
        )
    return ImagePlan(
        tag=cfg.tag or f"{name}:{version}", prefix=prefix, owner=owner,
        compression=cfg.compression, weights=cfg.weights, base=cfg.base,
        platform=cfg.platform, layers=layers,
    )
