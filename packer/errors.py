"""The one error hierarchy of packer.

Every message is one line that says what was wrong, where (file, key path, tensor or
member name) and, where there is one, what to do about it. The CLI turns any
:class:`PackerError` into exit code 1; nothing else in the library prints or exits.
"""

from __future__ import annotations


class PackerError(Exception):
    """Base class: a failed build, bad input or a mismatch (exit code 1)."""

    def with_context(self, context: str) -> PackerError:
        """Return a copy of this error whose message is prefixed with ``context: ``."""
        new = type(self).__new__(type(self))
        Exception.__init__(new, f"{context}: {self}")
        new.__cause__ = self.__cause__ or self
        return new


class RecipeError(PackerError):
    """The recipe is unreadable or invalid; the message names the key path or line."""


class SourceError(PackerError):
    """The model source cannot be resolved or read."""


class CheckpointError(PackerError):
    """A checkpoint is malformed, unsupported or holds something not allowed."""


class UnsafeInputError(CheckpointError):
    """An input asks for code to run (a pickle global outside the allowlist, TorchScript...)."""


class WeightsError(PackerError):
    """Planning or writing safetensors output failed."""


class BundleError(PackerError):
    """Building, reading or extracting the tokenizer/config bundle failed."""


class ImageError(PackerError):
    """Building, reading or pushing the OCI image failed."""


class VerifyError(PackerError):
    """An artifact does not match its manifest; the message names the first mismatch."""


class ArtifactMismatchError(VerifyError):
    """The image's files differ from the artifact manifest it was given to compare with."""


class LoaderError(PackerError):
    """The runtime loader found artifacts that do not match its embedded manifest."""


class StubError(PackerError):
    """The loader template or the bundle reader cannot be embedded into ``packer_loader.py``."""
