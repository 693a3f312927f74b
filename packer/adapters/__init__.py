"""Engine adapters: serving engines that load through a build's emitted loader.

Each adapter imports its engine lazily (inside functions), so packer's plain install never
needs the engine; the engine imports the adapter through its own plugin mechanism.
"""
