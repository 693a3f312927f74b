"""Populate a huggingface_hub cache on disk in the library's own layout (no network)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def populate_cache(cache: Path, repo_id: str, files: dict[str, bytes], *,
                   commit: str = "0123456789abcdef0123456789abcdef01234567", ref: str = "main") -> Path:
    """Write ``files`` as one commit of ``repo_id``; return the snapshot folder.

    Layout: models--org--name/{blobs/<sha256>, refs/<ref>, snapshots/<commit>/<path> -> blob}.
    """
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    snap = repo / "snapshots" / commit
    for rel, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    return snap
