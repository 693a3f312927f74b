"""packer: build-time packaging that makes GPU inference servers start fast.

The library API is what each ``packer`` command calls (the command line only parses options,
calls one of these and prints), plus the recipe loaders and the errors they raise::

    from pathlib import Path

    import packer

    recipe = packer.load_recipe("recipe.toml")  # or packer.demo_recipe()
    result = packer.build(recipe, "out")        # a BuildResult
    packer.verify(Path("out"))                  # raises packer.VerifyError on a mismatch

Every name resolves on first use (:pep:`562`), so ``import packer`` stays cheap: it imports no
stage, no third-party package and no torch. The emitted loader's API is not here: it is the
stub's (``packer_loader.py``, docs/reference/loader.md), which cannot import packer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from packer.version import __version__

if TYPE_CHECKING:
    from packer.building import BuildResult, build
    from packer.bundle import bundle_to_file, unbundle
    from packer.checkpoint import inspect_checkpoint
    from packer.demo import write_demo_model
    from packer.errors import (
        BlobDigestError,
        BundleError,
        CheckpointError,
        DependencyError,
        DisallowedGlobalError,
        EngineAdapterError,
        ImageArtifactMismatchError,
        ImageError,
        LoaderError,
        PackerError,
        RecipeError,
        SignError,
        SourceError,
        StubError,
        TruncatedPickle,
        UnsafeInputError,
        UsageError,
        VerifyError,
        WarmStateError,
        WeightsError,
    )
    from packer.profiling import profile
    from packer.pushing import push
    from packer.recipe import Recipe, demo_recipe, load_recipe
    from packer.verifying import verify

# each name of __all__ -> the module that defines it (tests/test_public_surface.py: the same names)
_HOMES: dict[str, str] = {
    "build": "packer.building", "BuildResult": "packer.building",
    "verify": "packer.verifying",
    "push": "packer.pushing",
    "profile": "packer.profiling",
    "load_recipe": "packer.recipe", "demo_recipe": "packer.recipe", "Recipe": "packer.recipe",
    "inspect_checkpoint": "packer.checkpoint",
    "bundle_to_file": "packer.bundle", "unbundle": "packer.bundle",
    "write_demo_model": "packer.demo",
    **dict.fromkeys((
        "PackerError", "DependencyError", "RecipeError", "SourceError", "CheckpointError", "UnsafeInputError",
        "DisallowedGlobalError", "PayloadError", "TruncatedPickle", "WeightsError", "BundleError", "ImageError",
        "UsageError", "VerifyError", "ChunkMismatchError", "BlobDigestError", "ImageArtifactMismatchError",
        "LoaderError", "StubError", "SignError", "EngineAdapterError", "WarmStateError"), "packer.errors"),
}

__all__ = [
    "__version__",
    "build", "BuildResult", "verify", "push", "profile",
    "load_recipe", "demo_recipe", "Recipe", "inspect_checkpoint", "bundle_to_file", "unbundle",
    "write_demo_model",
    "PackerError", "DependencyError", "RecipeError", "SourceError", "CheckpointError", "UnsafeInputError",
    "DisallowedGlobalError", "PayloadError", "TruncatedPickle", "WeightsError", "BundleError", "ImageError",
    "UsageError", "VerifyError", "ChunkMismatchError", "BlobDigestError", "ImageArtifactMismatchError",
    "LoaderError", "StubError", "SignError", "EngineAdapterError", "WarmStateError",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'packer' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # resolved once; no public name is also a submodule's, so nothing rebinds it
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
