"""The one error hierarchy of packer.

The emitted loader cannot import this module, so the runtime keeps its own two classes under
names used nowhere else: ``ArtifactMismatchError`` (packer/runtime/env.py) and
``BundleFormatError`` (packer/runtime/bundle_reader.py); the build turns the latter into
:class:`BundleError`. :mod:`packer.weights.sandbox` sends an error across the process boundary by
class name and finds the class here, so every class the library raises must live here.

Every message is one line that says what was wrong, where (file, key path, tensor or
member name) and, where there is one, what to do about it. The CLI turns any
:class:`PackerError` into its ``exit_code`` (1; :class:`UsageError` 2); nothing else in the library prints or exits.
"""

from __future__ import annotations

from typing import Any

from packer.util.show import shell_word, show


def _rebuilt(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """An error of class ``cls`` with ``args`` and attributes ``state``, its ``__init__`` not called."""
    new = cls.__new__(cls)
    BaseException.__init__(new, *args)
    new.__dict__.update(state)
    return new


class PackerError(Exception):
    """Base class: a failed build, bad input or a mismatch (exit code 1).

    Every subclass pickles to its own class, message and attributes whatever its ``__init__``
    takes (:meth:`__reduce__`), so an error raised in a worker process arrives as itself.
    """

    exit_code = 1

    def __reduce__(self) -> tuple[Any, ...]:
        # the default calls ``cls(*self.args)`` on unpickling: a subclass whose __init__ takes other
        # arguments (BlobDigestError's ``found``) would arrive as a TypeError
        return _rebuilt, (type(self), self.args, dict(self.__dict__))

    def with_context(self, context: str) -> PackerError:
        """Return a copy of this error whose message is prefixed with ``context: ``.

        Its notes (a cleanup that also failed, see :func:`packer.util.fsutil.quiet_cleanup`) come along.
        """
        new = type(self).__new__(type(self))
        Exception.__init__(new, f"{context}: {self}")
        new.__cause__ = self.__cause__ or self
        for note in getattr(self, "__notes__", ()):
            new.add_note(note)
        return new


class DependencyError(PackerError):
    """A package packer needs at run time is missing or broken: the message names the package.

    Never a verdict on an input or output file: see :func:`missing_dependency`.
    """


# import name -> distribution name on PyPI, where they differ
_DISTRIBUTIONS = {"huggingface_hub": "huggingface-hub", "yaml": "pyyaml"}


def missing_dependency(e: ImportError) -> DependencyError:
    """Turn an ``ImportError`` into a one-line :class:`DependencyError` naming the package.

    ``e.name`` is the module that failed to import (set by the import system); the message
    says how to install its distribution, e.g. ``packer needs numpy: No module named 'numpy'
    (pip install numpy)``.
    """
    top = (e.name or "").split(".")[0] or "a package"
    dist = _DISTRIBUTIONS.get(top, top)
    return DependencyError(f"packer needs {dist}: {e} (pip install {shell_word(dist)})")


class RecipeError(PackerError):
    """The recipe is unreadable or invalid; the message names the key path or line."""


class SourceError(PackerError):
    """The model source cannot be resolved or read."""


class CheckpointError(PackerError):
    """A checkpoint is malformed, unsupported or holds something not allowed."""


class UnsafeInputError(CheckpointError):
    """An input asks for code to run (a pickle global outside the allowlist, TorchScript...)."""


class DisallowedGlobalError(UnsafeInputError):
    """A pickle global outside the allowlist (the message names every one and the flags to pass)."""


class PayloadError(DisallowedGlobalError):
    """A pickle global that runs commands or code when called (``os.system``, ``builtins.eval``):
    a payload, not data; no flag reads it, and no re-save advice is given."""


class TruncatedPickle(CheckpointError):
    """The pickle runs past the end of the bytes given (a caller may retry with more)."""


class WeightsError(PackerError):
    """Planning or writing safetensors output failed."""


class BundleError(PackerError):
    """Building, reading or extracting the tokenizer/config bundle failed."""


class ImageError(PackerError):
    """Building, reading or pushing the OCI image failed."""


class UsageError(PackerError):
    """An argument that is not what the command takes (a push REF that is no registry
    reference): exit code 2, as click's usage errors, but one line."""

    exit_code = 2


class VerifyError(PackerError):
    """An artifact does not match its manifest; the message names the first mismatch."""


class ChunkMismatchError(VerifyError):
    """A chunk of a weight file whose sha256 is not the chunk table's; the message names the file,
    the chunk (index and byte range) and both digests."""


class BlobDigestError(VerifyError):
    """A layer blob whose digest differs from its descriptor; ``found`` holds the files inside it
    as the walk read them (image path -> (size, sha256)), so a caller can name the one that changed."""

    def __init__(self, message: str, found: dict[str, tuple[int, str]]) -> None:
        super().__init__(message)
        self.found = found


class ImageArtifactMismatchError(VerifyError):
    """The image is sound, but its files differ from the artifact manifest it was compared with.

    Not to be confused with the emitted loader's own ``ArtifactMismatchError`` (files on disk
    against its embedded manifest), which lives in ``packer/runtime/env.py``.
    """


class LoaderError(PackerError):
    """``packer profile``: the build has no emitted loader, or its self-test failed or timed out.

    The message of a failed self-test is the loader's own last line, which names the first
    artifact that does not match its embedded manifest.
    """


class StubError(PackerError):
    """The loader template or the bundle reader cannot be embedded into ``packer_loader.py``."""


class SignError(PackerError):
    """Signing a build failed: the key cannot be read or used; the message names the key file."""


class EngineAdapterError(PackerError):
    """A serving engine's packer adapter (the vLLM load format) cannot find or use the build.

    Raised inside the engine's process: the message names the model directory or the option,
    and how to point the adapter at the build. The engine prints it as it is, outside packer's
    CLI, so the message is escaped here (:func:`packer.util.show.show`): a path or option value
    holding control characters reaches the engine's log as visible escapes.
    """

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(show(str(message)), *args)


class WarmStateError(PackerError):
    """An engine's warm state (``OUT/warm/<engine>-<device>/``) cannot be captured, or does not match its pins.

    The message names the file and the reason; at a server's start such a state is refused
    (the engine compiles as usual), in ``packer verify`` and ``packer warm`` it is exit code 1.
    """


# Every class here is in ``packer.__all__`` and is caught as ``packer.<Name>``: tracebacks and reprs
# show that name, and pickling finds the class there too (``packer.__getattr__`` resolves it), so a
# user never meets the module it happens to be defined in (tests/test_errors_pickle.py holds both).
for _cls in [v for v in list(globals().values()) if isinstance(v, type) and issubclass(v, BaseException)]:
    _cls.__module__ = "packer"
del _cls
