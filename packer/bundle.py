"""The tokenizer/config bundle: pick the files loaders read, write one reproducible tar.zst.

Plan, then write: :func:`plan_bundle` walks the source and returns a frozen
:class:`BundlePlan` (what ``--dry-run`` prints); :func:`write_bundle` streams the plan
through a tar writer of our own (ustar headers; a PAX ``path`` record only for a name ustar
cannot hold) into one multi-threaded zstd frame and re-reads the result
with the runtime reader before renaming it into place. Reading and extraction live in
:mod:`packer.runtime.bundle_reader`, shared with the emitted loader.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packer import tarfmt
from packer.errors import BundleError, VerifyError
from packer.formats import WEIGHT_SUFFIXES
from packer.fsutil import FileEntry, atomic_open, check_regular, file_kind, open_regular, quiet_cleanup, umask
from packer.idents import confined, link_roots
from packer.recipe import BundleConfig
from packer.runtime import bundle_reader as reader
from packer.stage import StageOutput

ARCHIVE_NAME = "bundle.tar.zst"
# Level 3 (zstd's default): ~400 MB/s per thread, ratio ~4-5x on tokenizer JSON; decoding speed
# barely depends on the level, and higher levels cost build time for a few percent of size.
ZSTD_LEVEL = 3
FILE_MODE, DIR_MODE = tarfmt.FILE_MODE, tarfmt.DIR_MODE
_CHUNK = 1 << 20

TEXT_SUFFIXES = frozenset({".json", ".txt", ".model", ".jinja", ".tiktoken", ".vocab", ".spm", ".bpe", ".yaml", ".yml"})
NEVER = {
    "weights": frozenset({*WEIGHT_SUFFIXES, ".gguf", ".ggml", ".onnx", ".onnx_data",
                          ".h5", ".hdf5", ".keras", ".msgpack", ".npz", ".npy", ".tflite", ".pb", ".ot", ".pdparams",
                          ".mlmodel", ".engine", ".plan", ".trt"}),
    "code": frozenset({".py", ".pyc", ".pyo", ".pyd", ".pyx", ".so", ".dylib", ".dll", ".exe", ".sh", ".ipynb"}),
    "pickle": frozenset({".pkl", ".pickle", ".joblib", ".dill"}),
}
_WEIGHTS_INDEX = re.compile(r"\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf|onnx)\.index\.json$", re.I)
_VERSIONED_MODEL = re.compile(r"\.model\.v\d+$")  # Mistral's tokenizer.model.v3
# sentence-transformers modules (1_Pooling, 2_Normalize, 2_Dense...) and diffusers components
_MODULE_DIR = re.compile(r"^\d+_[A-Za-z]\w*$")
_Globs = list[tuple[str, re.Pattern[str]]]
KNOWN_DIRS = frozenset({"tokenizer", "tokenizer_2", "tokenizer_3", "text_encoder", "text_encoder_2",
                        "text_encoder_3", "scheduler", "feature_extractor", "image_processor", "processor",
                        "unet", "vae", "transformer", "prior", "decoder",
                        # more diffusers pipeline components (model_index.json names them)
                        "image_encoder", "safety_checker", "controlnet", "transformer_2", "vqvae", "movq"})


@dataclass(frozen=True)
class BundleMember:
    """One file of the plan: its archive name, the real file it comes from, size and mode."""

    name: str
    source: Path
    size: int
    mode: int = FILE_MODE


@dataclass(frozen=True)
class BundlePlan:
    """What goes into the bundle, sorted by name, and what was left out and why."""

    src: Path
    members: tuple[BundleMember, ...]
    skipped: tuple[tuple[str, str], ...] = ()

    @property
    def dirs(self) -> tuple[str, ...]:
        """Every parent directory of a member, sorted (each is written to the archive)."""
        found = {"/".join(m.name.split("/")[:i]) for m in self.members for i in range(1, m.name.count("/") + 1)}
        return tuple(sorted(found))

    @property
    def total_size(self) -> int:
        return sum(m.size for m in self.members)


@dataclass(frozen=True)
class MemberDigest:
    """A member as written: name, size, sha256 (hex)."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class WrittenBundle:
    """The archive as written and verified."""

    path: Path
    size: int
    sha256: str
    zstd_level: int
    members: tuple[MemberDigest, ...]


# ---------------------------------------------------------------------------------------
# planning


def glob_regex(pattern: str) -> re.Pattern[str]:
    """Compile a recipe glob: ``*`` and ``?`` stay within a path component, ``**`` spans any.

    A pattern without ``/`` matches the file name at any depth; one with ``/`` matches the
    whole path relative to the source.
    """
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:[^/]*/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        else:
            c = pattern[i]
            out.append("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c))
            i += 1
    prefix = "" if "/" in pattern else "(?:.*/)?"
    return re.compile(prefix + "".join(out) + r"\Z")


def _never(name: str) -> str | None:
    suffix = Path(name).suffix.lower()
    return next((kind for kind, suffixes in NEVER.items() if suffix in suffixes), None)


def _default(rel: str) -> str | None:
    """None when the default rules take ``rel``, else the reason it is skipped."""
    parts = rel.split("/")
    if len(parts) > 2 or (len(parts) == 2 and not (_MODULE_DIR.match(parts[0]) or parts[0] in KNOWN_DIRS)):
        return "not in the model root or a known sub-folder"
    if _WEIGHTS_INDEX.search(rel):
        return "weights index (the weights stage writes its own)"
    if Path(rel).suffix.lower() in TEXT_SUFFIXES or _VERSIONED_MODEL.search(rel):
        return None
    return "not a tokenizer/config file type"


def _select(rel: str, include: _Globs, exclude: _Globs) -> str | None:
    if kind := _never(rel):
        return f"{kind} (never bundled)"
    if glob := next((g for g, rx in exclude if rx.match(rel)), None):
        return f"excluded by {glob!r}"
    if any(rx.match(rel) for _, rx in include):
        return None
    if any(p.startswith(".") for p in rel.split("/")):
        return "hidden"
    return _default(rel)


def _inside(path: Path, roots: tuple[Path, ...], rel: str) -> Path:
    return confined(path, roots, error=BundleError, what=f"symlink {rel!r}")


def _walk(src: Path, roots: tuple[Path, ...], deep: bool) -> Iterator[tuple[str, Path]]:
    """Yield (relative name, path) of non-directories; descend into sub-folders as the rules need."""
    stack, seen = [("", src)], set()
    while stack:
        rel_dir, path = stack.pop()
        real = _inside(path, roots, rel_dir or ".")
        if real in seen or rel_dir.count("/") >= reader.DEFAULT_MAX_DEPTH:
            continue  # a symlink loop, or deeper than the reader would accept
        seen.add(real)
        with os.scandir(path) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
            if not e.is_dir():
                yield rel, Path(e.path)
            elif deep or (not rel_dir and (_MODULE_DIR.match(e.name) or e.name in KNOWN_DIRS)):
                if deep and e.name.startswith("."):
                    continue
                stack.append((rel, Path(e.path)))


def plan_bundle(src: Path, cfg: BundleConfig, *, allowed_root: Path | None = None) -> BundlePlan:
    """Choose the bundle members of a model directory (pure: reads metadata only).

    Default: json, txt, model, jinja, tiktoken, vocab, spm, bpe and yaml files at the root and
    in known sub-folders (sentence-transformers ``N_Name/``, diffusers components), minus
    weights indexes, hidden files, and never weights, code or pickles. ``cfg.exclude`` globs
    remove files; ``cfg.include`` globs add any other file except weights, code and pickles.

    Args:
        src: the model directory.
        cfg: the recipe's ``[bundle]`` section.
        allowed_root: where symlinks may lead; default :func:`packer.idents.link_roots` (``src``;
            for a Hugging Face cache snapshot, the snapshot and its own repository's ``blobs/``).

    Returns:
        the plan, members sorted by name.

    Raises:
        BundleError: a symlink leading outside ``allowed_root``, a selected entry that is not a
            regular file, names that collide or the reader would refuse, or reader caps exceeded.
    """
    src = Path(src)
    roots = (Path(allowed_root),) if allowed_root is not None else link_roots(src)
    include = [(g, glob_regex(g)) for g in cfg.include]
    exclude = [(g, glob_regex(g)) for g in cfg.exclude]
    members, skipped = [], []
    for rel, path in _walk(src, roots, deep=bool(include)):
        if reason := _select(rel, include, exclude):
            skipped.append((rel, reason))
            continue
        real = _inside(path, roots, rel)
        try:
            st = os.stat(real)
        except FileNotFoundError:
            raise BundleError(f"{path}: broken symlink") from None
        if not stat.S_ISREG(st.st_mode):
            raise BundleError(f"{path}: is {file_kind(st.st_mode)}, not a regular file; "
                              "exclude it with [bundle] exclude")
        members.append(BundleMember(rel, real, st.st_size))
    members.sort(key=lambda m: m.name)
    plan = BundlePlan(src, tuple(members), tuple(sorted(skipped)))
    _check_plan(plan)
    return plan


def _check_plan(plan: BundlePlan) -> None:
    """Refuse what the runtime reader would refuse, naming the source file."""
    seen: dict[str, str] = {}
    for name in (*plan.dirs, *(m.name for m in plan.members)):
        try:
            reader.check_name(name)
        except reader.BundleFormatError as e:
            raise BundleError(f"{plan.src}: {e}") from e
        key = reader.member_key(name)
        if key in seen:
            raise BundleError(f"{plan.src}: {name!r} and {seen[key]!r} collide after case folding or "
                              "Unicode normalisation; exclude one")
        seen[key] = name
    if len(seen) > reader.DEFAULT_MAX_MEMBERS:
        raise BundleError(f"{plan.src}: {len(seen)} bundle entries, over the reader's cap of "
                          f"{reader.DEFAULT_MAX_MEMBERS}; narrow it with [bundle] exclude")
    tar_size = _tar_size(plan)
    if tar_size > reader.DEFAULT_MAX_BYTES:
        raise BundleError(f"{plan.src}: bundle of {tar_size} bytes, over the reader's cap of "
                          f"{reader.DEFAULT_MAX_BYTES}; narrow it with [bundle] exclude")


# ---------------------------------------------------------------------------------------
# writing: ustar headers (PAX "path" records for long names), one zstd frame


def ustar_header(name: str, *, size: int, mtime: int, is_dir: bool) -> bytes:
    """One ustar header, uid/gid 0; a name ustar cannot hold (over 100 bytes with no '/' to
    split at, or over 255) gets a PAX ``path`` record before it, as reproducible as the rest."""
    try:
        return tarfmt.header(name, size=size, mtime=mtime, is_dir=is_dir, pax=False)
    except ValueError:
        return tarfmt.header(name, size=size, mtime=mtime, is_dir=is_dir, pax=True)


def _padding(size: int) -> int:
    return len(tarfmt.padding(size))


def _headers(plan: BundlePlan, mtime: int) -> list[tuple[bytes, BundleMember | None]]:
    """Every entry's header bytes, in archive order, computed before anything is written."""
    entries = sorted([(d + "/", None) for d in plan.dirs] + [(m.name, m) for m in plan.members], key=lambda e: e[0])
    out: list[tuple[bytes, BundleMember | None]] = []
    for name, member in entries:
        if member is None:
            out.append((ustar_header(name[:-1], size=0, mtime=mtime, is_dir=True), None))
        else:
            out.append((ustar_header(name, size=member.size, mtime=mtime, is_dir=False), member))
    return out


def _tar_size(plan: BundlePlan, headers: list[tuple[bytes, BundleMember | None]] | None = None) -> int:
    """The exact tar stream size (header lengths do not depend on the mtime's value)."""
    headers = _headers(plan, 0) if headers is None else headers
    return sum(len(h) for h, _ in headers) + sum(m.size + _padding(m.size) for m in plan.members) + 1024


def _copy_member(member: BundleMember, out: Any) -> MemberDigest:
    h, left = hashlib.sha256(), member.size
    with open_regular(member.source, BundleError) as f:
        while left and (chunk := f.read(min(left, _CHUNK))):
            h.update(chunk)
            out.write(chunk)
            left -= len(chunk)
        if left or f.read(1):
            raise BundleError(f"{member.source}: changed size while being bundled; retry")
    out.write(bytes(_padding(member.size)))
    return MemberDigest(member.name, member.size, h.hexdigest())


def _write_stream(plan: BundlePlan, fh: Any, level: int, threads: int) -> tuple[MemberDigest, ...]:
    import zstandard

    headers = _headers(plan, tarfmt.source_date_epoch(BundleError))
    size = _tar_size(plan, headers)
    digests = []
    cctx = zstandard.ZstdCompressor(level=level, threads=threads, write_checksum=True, write_content_size=True)
    zw = cctx.stream_writer(fh, size=size, closefd=False)
    try:
        for header, member in headers:
            zw.write(header)
            if member is not None:
                digests.append(_copy_member(member, zw))
        zw.write(bytes(1024))
    except BaseException as e:
        # closing a half-written frame raises ("Src size is incorrect"): never over ``e``
        quiet_cleanup(e, zw.close)
        raise
    zw.close()
    return tuple(sorted(digests, key=lambda d: d.name))


def write_bundle(plan: BundlePlan, dest: Path, *, level: int = ZSTD_LEVEL, threads: int = -1) -> WrittenBundle:
    """Write ``plan`` as ``dest`` (a temp file beside it, verified, then renamed into place).

    Args:
        plan: from :func:`plan_bundle`.
        dest: the archive path.
        level: zstd level.
        threads: zstd worker threads (-1: one per CPU); the bytes do not depend on it. 0
            (zstd's single-threaded mode, which frames differently) is taken as 1.

    Returns:
        size, sha256 and the member index of the archive.

    Raises:
        BundleError: a source file changed while being read, or the result failed verification.
    """
    dest, threads = Path(dest), threads or 1
    digests: tuple[MemberDigest, ...] = ()
    checked: list[tuple[int, str]] = []  # (size, sha256) of the archive, once it read back

    def read_back(tmp: Path) -> None:
        try:
            check = reader.Bundle.open(tmp)
        except reader.BundleFormatError as e:
            raise BundleError(f"{dest}: the archive just written does not read back: {e}") from e
        back = [MemberDigest(n, len(b := check.read(n)), hashlib.sha256(b).hexdigest()) for n in check.names()]
        if tuple(back) != digests:
            raise BundleError(f"{dest}: the archive just written does not match its sources; retry")
        checked.append((os.stat(tmp).st_size, check.sha256))

    with atomic_open(dest, check=read_back) as fh:
        digests = _write_stream(plan, fh, level, threads)
    size, sha256 = checked[0]
    return WrittenBundle(dest, size, sha256, level, digests)


def _plan_section(plan: BundlePlan) -> dict[str, Any]:
    return {"file": ARCHIVE_NAME, "dry_run": True, "zstd_level": ZSTD_LEVEL,
            "members": [{"name": m.name, "size": m.size, "source": str(m.source)} for m in plan.members],
            "skipped": [{"name": n, "reason": r} for n, r in plan.skipped]}


def _notes(plan: BundlePlan) -> tuple[str, ...]:
    by_reason: dict[str, list[str]] = {}
    for name, reason in plan.skipped:
        if not reason.startswith("weights"):  # the weights stage converts those: no news
            by_reason.setdefault(reason, []).append(name)
    return tuple(f"bundle: skipped ({reason}): {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
                 for reason, names in sorted(by_reason.items()))


def run_bundle(src: Path, cfg: BundleConfig, out_dir: Path, *, rel_root: Path | None = None,
               allowed_root: Path | None = None, dry_run: bool = False) -> StageOutput:
    """The build stage: plan and write ``out_dir/bundle.tar.zst``.

    Args:
        src: the model directory (a local snapshot).
        cfg: the recipe's ``[bundle]`` section.
        out_dir: where the archive goes.
        rel_root: manifest paths are relative to this (default ``out_dir``).
        allowed_root: where symlinks may lead (see :func:`plan_bundle`).
        dry_run: return the plan as the section and write nothing.

    Returns:
        the archive as a FileEntry and the section ``{file, size, sha256, zstd_level, members}``.

    Raises:
        BundleError: see :func:`plan_bundle` and :func:`write_bundle`.
    """
    plan = plan_bundle(src, cfg, allowed_root=allowed_root)
    if dry_run:
        return StageOutput(section=_plan_section(plan), notes=_notes(plan))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = write_bundle(plan, out_dir / ARCHIVE_NAME)
    rel = written.path.relative_to(rel_root if rel_root is not None else out_dir).as_posix()
    section = {"file": rel, "size": written.size, "sha256": written.sha256, "zstd_level": written.zstd_level,
               "members": [{"name": m.name, "size": m.size, "sha256": m.sha256} for m in written.members]}
    return StageOutput(files=(FileEntry(rel, written.size, written.sha256),), section=section,
                       bytes_processed=plan.total_size, notes=_notes(plan))


def bundle_to_file(src: Path, out: Path, cfg: BundleConfig, *, dry_run: bool = False) -> dict[str, Any]:
    """``packer bundle SRC -o ARCHIVE``: like :func:`run_bundle` with a free archive name.

    Returns:
        the section (``members`` always; ``size`` and ``sha256`` unless ``dry_run``).
    """
    plan = plan_bundle(src, cfg)
    if dry_run:
        return _plan_section(plan)
    out = Path(out)
    written = write_bundle(plan, out)
    return {"file": str(out), "size": written.size, "sha256": written.sha256, "zstd_level": written.zstd_level,
            "members": [{"name": m.name, "size": m.size, "sha256": m.sha256} for m in written.members]}


def unbundle(archive: Path, dest: Path) -> list[str]:
    """``packer unbundle ARCHIVE -o DIR``: validate, extract beside DIR, rename into place.

    Args:
        archive: a bundle archive.
        dest: a directory that does not exist or is empty.

    Returns:
        the extracted file names, sorted.

    Raises:
        BundleError: the archive is malformed, hostile or over a cap, or ``dest`` is not empty.
    """
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or dest.is_symlink() or any(dest.iterdir())):
        raise BundleError(f"{dest}: exists and is not an empty directory; choose a new -o")
    try:
        check_regular(archive, BundleError)
        bundle = reader.Bundle.open(archive)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    except reader.BundleFormatError as e:
        raise BundleError(str(e)) from e
    except OSError as e:
        raise BundleError(f"{archive}: {e.strerror or e}") from e
    try:
        bundle.extract(tmp)
        os.chmod(tmp, DIR_MODE & ~umask())
        os.rename(tmp, dest)  # replaces an empty directory, fails on a non-empty one
    except OSError as e:
        raise BundleError(f"{dest}: cannot extract {archive}: {e.strerror or e}") from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return bundle.names()


def verify_bundle(out: Path, section: dict[str, Any]) -> None:
    """``packer verify``: the archive reads back safely and every member matches the manifest.

    Args:
        out: the build output directory.
        section: the manifest's ``bundle`` section.

    Raises:
        VerifyError: naming the archive and the first member that differs.
    """
    path = Path(out) / section["file"]
    try:
        bundle = reader.Bundle.open(path)
    except (reader.BundleFormatError, OSError) as e:
        raise VerifyError(f"{section['file']}: does not read back as a bundle: {e}") from e
    if bundle.sha256 != section["sha256"]:
        raise VerifyError(f"{section['file']}: sha256 {bundle.sha256} != manifest {section['sha256']}")
    expected = {m["name"]: m for m in section["members"]}
    if bundle.names() != sorted(expected):
        missing = sorted(set(expected) ^ set(bundle.names()))
        raise VerifyError(f"{section['file']}: members differ from the manifest (first: {missing[0]!r})")
    for name in bundle.names():
        data = bundle.read(name)
        if len(data) != expected[name]["size"] or hashlib.sha256(data).hexdigest() != expected[name]["sha256"]:
            raise VerifyError(f"{section['file']}: member {name!r} does not match the manifest")
