"""Model sources: a local directory or file, a Hugging Face repo at a pinned revision, the demo.

Every source resolves to a :class:`Snapshot`: a local directory that later stages only read,
plus the identity recorded in the manifest. Hub downloads go through huggingface_hub's own
cache, so ``HF_HUB_OFFLINE=1`` with a populated cache works without network. Where links in a
snapshot may lead is :func:`packer.idents.link_roots`' rule, which the stages apply.

The revision and the cache's ``refs/`` file are checked here, not left to huggingface_hub:
its offline resolution joins the ref file's text onto the cache as it is, so a ref holding
``../../models--other--repo/snapshots/<sha>`` would build another model under this one's name.
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
from packer.idents import check_revision, confined, is_commit
from packer.reading import read_ref_file
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
        single_file: the source is one checkpoint file, so there is nothing to bundle.
    """

    root: Path
    weights: Path
    kind: str
    uri: str
    revision: str | None = None
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
    repo = m.group("repo")
    if ".." in repo or "--" in repo or any(p[-1] in ".-" for p in repo.split("/")):
        raise SourceError(f"source {uri!r}: {repo!r} is not a hub repository id ('..', '--' and a "
                          "trailing '.' or '-' are not allowed)")
    return repo, check_revision(m.group("rev"), where=f"source {uri!r}", error=SourceError)


def hf_allow_patterns(recipe: Recipe) -> list[str]:
    """The files a hub download fetches: the recipe's weight and bundle globs, or the defaults."""
    patterns = list(recipe.weights.files) + list(recipe.bundle.include)
    if not recipe.weights.files:
        patterns += DEFAULT_HF_PATTERNS
    return sorted(set(patterns))


def _hub_repo_folder(repo_id: str, cache_dir: Path | None) -> Path:
    from huggingface_hub import constants

    cache = Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE).expanduser()
    return Path(os.path.realpath(cache)) / ("models--" + repo_id.replace("/", "--"))


def _pinned_commit(repo: Path, revision: str, where: str) -> str | None:
    """The commit ``revision`` names in the local cache (None: the cache does not know it)."""
    if is_commit(revision):
        return revision
    ref = repo / "refs" / revision  # revision is a checked ref name: no '..', not absolute
    return read_ref_file(ref, where=where, error=SourceError) if ref.is_file() else None


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The hub client's network failures that huggingface_hub itself does not fall back on (a
    reset connection, a proxy cutting the reply: httpx2's in huggingface_hub 1.x; requests'
    in older ones are OSErrors, caught with the rest)."""
    try:
        from httpx2 import TransportError
    except ImportError:
        return ()
    return (TransportError,)


def _download(recipe: Recipe, repo_id: str, revisions: list[str], cache_dir: Path | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cut_off = _transport_errors()
    local, why = False, "HF_HUB_OFFLINE is set or there is no network"
    i = 0
    while i < len(revisions):
        revision = revisions[i]
        try:
            return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                          allow_patterns=hf_allow_patterns(recipe), local_files_only=local))
        except LocalEntryNotFoundError as e:
            if i + 1 < len(revisions):
                i += 1
                continue  # the hub is unreachable: try the commit the local ref names
            from huggingface_hub import constants

            searched = cache_dir if cache_dir is not None else constants.HF_HUB_CACHE
            raise SourceError(
                f"source {recipe.source}: not in the local cache {searched} and the hub cannot be reached"
                f" ({why}); download it once (hf download"
                f" {repo_id} --revision {revisions[-1]}), point HF_HUB_CACHE at the cache that holds it, or"
                " unset HF_HUB_OFFLINE"
            ) from e
        except cut_off as e:
            if local:
                raise
            # the hub answered with a broken connection: the cache decides, as for no network
            local, why = True, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no reply'}"
            i = len(revisions) - 1  # the commit the local ref names (or the revision itself)
        except (HfHubHTTPError, OSError, ValueError) as e:
            raise SourceError(f"source {recipe.source}: {str(e).splitlines()[0]}") from e
    raise AssertionError("no revision to try")


def _resolve_hf(recipe: Recipe, cache_dir: Path | None) -> Snapshot:
    repo_id, revision = parse_hf_uri(recipe.source)
    from huggingface_hub import constants

    where = f"source {recipe.source}"
    repo = _hub_repo_folder(repo_id, cache_dir)
    pinned = _pinned_commit(repo, revision, where)
    # Offline, huggingface_hub gets the commit we read and checked, never the ref file's raw text.
    if pinned is None or pinned == revision:
        revisions = [revision]
    else:
        revisions = [pinned] if constants.HF_HUB_OFFLINE else [revision, pinned]
    path = _download(recipe, repo_id, revisions, cache_dir)
    # snapshot folders are named by commit and lie in this repository: .../models--org--name/snapshots/<commit>
    real = confined(path, [repo / "snapshots"], error=SourceError, what=f"the snapshot of {recipe.source}",
                    hint="the cache is not huggingface_hub's layout; download the model again")
    if real.parent != repo / "snapshots" or not is_commit(real.name) or pinned not in (None, real.name):
        raise SourceError(f"{where}: huggingface_hub returned {path}, not this repository's snapshot of "
                          f"{pinned or revision}; download the model again")
    return Snapshot(root=real, weights=real, kind="hf", uri=recipe.source, revision=real.name)


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
