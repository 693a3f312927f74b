"""Model sources: a local directory or file, a Hugging Face repo at a pinned revision, the demo.

Every source resolves to a :class:`Snapshot`: a local directory that later stages only read,
plus the identity recorded in the manifest. Hub downloads go through huggingface_hub's own
cache, so ``HF_HUB_OFFLINE=1`` with a populated cache works without network.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packer.errors import SourceError
from packer.formats import WEIGHT_PATTERNS
from packer.fsutil import file_kind
from packer.recipe import Recipe

_HF_RE = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+|[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?$")
# What the weights and bundle stages may read from a hub repo when the recipe names nothing.
DEFAULT_HF_PATTERNS = (
    "*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken", *WEIGHT_PATTERNS, "*/*.json", "*/*.txt",
)


@dataclass(frozen=True)
class Snapshot:
    """A resolved source.

    Attributes:
        root: directory the bundle stage reads (for a single file: its directory).
        weights: what the weights stage converts (the directory, or the single file).
        kind: "demo" | "local" | "hf".
        uri: the source as the recipe wrote it (no absolute path, so manifests are portable).
        revision: the resolved commit for hub sources.
        allowed_root: symlinks may point anywhere below this (the hub cache repo folder).
        single_file: the source is one checkpoint file, so there is nothing to bundle.
    """

    root: Path
    weights: Path
    kind: str
    uri: str
    revision: str | None = None
    allowed_root: Path | None = None
    single_file: bool = False

    def identity(self) -> dict[str, Any]:
        return {"kind": self.kind, "uri": self.uri, "revision": self.revision}


def parse_hf_uri(uri: str) -> tuple[str, str]:
    """Split ``hf://org/name@revision`` into (repo_id, revision).

    Raises:
        SourceError: the URI is malformed or has no pinned revision.
    """
    m = _HF_RE.match(uri)
    if not m:
        raise SourceError(f"source {uri!r}: expected hf://org/name@revision")
    if not m.group("rev"):
        raise SourceError(f"source {uri!r}: pin a revision (hf://org/name@<commit or tag>) so builds are reproducible")
    return m.group("repo"), m.group("rev")


def hf_allow_patterns(recipe: Recipe) -> list[str]:
    """The files a hub download fetches: the recipe's weight and bundle globs, or the defaults."""
    patterns = list(recipe.weights.files) + list(recipe.bundle.include)
    if not recipe.weights.files:
        patterns += DEFAULT_HF_PATTERNS
    return sorted(set(patterns))


def _resolve_hf(recipe: Recipe, cache_dir: Path | None) -> Snapshot:
    repo_id, revision = parse_hf_uri(recipe.source)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                      allow_patterns=hf_allow_patterns(recipe)))
    except LocalEntryNotFoundError as e:
        raise SourceError(
            f"source {recipe.source}: not in the local cache and the hub cannot be reached"
            " (HF_HUB_OFFLINE is set or there is no network); download it once or unset HF_HUB_OFFLINE"
        ) from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise SourceError(f"source {recipe.source}: {str(e).splitlines()[0]}") from e
    # snapshot folders are named by commit: .../models--org--name/snapshots/<commit>
    return Snapshot(root=path, weights=path, kind="hf", uri=recipe.source, revision=path.name,
                    allowed_root=path.parent.parent)


def _resolve_local(recipe: Recipe) -> Snapshot:
    path = Path(os.path.expanduser(recipe.source))
    if not path.is_absolute():
        path = recipe.base_dir / path
    if not path.exists():
        raise SourceError(f"source {recipe.source!r}: {path} does not exist")
    if path.is_file():
        return Snapshot(root=path.parent, weights=path, kind="local", uri=recipe.source, single_file=True)
    if not path.is_dir():
        kind = file_kind(path.stat().st_mode)
        raise SourceError(f"source {recipe.source!r}: {path} is {kind}, not a regular file or a directory")
    return Snapshot(root=path, weights=path, kind="local", uri=recipe.source)


@contextmanager
def resolve_source(recipe: Recipe, *, cache_dir: Path | None = None,
                   scratch: Path | None = None) -> Iterator[Snapshot]:
    """Resolve the recipe's source for the duration of a build.

    The demo is generated into ``scratch`` (an empty directory the caller owns; default: a new
    temporary directory) and removed on exit; other sources are used in place.

    Raises:
        SourceError: the source does not exist, is malformed or cannot be fetched.
    """
    if recipe.source == "demo":
        from packer.demo import write_demo

        tmp = scratch if scratch is not None else Path(tempfile.mkdtemp(prefix="packer-demo-"))
        try:
            write_demo(tmp)
            yield Snapshot(root=tmp, weights=tmp, kind="demo", uri="demo")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    elif recipe.source.startswith("hf://"):
        yield _resolve_hf(recipe, cache_dir)
    else:
        yield _resolve_local(recipe)
