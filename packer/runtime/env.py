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


# The name a user imports the emitted loader's errors by. Shipped into a build, this package runs
# under a private name (``_packer_runtime_<hash>``, one per build in a process): tracebacks and
# reprs show the public one instead, while pickling keeps the private one (:meth:`ArtifactMismatchError.__reduce__`),
# which names exactly this build's class where several builds are loaded.
PUBLIC_MODULE = "packer_loader" if __name__.startswith("_packer_runtime_") else None


def _rebuilt(module: str, qualname: str, args: tuple[object, ...], state: dict[str, object]) -> BaseException:
    """An error of the class ``qualname`` of this runtime's own ``module`` with ``args`` and
    attributes ``state``, its ``__init__`` not called (its message was escaped when first made)."""
    import importlib

    if not module.isidentifier():
        raise TypeError(f"not a runtime module: {module!r}")
    # a module of this very package (this build's checked runtime, found by its own finder)
    cls = getattr(importlib.import_module(f"{__package__}.{module}"), qualname)
    new: BaseException = cls.__new__(cls)
    BaseException.__init__(new, *args)
    new.__dict__.update(state)
    return new


class ArtifactMismatchError(RuntimeError):
    """The artifacts on disk do not match the manifest embedded in this loader.

    Its message is escaped when it is made (:func:`printable`): a serving engine prints it as it
    is (vLLM's traceback, a worker's log line), outside any entry point of packer's, and it names
    paths, members, references and a registry's words, which an input chose. It and every
    subclass (the registry's ``RegistryError``) show as ``packer_loader.<name>`` in a build.
    """

    _home = __name__  # the module that defines the class, whatever __module__ shows

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls._home = cls.__module__
        if PUBLIC_MODULE is not None and cls.__module__.startswith(f"{__package__}."):  # the runtime's own
            cls.__module__ = PUBLIC_MODULE

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(printable(str(message)), *args)

    def __reduce__(self) -> str | tuple[object, ...]:
        # by the defining module, not by __module__: the public name is not importable in every
        # process, and where two builds are loaded it would not say which build's class this is
        package, _, module = type(self)._home.rpartition(".")
        if package != __package__:  # a subclass defined outside the runtime: by its own name
            return super().__reduce__()
        return _rebuilt, (module, type(self).__qualname__, self.args, dict(self.__dict__))


if PUBLIC_MODULE is not None:
    ArtifactMismatchError.__module__ = PUBLIC_MODULE


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

