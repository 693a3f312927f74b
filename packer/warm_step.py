"""The warm step after a build: capture the engine's start-up state, sign it, add its image.

``packer warm`` and ``packer build`` with a ``[warm]`` table both come here:
:func:`packer.warm.capture.warm` runs the engine and pins what it wrote into
``OUT/warm/<name>/``, signed with the build's key when one is given
(:mod:`packer.warm.trust`); then the state becomes its own image in ``OUT/image``
(:mod:`packer.oci.warm_layer`), tagged ``<tag>-warm-<name>``. :func:`warm_after_build` is the
recipe's version: it first asks the engine's interpreter whether the engine is installed and on
which device kind, and says why in a note when it does not warm.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path
from typing import Any

from packer.errors import WarmStateError
from packer.manifest import read_manifest
from packer.oci.warm_layer import add_warm_image, check_warm_images
from packer.recipe import Recipe
from packer.show import show
from packer.warm.capture import warm
from packer.warm.pins import WARM_DIR

_PROBE = "from vllm.platforms import current_platform as p; print(p.device_type)"


def warm_output(out: Path, *, engine: str, engine_args: list[str], python: str | None = None,
                model_dir: Path | None = None, timeout: float = 1800.0,
                sign_key: Path | None = None) -> dict[str, Any]:
    """Capture, sign (with ``sign_key``) and image the warm state of the build ``out``.

    Returns:
        :func:`packer.warm.capture.warm`'s summary, with ``signed``, ``image`` (the warm
        image's tag and digests, or None for a build without an image) and ``notes``.

    Raises:
        WarmStateError: the engine's run failed, or the state does not check.
        SignError, DependencyError: ``sign_key`` cannot be used.
        ImageError: the build's image cannot take the state's layer.
    """
    signer = None
    if sign_key is not None:
        from packer.sign.keys import load_signing_key, signed_bundle

        signer = functools.partial(signed_bundle, load_signing_key(sign_key))  # a bad key fails before the run
    summary = warm(out, engine=engine, engine_args=engine_args, python=python, model_dir=model_dir,
                   timeout=timeout, signer=signer)
    _, manifest = read_manifest(out)
    notes = []
    if manifest.get("signature") and signer is None:
        notes.append(f"{summary['state']} is unsigned: under PACKER_REQUIRE_SIGNATURE the plugin refuses it "
                     "(pass --sign-key, the key that signed the build)")
    image = manifest.get("image") or {}
    summary["image"] = add_warm_image(out, out / WARM_DIR / summary["name"], tag=image["tag"]) if image else None
    if image:  # what verify will prove: made again from the state, and the index the build pinned
        check_warm_images(out, tag=image["tag"], index_digest=image["index_digest"],
                          signed=bool(manifest.get("signature")))
    return {**summary, "signed": signer is not None, "notes": notes}


def warm_after_build(out: Path, recipe: Recipe, *, timeout: float = 1800.0) -> tuple[dict[str, Any] | None, list[str]]:
    """The recipe's ``[warm]`` table for the build just published at ``out``.

    Returns:
        ``(the warm summary, notes)``; ``(None, [why])`` when the engine is not installed in
        its interpreter or runs on another device kind than ``warm.device``.

    Raises:
        as :func:`warm_output`.
    """
    cfg = recipe.warm
    if cfg.engine is None:
        return None, []
    python = cfg.python or sys.executable
    kind, why = _device_kind(python, timeout)
    if kind is None:
        return None, [f"[warm] skipped: {why}; run packer warm {out} on the machine that has it"]
    if cfg.device and kind != cfg.device:
        return None, [f"[warm] skipped: warm.device is {cfg.device!r} and {python}'s {cfg.engine} runs on {kind!r}; "
                      f"run packer warm {out} on a {cfg.device} runner"]
    summary = warm_output(out, engine=cfg.engine, engine_args=list(cfg.args), python=python,
                          model_dir=Path(cfg.model_dir) if cfg.model_dir else None, timeout=timeout,
                          sign_key=recipe.sign_key())
    return summary, list(summary["notes"])


def _device_kind(python: str, timeout: float) -> tuple[str | None, str]:
    """The device kind the engine in ``python`` runs on, or None and why not."""
    try:
        r = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{python} did not run ({type(e).__name__}: {e})"
    if r.returncode != 0:
        if "No module named 'vllm'" in r.stderr:
            return None, f"vLLM is not installed in {python} (warm.python names its interpreter)"
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{python} could not start vLLM: {show(last[-300:])}"
    kind = (r.stdout.strip().splitlines() or [""])[-1]
    if kind not in ("cpu", "cuda"):
        raise WarmStateError(f"{python}: vLLM reports the device kind {show(kind)!r}; packer warms cpu and cuda")
    return kind, ""
