"""Model sources: a local directory or file, a Hugging Face repo at a pinned revision, the demo.

Every source resolves to a :class:`Snapshot`: a local directory that later stages only read,
plus the identity recorded in the manifest. Hub downloads go through huggingface_hub's own
cache, so ``HF_HUB_OFFLINE=1`` with a populated cache works without network. Where links in a
snapshot may lead is :func:`packer.util.idents.link_roots`' rule, which the stages apply.

The revision and the cache's ``refs/`` file are checked here, not left to huggingface_hub:
its offline resolution joins the ref file's text onto the cache as it is, so a ref holding
``../../models--other--repo/snapshots/<sha>`` would build another model under this one's name.

A branch or tag is resolved on the hub first, within :func:`hub_timeout`. When the hub resets,
cuts its reply, fails (5xx) or does not answer in time, the commit the cache names for it is
built, never silently: the snapshot's notes (the build's, and so ``--json``'s summary) name
that commit, the ref asked for and the error. A hub that answers "no such revision" (4xx) is
not overruled by the cache.
"""

from __future__ import annotations

import contextlib
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
from packer.reading import file_kind, read_ref_file
from packer.recipe import Recipe
from packer.util.formats import WEIGHT_PATTERNS
from packer.util.fsutil import atomic_write_bytes
from packer.util.idents import check_revision, confined, is_commit, shown

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
    notes: tuple[str, ...] = ()  # for the build's notes (a cached commit built instead of the hub's), not hashed

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
    """The hub client's network failures (a reset connection, a reply cut short, a timeout:
    httpx2's in huggingface_hub 1.x and later; requests' in older ones are OSErrors, caught with the rest)."""
    try:
        from httpx2 import TransportError
    except ImportError:
        return ()
    return (TransportError,)


def _broken_replies() -> tuple[type[BaseException], ...]:
    """What a hub call raises when no usable answer came (a reply cut short may not parse)."""
    return (OSError, ValueError, *_transport_errors())


def hub_timeout() -> float:
    """Seconds a hub call may take to connect, and to send each part of its reply.

    huggingface_hub's own setting for metadata calls, ``HF_HUB_ETAG_TIMEOUT`` (default 10):
    packer applies it to the calls the library makes without one (the revision's commit, the
    file listing), which would otherwise wait forever on a hub that accepts and never answers.
    File downloads keep the library's ``HF_HUB_DOWNLOAD_TIMEOUT``.
    """
    from huggingface_hub import constants

    return float(constants.HF_HUB_ETAG_TIMEOUT)


def _bound_hub_client() -> None:
    """Give huggingface_hub's shared client :func:`hub_timeout` for calls made without a timeout
    (a call's own timeout, as the file downloads pass, still wins)."""
    try:
        import httpx2
    except ImportError:  # an older huggingface_hub on requests: its calls pass their own timeouts
        return
    from huggingface_hub import get_session

    get_session().timeout = httpx2.Timeout(hub_timeout())


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else 'no reply'}"


def _fallback_note(uri: str, revision: str, commit: str, why: str) -> str:
    return (f"source {uri}: built the cached commit {commit} that the local cache names for {revision!r}, "
            f"not the hub's ({why}); the hub's {revision!r} may be newer: pin the commit, or build "
            "again when the hub answers")


def _hub_commit(recipe: Recipe, repo_id: str, revision: str, pinned: str | None,
                cache_dir: Path | None) -> tuple[str, str | None]:
    """The commit ``revision`` names on the hub, or else the cached ``pinned`` one and a note why.

    Raises:
        SourceError: the hub refused the repository or revision (4xx), or did not answer and
            the cache knows no commit for ``revision``.
    """
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    if constants.HF_HUB_OFFLINE:
        return (pinned, _fallback_note(recipe.source, revision, pinned, "HF_HUB_OFFLINE is set")) if pinned \
            else (revision, None)  # the download names the cache it searched
    try:
        sha = HfApi().repo_info(repo_id, revision=revision, timeout=hub_timeout()).sha
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else 500
        if status < 500 and status != 429:  # the hub answered: no such repository or revision, or no access
            raise SourceError(f"source {recipe.source}: {str(e).splitlines()[0]}") from e
        why = f"the hub answered {status}: {str(e).splitlines()[0]}"
    except _broken_replies() as e:
        why = f"the hub broke off: {_first_line(e)}"
        if isinstance(e, TimeoutError) or "Timeout" in type(e).__name__:  # httpx2's ReadTimeout, ConnectTimeout...
            why = f"no answer within HF_HUB_ETAG_TIMEOUT={hub_timeout():g} s: {_first_line(e)}"
    else:
        if not isinstance(sha, str) or not is_commit(sha):
            raise SourceError(f"source {recipe.source}: the hub named {shown(sha)} as the commit of {revision!r}, "
                              "not a commit hash")
        return sha, None
    if pinned is None:
        raise _not_cached(recipe, repo_id, revision, cache_dir, why)
    return pinned, _fallback_note(recipe.source, revision, pinned, why)


def _not_cached(recipe: Recipe, repo_id: str, revision: str, cache_dir: Path | None, why: str) -> SourceError:
    from huggingface_hub import constants

    searched = cache_dir if cache_dir is not None else constants.HF_HUB_CACHE
    return SourceError(f"source {recipe.source}: not in the local cache {searched} and the hub cannot be reached"
                       f" ({why}); download it once (hf download {repo_id} --revision {revision}), point "
                       "HF_HUB_CACHE at the cache that holds it, or unset HF_HUB_OFFLINE")


def _download(recipe: Recipe, repo_id: str, revision: str, cache_dir: Path | None,
              local: bool) -> tuple[Path, str | None]:
    """The snapshot folder of ``revision`` (a commit where known) and a note when the files
    came from the cache because the hub broke off."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    why = "HF_HUB_OFFLINE is set or there is no network"
    for attempt in ((local,) if local else (False, True)):
        try:
            path = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=attempt,
                                     allow_patterns=hf_allow_patterns(recipe),
                                     etag_timeout=constants.HF_HUB_ETAG_TIMEOUT)
            note = f"source {recipe.source}: the files of {revision} came from the local cache ({why})" \
                if attempt and not local else None
            return Path(path), note
        except LocalEntryNotFoundError as e:
            raise _not_cached(recipe, repo_id, revision, cache_dir, why) from e
        except _transport_errors() as e:
            if attempt:
                raise SourceError(f"source {recipe.source}: {_first_line(e)}") from e
            why = f"the hub broke off: {_first_line(e)}"  # the cache decides, as for no network
        except (HfHubHTTPError, OSError, ValueError) as e:
            raise SourceError(f"source {recipe.source}: {str(e).splitlines()[0]}") from e
    raise AssertionError("no attempt made")


def _remember_ref(repo: Path, revision: str, commit: str) -> None:
    """Point the cache's ``refs/<revision>`` at the commit the hub named, as huggingface_hub
    does for a download by name (packer downloads by commit), so an offline build finds it."""
    ref = repo / "refs" / revision  # a checked ref name: no '..', not absolute
    with contextlib.suppress(OSError):  # a read-only cache still builds
        ref.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(ref, commit.encode())


def _resolve_hf(recipe: Recipe, cache_dir: Path | None) -> Snapshot:
    repo_id, revision = parse_hf_uri(recipe.source)
    where = f"source {recipe.source}"
    repo = _hub_repo_folder(repo_id, cache_dir)
    pinned = _pinned_commit(repo, revision, where)
    _bound_hub_client()
    notes: list[str] = []
    commit, note = revision, None
    if not is_commit(revision):
        commit, note = _hub_commit(recipe, repo_id, revision, pinned, cache_dir)
    hub_named = note is None and commit != revision  # the hub answered with the commit to build
    notes += [note] if note else []
    # a fallback (note) reads the cache only: huggingface_hub gets the commit we read and checked
    path, note = _download(recipe, repo_id, commit, cache_dir, local=bool(notes))
    notes += [note] if note else []
    # snapshot folders are named by commit and lie in this repository: .../models--org--name/snapshots/<commit>
    real = confined(path, [repo / "snapshots"], error=SourceError, what=f"the snapshot of {recipe.source}",
                    hint="the cache is not huggingface_hub's layout; download the model again")
    if real.parent != repo / "snapshots" or not is_commit(real.name) or (is_commit(commit) and real.name != commit):
        raise SourceError(f"{where}: huggingface_hub returned {path}, not this repository's snapshot of "
                          f"{commit}; download the model again")
    if hub_named:
        _remember_ref(repo, revision, commit)
    return Snapshot(root=real, weights=real, kind="hf", uri=recipe.source, revision=real.name, notes=tuple(notes))


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
