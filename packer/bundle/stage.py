"""The bundle stage (``run_bundle``) and its command-line twin (``packer bundle``): plan, then write.

The dry run's section is the plan itself (members with their sources, and what was skipped
and why); a written bundle's section pins the archive and every member's sha256.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from packer.bundle.plan import BundlePlan
from packer.bundle.select import plan_bundle
from packer.bundle.write import ZSTD_LEVEL, WrittenBundle, write_bundle
from packer.recipe import BundleConfig
from packer.stage import StageOutput
from packer.util.fsutil import FileEntry

ARCHIVE_NAME = "bundle.tar.zst"


def _plan_section(plan: BundlePlan, src: Path) -> dict[str, Any]:
    # sources relative to the model directory: a demo's or hub's absolute path means nothing later
    def where(path: Path) -> str:
        return path.relative_to(src).as_posix() if path.is_relative_to(src) else str(path)

    return {"file": ARCHIVE_NAME, "dry_run": True, "zstd_level": ZSTD_LEVEL,
            "members": [{"name": m.name, "size": m.size, "source": where(Path(m.source))} for m in plan.members],
            "skipped": [{"name": n, "reason": r} for n, r in plan.skipped]}


def _section(file: str, written: WrittenBundle) -> dict[str, Any]:
    return {"file": file, "size": written.size, "sha256": written.sha256, "zstd_level": written.zstd_level,
            "members": [{"name": m.name, "size": m.size, "sha256": m.sha256} for m in written.members]}


def _code_notes(plan: BundlePlan) -> list[str]:
    notes = []
    if plan.code:
        notes.append(f"bundle: carries the code files auto_map names, pinned, never imported or run by "
                     f"packer: {', '.join(plan.code)} (bundle.remote_code = false leaves them out)")
    if plan.code_left_out:
        notes.append("bundle: bundle.remote_code = false leaves out the code files auto_map names: the model "
                     "directory will not load with trust_remote_code=True")
    if plan.code_elsewhere:
        notes.append(f"bundle: auto_map names code in other repositories, not carried: "
                     f"{', '.join(plan.code_elsewhere[:8])} (a loader with trust_remote_code fetches it from there)")
    return notes


def _notes(plan: BundlePlan) -> tuple[str, ...]:
    """One note per reason a file was left out, naming the files and the recipe key that carries
    them: a file a library reads (a processor config, a chat template) is never dropped unsaid."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in plan.skipped:
        if not reason.startswith("weights"):  # the weights stage converts those: no news
            by_reason.setdefault(reason, []).append(name)
    skipped = []
    for reason, names in sorted(by_reason.items()):
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
        globs = ", ".join(f'"{n}**"' if n.endswith("/") else f'"{n}"' for n in names[:3])
        way = "" if reason.endswith("(never bundled)") or reason.startswith("excluded by") else \
            f"; bundle.include = [{globs}{', ...' if len(names) > 3 else ''}] carries them"
        skipped.append(f"bundle: skipped ({reason}): {shown}{way}")
    return tuple(_code_notes(plan) + skipped)


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
        return StageOutput(section=_plan_section(plan, Path(src)), notes=_notes(plan))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = write_bundle(plan, out_dir / ARCHIVE_NAME)
    rel = written.path.relative_to(rel_root if rel_root is not None else out_dir).as_posix()
    return StageOutput(files=(FileEntry(rel, written.size, written.sha256),), section=_section(rel, written),
                       bytes_processed=plan.total_size, notes=_notes(plan))


def bundle_to_file(src: Path, out: Path, cfg: BundleConfig, *, dry_run: bool = False) -> dict[str, Any]:
    """``packer bundle SRC -o ARCHIVE``: like :func:`run_bundle` with a free archive name.

    Returns:
        the section (``members`` always; ``size`` and ``sha256`` unless ``dry_run``).
    """
    plan = plan_bundle(src, cfg)
    if dry_run:
        return _plan_section(plan, Path(src))
    out = Path(out)
    return _section(str(out), write_bundle(plan, out))
