"""What the image runs and says about itself: its run config, creation time and annotations.

Run with a base, the image's default command is the loader's self-test (on the build's device,
falling back to cpu as the self-test does), its working directory the prefix, and the prefix is
on ``PYTHONPATH`` so ``import packer_loader`` works; the recipe's ``image.entrypoint``,
``cmd``, ``user``, ``workdir`` and ``env`` replace these. As in a Dockerfile, a base's
``Entrypoint`` stays unless the recipe sets one, and setting one drops the default command.
Without a base the image holds only the model directory: mountable, not runnable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from packer.errors import ImageError
from packer.recipe import ImageConfig, is_registry_reference
from packer.util import tarfmt
from packer.util.formats import LOADER_NAME

_OLD_ENV = ("PACKER_MODEL_DIR=",)  # written by earlier packer versions and read by nothing


def default_cmd(prefix: str) -> list[str]:
    """The self-test command for a loader under ``prefix``."""
    return ["python3", f"{prefix.rstrip('/')}/{LOADER_NAME}", "--selftest"]


def _set_env(env: list[str], key: str, value: str) -> list[str]:
    return [e for e in env if e.partition("=")[0] != key] + [f"{key}={value}"]


def run_config(cfg: ImageConfig, base_run: Mapping[str, Any], *, prefix: str,
               runnable: bool) -> dict[str, Any]:
    """The image config's ``config`` object (Env, Entrypoint, Cmd, User, WorkingDir).

    Args:
        cfg: the recipe's ``[image]`` section.
        base_run: the base image's ``config`` object (``{}`` without a base).
        prefix: the model directory in the image.
        runnable: a base provides a runtime, so a default command makes sense.

    Returns:
        A new mapping (``Labels`` are added by the caller).
    """
    run = dict(base_run)
    env = [e for e in run.get("Env") or [] if not e.startswith(_OLD_ENV)]
    old = next((e.partition("=")[2] for e in env if e.startswith("PYTHONPATH=")), "")
    paths = [prefix, *(p for p in old.split(":") if p and p != prefix)]
    env = _set_env(env, "PYTHONPATH", ":".join(paths))
    for key, value in cfg.env:
        env = _set_env(env, key, value)
    run["Env"] = env
    if cfg.entrypoint is not None:
        run["Entrypoint"] = list(cfg.entrypoint)
    if cfg.cmd is not None:
        run["Cmd"] = list(cfg.cmd)
    elif cfg.entrypoint is not None:
        run.pop("Cmd", None)
    elif runnable:
        run["Cmd"] = default_cmd(prefix)
    else:
        run.pop("Cmd", None)
    if cfg.user is not None:
        run["User"] = cfg.user
    run["WorkingDir"] = cfg.workdir or prefix
    return run


def created_epoch(source: Mapping[str, Any]) -> int:
    """The image's creation time: ``SOURCE_DATE_EPOCH``, else the source revision's commit time
    (``source["commit_time"]``, seconds) where the source knows it, else 0.

    Raises:
        ImageError: a malformed ``SOURCE_DATE_EPOCH``.
    """
    if os.environ.get("SOURCE_DATE_EPOCH", "").strip():
        return tarfmt.source_date_epoch(ImageError)
    when = source.get("commit_time")
    return when if isinstance(when, int) and not isinstance(when, bool) and when >= 0 else 0


def base_name(cfg: ImageConfig, ref_name: str | None) -> str | None:
    """The base's registry reference for ``org.opencontainers.image.base.name``: the recipe's
    ``image.base_name``, else the base layout's own ref annotation when that is a full registry
    reference; never the build machine's path."""
    if cfg.base_name:
        return cfg.base_name
    return ref_name if ref_name and is_registry_reference(ref_name) else None


def image_annotations(name: str, version: str, source: Mapping[str, Any], created: str) -> dict[str, str]:
    """The ``org.opencontainers.image.*`` annotations (also the config's labels)."""
    out = {
        "org.opencontainers.image.created": created,
        "org.opencontainers.image.title": name,
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.source": str(source.get("uri") or source.get("kind") or ""),
    }
    if source.get("revision"):
        out["org.opencontainers.image.revision"] = str(source["revision"])
    return out
