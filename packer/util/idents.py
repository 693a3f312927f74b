"""One rule for identifiers and paths taken from inputs.

Every digest, ref, revision and file name read from an input (a base image's descriptors, a
hub cache's ``refs/`` files, a recipe's revision, a checkpoint index's shard names) is checked
against its grammar here before it becomes part of a path, and every path derived from an
input is resolved (links followed) and proven to lie inside the directories it may reach
before anything is opened or written. Inside a Hugging Face cache snapshot those are the
snapshot itself and its own repository's ``blobs/``: the only place the cache's links lead.

The functions raise the caller's error class (a :class:`~packer.errors.PackerError` subclass,
passed as ``error=``), so a stage keeps its own class (and the sandbox its class-by-name
transport); this module names none of them: ``packer/util`` imports nothing of packer above it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

# algorithm -> hex digits of its digest (the OCI image spec's registered algorithms)
DIGEST_HEX = {"sha256": 64, "sha512": 128}
COMMIT_RE = re.compile(r"[0-9a-f]{40}")
MAX_REF_NAME = 255
# git check-ref-format: no control characters, space, ~ ^ : ? * [ \ anywhere
_REF_BAD_CHARS = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")
_NAME_BAD_CHARS = re.compile(r"[\x00-\x1f\x7f\\\ud800-\udfff]")  # a lone surrogate: no UTF-8 encodes it
ErrorClass = type[Exception]  # the caller's error class; raised with one message


def shown(value: object, limit: int = 80) -> str:
    """``value`` as a short quoted literal (control characters escaped) for a message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def digest_parts(value: object) -> tuple[str, str] | None:
    """``(algorithm, hex)`` of an OCI digest ``algorithm:hex``, or None when malformed.

    Only the registered algorithms (sha256: 64, sha512: 128 lowercase hex digits) are valid:
    the hex part is what becomes a file name under ``blobs/<algorithm>/``.
    """
    if not isinstance(value, str):
        return None
    algo, sep, hexd = value.partition(":")
    want = DIGEST_HEX.get(algo)
    if not sep or want is None or len(hexd) != want or not re.fullmatch(r"[0-9a-f]+", hexd):
        return None
    return algo, hexd


def is_commit(value: str) -> bool:
    """A git commit hash as the hub writes it: 40 lowercase hex digits."""
    return COMMIT_RE.fullmatch(value) is not None


def is_ref_name(value: str) -> bool:
    """A branch or tag name git would accept (``main``, ``v1.0``, ``refs/pr/1``)."""
    parts = value.split("/")
    return (0 < len(value.encode()) <= MAX_REF_NAME and value != "@" and "@{" not in value
            and ".." not in value and not _REF_BAD_CHARS.search(value) and not value.endswith(".")
            and all(p and not p.startswith(".") and not p.endswith(".lock") for p in parts))


def check_revision(value: str, *, where: str, error: ErrorClass) -> str:
    """Return ``value`` if it is a commit hash or a ref name, else raise ``error``."""
    if is_commit(value) or is_ref_name(value):
        return value
    raise error(f"{where}: revision {shown(value)} is neither a commit hash nor a branch or tag name")


def check_rel_name(value: object, *, where: str, error: ErrorClass) -> PurePosixPath:
    """A relative POSIX file name from an input (``model-00001-of-00002.safetensors``, ``a/b.json``).

    Raises:
        error: not a string, empty, absolute, with ``.``/``..``/empty components, a backslash,
            a control character or a lone surrogate (``\\ud800``: no UTF-8 encodes it).
    """
    parts = value.split("/") if isinstance(value, str) else []
    if (not isinstance(value, str) or not parts or value.startswith("/") or _NAME_BAD_CHARS.search(value)
            or any(p in ("", ".", "..") for p in parts)):
        raise error(f"{where}: {shown(value)} is not a relative file name "
                    "(no absolute path, '..', empty component, backslash, control character or lone surrogate)")
    return PurePosixPath(value)


def link_roots(src: Path) -> tuple[Path, ...]:
    """Where paths found under the source directory ``src`` may lead, resolved.

    ``src`` itself; inside a Hugging Face cache snapshot (``<repo>/snapshots/<commit>`` beside
    ``<repo>/blobs``), for the snapshot or a folder of it (a diffusers component, a
    sentence-transformers module), that folder as it lies in its repository and that
    repository's ``blobs/``: the cache links every file there. A link into another snapshot,
    another repository, another folder of the snapshot or out of the cache leads outside.
    """
    src = Path(src)
    for up, snapshot in enumerate((src, *src.parents)):
        if snapshot.parent.name == "snapshots" and (snapshot.parent.parent / "blobs").is_dir():
            repo = Path(os.path.realpath(snapshot.parent.parent))
            inner = src.parts[len(src.parts) - up:] if up else ()
            return repo.joinpath("snapshots", snapshot.name, *inner), repo / "blobs"
    return (Path(os.path.realpath(src)),)


def confined(path: Path, roots: Sequence[Path], *, error: ErrorClass, what: str = "symlink",
             hint: str = "copy the file into the model directory") -> Path:
    """Resolve ``path`` (following every link) and prove it lies inside one of ``roots``.

    Args:
        path: the path as found or as derived from an input.
        roots: directories the resolved path may lie in (resolved here too).
        error: the caller's error class.
        what: how the message names ``path`` (``symlink 'config.json'``, ``blob sha256:…``).
        hint: what the user can do about a path that leads outside.

    Returns:
        The resolved path.

    Raises:
        error: the resolved path lies outside every root.
    """
    real = Path(os.path.realpath(path))
    resolved = [Path(os.path.realpath(r)) for r in roots]
    if any(real.is_relative_to(r) for r in resolved):
        return real
    where = " or ".join(str(r) for r in resolved)
    raise error(f"{path}: {what} leads outside {where} (to {real}); {hint}")
