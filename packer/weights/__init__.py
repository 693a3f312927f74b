"""Planning (names, aliases, shards) and the streaming safetensors writer.

The stage entry point is :func:`packer.weights.convert.convert`; ``packer verify`` uses
:func:`packer.weights.verify.verify_weights`. Importing this package imports no torch.
"""
