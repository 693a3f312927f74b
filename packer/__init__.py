"""packer: build-time packaging that makes GPU inference servers start fast."""

from packer.version import __version__

__all__ = ["__version__"]
