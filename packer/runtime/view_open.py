"""The one door to a build's view: any root a reader takes, opened, its small files proven.

:func:`open_view` is the only place that decides where a build's bytes come from: a registry
(an ``oci://`` reference, or a directory ``packer stream`` made that holds none of the weight
files) or this machine (OUT, an image's model directory, mounted weights). It fetches and
proves the small files, compares the manifest the build ships with the reader's, and runs the
caller's signature check on the view's root before a weight byte is read.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .env import STREAM_FILE, ArtifactMismatchError, is_ref
from .reading import entry_kind, loads_json, read_bytes
from .view import BuildView
from .view_local import LocalView

if TYPE_CHECKING:
    from .view_registry import RegistryView

MANIFEST_FILE = "manifest.json"  # the manifest a build ships beside its files
Check = Callable[[Path, dict[str, Any]], None]  # (the view's root, its manifest): raises to refuse


def open_view(manifest: dict[str, Any] | None, base: str | Path, *, weights_dir: str | Path | None = None,
              named: str = "root=", check: Check | None = None, dest: Path | None = None,
              keep: bool = False) -> BuildView:
    """The view of the build at ``base``.

    Args:
        manifest: the manifest the build must be (the loader's embedded one); None: the one the
            build ships (``packer verify``, ``inspect``, ``stream``), proven by the image digest
            for a registry image.
        base: ``oci://HOST/REPO@sha256:...``, a directory ``packer stream`` made, or a build's
            directory (OUT, a model directory).
        weights_dir: where the weight files are mounted, when not under ``base``.
        named: how the caller names ``base`` in a refusal (``root=``, ``PACKER_ARTIFACTS``).
        check: run with the view's root and manifest before it is returned (the signature
            check under ``PACKER_REQUIRE_SIGNATURE``: the view never imports it).
        dest: for a registry image, where its small files go (default: a new private directory,
            removed when the process exits unless ``keep``).
        keep: leave a new private directory of small files behind (``packer stream``).

    Raises:
        ArtifactMismatchError: ``base`` holds no build, or another build than ``manifest``.
        RegistryError: the registry or the image refused (one line: reference and reason).
    """
    if is_ref(base) or _streams(manifest, Path(base), weights_dir):
        view: BuildView = _registry(manifest, base, dest, keep)
    else:
        if entry_kind(base) != "dir":  # an explicit root that holds no build: never a fall back
            raise ArtifactMismatchError(f"{Path(base).absolute()}: not a directory, and {named} names it "
                                        "as this build's artifacts")
        view = LocalView(manifest if manifest is not None else _shipped(Path(base), str(base)), base, weights_dir)
    if check is not None:
        check(view.root, view.manifest)
    return view


def _streams(manifest: dict[str, Any] | None, base: Path, weights_dir: str | Path | None) -> bool:
    """Whether ``base`` is a directory ``packer stream`` made: its ``packer-stream.json`` names an
    image, and it holds none of the weight files (a directory that has them loads them: a file
    beside never diverts a load to the network)."""
    if not (base / STREAM_FILE).is_file():
        return False
    local = LocalView(manifest if manifest is not None else _shipped(base, str(base)), base, weights_dir)
    return not any(local.locate(rel)[0].exists() for rel in local.manifest["weights"]["files"])


def _registry(manifest: dict[str, Any] | None, base: str | Path, dest: Path | None, keep: bool) -> RegistryView:
    """The view of a registry image: ``base`` a reference (its small files fetched) or a streamed
    directory (its ``packer-stream.json`` names the image)."""
    from .remote import RemoteImage, stream_ref
    from .view_registry import RegistryView  # a local load never imports the registry's kind

    if is_ref(base):
        image = RemoteImage.fetch(str(base))
        where = image.materialize(dest)
        if dest is None and not keep:
            _remove_at_exit(where)
    else:
        where = Path(base)
        image = RemoteImage.fetch(str(stream_ref(where)))
    if manifest is None:
        return RegistryView(_shipped(where, str(image.ref)), where, image)
    shipped = where / MANIFEST_FILE
    if shipped.is_file():  # the image's own artifact manifest: another build is one clear line
        theirs = loads_json(read_bytes(shipped, "json"), str(shipped)).get("files")
        if not isinstance(theirs, dict) or any(theirs.get(rel) != entry for rel, entry in manifest["files"].items()):
            raise ArtifactMismatchError(f"{image.ref}: the image holds another build than this loader's "
                                        "(its manifest.json pins other files)")
    return RegistryView(manifest, where, image)


def _remove_at_exit(where: Path) -> None:
    """Remove ``where`` (this process's private copy of an image's small files) when this process
    ends, by a multiprocessing finalizer: it runs at exit (multiprocessing's own ``atexit``
    hook) and at the end of a multiprocessing child, which fork and forkserver end in
    ``os._exit``, past ``atexit``; never from a process forked from this one."""
    from multiprocessing import util

    pid = os.getpid()

    def remove() -> None:
        if os.getpid() == pid:
            shutil.rmtree(where, ignore_errors=True)

    util.Finalize(None, remove, exitpriority=0)


def _shipped(root: Path, name: str) -> dict[str, Any]:
    """The manifest a build ships beside its files (no loader's to compare with)."""
    path = root / MANIFEST_FILE
    try:
        doc = loads_json(read_bytes(path, "json"), str(path))
    except FileNotFoundError:
        raise ArtifactMismatchError(f"{name}: no {MANIFEST_FILE}: not a build packer made") from None
    if not isinstance(doc.get("files"), dict) or not isinstance(doc.get("weights"), dict):
        raise ArtifactMismatchError(f"{path}: not a packer manifest (no files or weights section)")
    return doc


def root_name(base: str | Path) -> str | Path:
    """A root as messages name it: a registry reference as given, a directory made absolute."""
    return str(base) if is_ref(base) else Path(base).resolve()
