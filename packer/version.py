"""packer's version, in one place: the package's ``__version__``, the manifest and ``packer --version``."""

__version__ = "0.1.0"
