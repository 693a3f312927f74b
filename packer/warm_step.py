"""The warm step after a build: capture the engine's start-up state, sign it, add its image.

``packer warm`` and ``packer build`` with a ``[warm]`` table both come here: OUT is verified
first (as ``packer push`` does); :func:`packer.warm.capture.warm` runs the engine and pins what
it wrote into a staging directory renamed to ``OUT/warm/<name>/``, signed with the build's key when one is given
(:mod:`packer.warm.trust`); then the state becomes its own image in ``OUT/image``
(:mod:`packer.oci.warm_layer`), tagged ``<tag>-warm-<name>``. :func:`warm_after_build` is the
recipe's version; :func:`check_warm_table` makes every check of the ``[warm]`` table that needs no
build before the build starts (the engine flags, whether the engine is installed in its
interpreter and on which device kind, the model directory), refusing a table that cannot run
before anything is built, and saying why in a note when it will not warm on this machine.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packer.errors import RecipeError, UsageError, VerifyError, WarmStateError
from packer.manifest import read_manifest
from packer.oci.warm_layer import WarmImage, check_warm_images, plan_warm_image
from packer.place import BLOBS
from packer.recipe import Recipe
from packer.util.fsutil import atomic_write_bytes, quiet_cleanup, remove_tree
from packer.util.show import show
from packer.verifying import verify
from packer.warm.capture import check_engine_args, check_request, warm
from packer.warm.pins import WARM_DIR, plain_dir, plain_file, write_state
from packer.warm.requests import DEFAULT_REQUESTS, ENGINE_MISSING
from packer.warm.swap import Renames

# the device kind vLLM runs on; an interpreter without vllm exits with ENGINE_MISSING
_PROBE = ("import sys\ntry:\n    from vllm.platforms import current_platform as p\n"
          "except ModuleNotFoundError as e:\n    if e.name != 'vllm':\n        raise\n"
          f"    sys.exit({ENGINE_MISSING})\nprint(p.device_type)\n")


def warm_output(out: Path, *, engine: str, engine_args: list[str], python: str | None = None,
                model_dir: Path | None = None, timeout: float = 1800.0,
                sign_key: Path | None = None, progress: Callable[[str], None] | None = None,
                requests: tuple[dict[str, Any], ...] | None = None) -> dict[str, Any]:
    """Verify, capture, sign (with ``sign_key``) and image the warm state of the build ``out``.

    ``out`` is verified as ``packer push`` verifies it before anything of it runs or is
    signed. The new state and its image's blobs are made in a staging directory inside
    ``out``, then renamed in (:class:`packer.warm.swap.Renames`), replacing a state of the
    same name and its warm image's blobs; a failure anywhere leaves ``out`` as it was.

    ``progress``, when given, is told in one line as each step starts (the engine's run takes
    minutes, and a command silent that long looks hung).

    Args:
        requests: the request mix of the engine's run (:mod:`packer.warm.requests`); None: the default.

    Returns:
        :func:`packer.warm.capture.warm`'s summary, with ``signed``, ``image`` (the warm
        image's tag and digests, or None for a build without an image) and ``notes``.

    Raises:
        UsageError: engine flags that name a model, or a ``model_dir`` that does not exist.
        VerifyError: ``out`` does not match its manifest; nothing ran.
        WarmStateError: the engine's run failed, the state does not check, or a path in
            ``out`` the state goes to is a link.
        SignError, DependencyError: ``sign_key`` cannot be used.
        ImageError: the build's image cannot take the state's layer.
    """
    check_request(out, engine=engine, engine_args=engine_args, model_dir=model_dir)
    signer = None
    if sign_key is not None:
        from packer.sign.keys import load_signing_key, signed_bundle

        signer = functools.partial(signed_bundle, load_signing_key(sign_key))  # a bad key fails before the run
    say = progress or (lambda _line: None)
    say(f"verifying {out} against its manifest")
    try:
        verify(out)
    except VerifyError as e:
        raise e.with_context(f"packer warm {show(str(out))}: not warmed, the build does not match its manifest") from e
    _, manifest = read_manifest(out)
    image = manifest.get("image") or {}
    _check_places(out, bool(image))
    images: list[WarmImage] = []

    def keep(name: str, key: dict[str, Any], files: dict[str, Path]) -> dict[str, Any]:
        say(f"pinning the {len(files)} files of {name}{', signing it' if signer else ''}"
            f"{', making its image' if image else ''}")
        doc, plan = _keep(out, name, key, files, signer=signer, manifest=manifest)
        images.extend([plan] if plan else [])
        return doc

    say(f"running {engine} once with {python or sys.executable}: it starts, compiles and answers its "
        f"request mix (minutes; at most {timeout:.0f} s)")
    summary = warm(out, engine=engine, engine_args=engine_args, keep=keep, python=python, model_dir=model_dir,
                   timeout=timeout, requests=DEFAULT_REQUESTS if requests is None else requests)
    notes = []
    if manifest.get("signature") and signer is None:
        notes.append(f"{summary['state']} is unsigned: under PACKER_REQUIRE_SIGNATURE the plugin refuses it "
                     "(pass --sign-key, the key that signed the build)")
    return {**summary, "image": images[0].summary if images else None, "signed": signer is not None, "notes": notes}


def _keep(out: Path, name: str, key: dict[str, Any], files: dict[str, Path], *,
          signer: Callable[[dict[str, Any]], bytes] | None,
          manifest: dict[str, Any]) -> tuple[dict[str, Any], WarmImage | None]:
    """Pin ``files`` as the state ``name`` and its warm image in a staging directory in ``out``; rename them in."""
    image = manifest.get("image") or {}
    stage = Path(tempfile.mkdtemp(prefix=".packer-warm-", dir=out))  # made only now: the engine's run is long
    try:
        doc = write_state(stage / name, name=name, key=key, files=files, signer=signer, build=out)
        plan = None
        if image:
            (stage / "blobs").mkdir()
            plan = plan_warm_image(out, stage / name, tag=image["tag"], blobs_dir=stage / "blobs")
        _publish(out, stage, stage / name, plan, lambda: _check_image(out, image, manifest))
    except BaseException as e:
        quiet_cleanup(e, lambda: remove_tree(stage))
        raise
    remove_tree(stage)  # what the publish moved out of OUT
    return doc, plan


def _check_places(out: Path, image: bool) -> None:
    """Refuse a link (or anything but a directory) where the state or the image's changes go."""
    if os.path.lexists(out / WARM_DIR):
        for path in (out / WARM_DIR, *(out / WARM_DIR / d for d in _names(out / WARM_DIR))):
            plain_dir(path)
    if image:
        for path in (out / "image", (out / BLOBS).parent, out / BLOBS):
            plain_dir(path)
        plain_file(out / "image" / "index.json")


def _names(warm_dir: Path) -> list[str]:
    return sorted(os.listdir(warm_dir)) if os.path.lexists(warm_dir) and warm_dir.is_dir() else []


def _publish(out: Path, stage: Path, staged: Path, plan: WarmImage | None, check: Callable[[], None]) -> None:
    """Rename the staged state (and the image's new blobs and index) into ``out``; all undone on failure."""
    warm_dir, old = out / WARM_DIR, stage / "old"
    blobs = out / BLOBS
    old.mkdir()
    journal = Renames()
    try:
        if not os.path.lexists(warm_dir):
            journal.mkdir(warm_dir)
        _check_places(out, plan is not None)
        for hexd in plan.blobs if plan else ():
            if not os.path.lexists(blobs / hexd):  # else: the same bytes, named by their digest
                journal.move(stage / "blobs" / hexd, blobs / hexd)
        dest = warm_dir / staged.name
        if os.path.lexists(dest):
            journal.move(dest, old / "state")
        journal.move(staged, dest)
        if plan is not None:
            atomic_write_bytes(stage / "index.json", plan.index, 0o644)
            journal.replace(stage / "index.json", out / "image" / "index.json", old / "index.json")
            (old / "blobs").mkdir()
            for hexd in plan.stale:
                if os.path.lexists(blobs / hexd):
                    journal.move(blobs / hexd, old / "blobs" / hexd)
        check()
    except BaseException as e:
        quiet_cleanup(e, journal.undo)
        raise


def _check_image(out: Path, image: dict[str, Any], manifest: dict[str, Any]) -> None:
    """What verify will prove of the warm images: made again from the states, the pinned index."""
    if image:
        check_warm_images(out, tag=image["tag"], index_digest=image["index_digest"],
                          signed=bool(manifest.get("signature")))


@dataclass(frozen=True)
class WarmCheck:
    """What :func:`check_warm_table` found before the build: the engine's interpreter and device
    kind, or why the warm step will not run on this machine (a note)."""

    python: str
    skip: str | None


def check_warm_table(recipe: Recipe, out: Path, *, timeout: float = 1800.0) -> WarmCheck | None:
    """Every check of the recipe's ``[warm]`` table that needs no build, made before the build starts.

    The engine flags (no model named, no positional argument), then the engine's interpreter
    asked whether the engine is installed and on which device kind; where it will warm here,
    ``warm.model_dir`` must exist. A table that cannot run is refused now, in one line, before
    anything is built or ``out`` is touched; one that runs elsewhere gives the note said after the build.

    Returns:
        None when the recipe has no ``[warm]`` table; else the check :func:`warm_after_build` takes.

    Raises:
        RecipeError: ``warm.args`` name a model, or ``warm.model_dir`` does not exist where the
            engine is installed; ``warm.device`` is not the engine's device kind is a note, not an error.
        WarmStateError: the engine reports a device kind packer does not warm.
    """
    cfg = recipe.warm
    if cfg.engine is None:
        return None
    model_dir = Path(cfg.model_dir) if cfg.model_dir else None
    python = cfg.python or sys.executable
    try:
        check_engine_args(out, engine=cfg.engine, engine_args=list(cfg.args), model_dir=None)
        kind, why = _device_kind(python, timeout)
        if kind is None:
            return WarmCheck(python, f"[warm] skipped: {why}; run packer warm {out} on the machine that has it")
        if cfg.device and kind != cfg.device:
            return WarmCheck(python, f"[warm] skipped: warm.device is {cfg.device!r} and {python}'s {cfg.engine} "
                                     f"runs on {kind!r}; run packer warm {out} on a {cfg.device} runner")
        check_engine_args(out, engine=cfg.engine, engine_args=list(cfg.args), model_dir=model_dir)
    except UsageError as e:  # the recipe's, not a flag given on the command line
        raise RecipeError(f"the recipe's [warm] table (warm.args, warm.model_dir): {e}; nothing was built") from e
    return WarmCheck(python, None)


def warm_after_build(out: Path, recipe: Recipe, *, timeout: float = 1800.0,
                     checked: WarmCheck | None = None) -> tuple[dict[str, Any] | None, list[str]]:
    """The recipe's ``[warm]`` table for the build just published at ``out``.

    Args:
        checked: :func:`check_warm_table`'s answer before the build (default: asked now).

    Returns:
        ``(the warm summary, notes)``; ``(None, [why])`` when the engine is not installed in
        its interpreter or runs on another device kind than ``warm.device``.

    Raises:
        RecipeError: ``warm.args`` name a model, or ``warm.model_dir`` does not exist.
        others: as :func:`warm_output`.
    """
    cfg = recipe.warm
    checked = checked or check_warm_table(recipe, out, timeout=timeout)
    if cfg.engine is None or checked is None:
        return None, []
    if checked.skip is not None:
        return None, [checked.skip]
    model_dir = Path(cfg.model_dir) if cfg.model_dir else None
    try:
        check_request(out, engine=cfg.engine, engine_args=list(cfg.args), model_dir=model_dir)
    except UsageError as e:  # the recipe's, not a flag given on the command line
        raise RecipeError(f"the recipe's [warm] table (warm.args, warm.model_dir): {e}") from e
    summary = warm_output(out, engine=cfg.engine, engine_args=list(cfg.args), python=checked.python,
                          model_dir=model_dir, timeout=timeout, sign_key=recipe.sign_key(), requests=cfg.requests)
    return summary, list(summary["notes"])


def _device_kind(python: str, timeout: float) -> tuple[str | None, str]:
    """The device kind the engine in ``python`` runs on, or None and why not."""
    try:
        r = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{python} did not run ({type(e).__name__}: {e})"
    if r.returncode != 0:
        if r.returncode == ENGINE_MISSING:
            return None, f"vLLM is not installed in {python} (warm.python names its interpreter)"
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{python} could not start vLLM: {show(last[-300:])}"
    kind = (r.stdout.strip().splitlines() or [""])[-1]
    if kind not in ("cpu", "cuda"):
        raise WarmStateError(f"{python}: vLLM reports the device kind {show(kind)!r}; packer warms cpu and cuda")
    return kind, ""
