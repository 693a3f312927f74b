"""The loader's surroundings: the CUDA start-up variables and the basics every module shares.

Holds what the other runtime modules need: the environment the loader applies before CUDA
starts (at import, so importing the loader first is what makes it take effect), the
safetensors dtype codes and :class:`ArtifactMismatchError`. The ``PACKER_*`` knobs are parsed
in ``settings``; the build's manifest is pinned by the emitted ``packer_loader.py``.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import TYPE_CHECKING

from .settings import MIB, setting
from .timeline import import_torch

if TYPE_CHECKING:
    import torch

MAX_RING_BYTES = 512 * MIB
MAX_HEADER = 100 * MIB
STARTUP_ENV = {"CUDA_MODULE_LOADING": "LAZY"}
STREAM_SCHEME = "oci://"  # a root that names a registry image: the build is streamed (:mod:`.remote`)
STREAM_FILE = "packer-stream.json"  # in a streamed model directory: the reference its weights come from


def is_ref(text: object) -> bool:
    """Whether ``text`` is meant as a registry reference (``oci://...``), well formed or not.

    Here, not in :mod:`.registry`: the loader asks at every start, and a local load imports
    no HTTP or TLS module."""
    return isinstance(text, str) and text.startswith(STREAM_SCHEME)


def printable(text: str) -> str:
    """``text`` with every non-printable character (ESC, a newline, a bidi control) written as
    its visible backslash escape, as ``repr`` writes it: text an input or a server chose, shown
    on a terminal or in one error line, is never interpreted there."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


POOL_ENV = "PACKER_WARM_SERVER"  # set only while warm_context's fork server starts: "you are the server"
_ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the user's allocator settings
DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1), "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1), "I64": ("int64", 8), "I32": ("int32", 4),
    "I16": ("int16", 2), "I8": ("int8", 1), "U64": ("uint64", 8), "U32": ("uint32", 4),
    "U16": ("uint16", 2), "U8": ("uint8", 1), "BOOL": ("bool", 1), "C64": ("complex64", 8),
    "F4": ("float4_e2m1fn_x2", 1),  # two values a byte: the manifest's torch_shape is its shape
}


class ArtifactMismatchError(RuntimeError):
    """The artifacts on disk do not match the manifest embedded in this loader.

    Its message is escaped when it is made (:func:`printable`): a serving engine prints it as it
    is (vLLM's traceback, a worker's log line), outside any entry point of packer's, and it names
    paths, members, references and a registry's words, which an input chose.
    """

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(printable(str(message)), *args)


def _wanted_env() -> dict[str, str]:
    """The start-up variables to set: ``STARTUP_ENV`` minus the user's, plus expandable segments
    when ``PACKER_EXPANDABLE_SEGMENTS=1`` asks and no allocator setting was made (they break
    CUDA tensor sharing between processes in unprivileged containers, so never by default)."""
    out = {k: v for k, v in STARTUP_ENV.items() if k not in os.environ}
    if setting("expandable_segments"):
        user = [k for k in _ALLOC_VARS if k in os.environ]
        if user:
            warnings.warn(f"packer_loader: PACKER_EXPANDABLE_SEGMENTS=1 ignored: {user[0]} is set; "
                          "add expandable_segments:True there yourself", RuntimeWarning, stacklevel=4)
        else:
            out["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return out


def _apply_env() -> None:
    """Set the CUDA start-up variables unless the user did; warn when it is already too late."""
    wanted = _wanted_env()
    unset = list(wanted)
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if unset and cuda is not None and cuda.is_initialized():
        warnings.warn(f"packer_loader: CUDA was initialised before the loader was imported; "
                      f"{', '.join(unset)} cannot take effect (import the loader first)",
                      RuntimeWarning, stacklevel=3)
    for key in unset:
        os.environ[key] = wanted[key]


_apply_env()


def torch_dtype(code: str, where: str) -> tuple[torch.dtype, int]:
    """The torch dtype of the safetensors code ``code`` and its item size in bytes.

    Raises:
        ArtifactMismatchError: a code this loader does not know, or one this torch lacks
            (``where`` names the tensor).
    """
    if code not in DTYPES:
        raise ArtifactMismatchError(f"{where}: dtype {code!r} is not supported by this loader")
    name, size = DTYPES[code]
    dt = getattr(import_torch(), name, None)
    if dt is None:
        raise ArtifactMismatchError(f"{where}: dtype {code} needs a newer torch ({name})")
    return dt, size

