"""packer: build-time packaging that makes GPU inference servers start fast."""

__version__ = "0.1.0"
