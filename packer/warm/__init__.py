"""The warm state: an engine's start-up state, captured once and shipped beside the build (``packer warm``).

Not the warm pool (``warm_context``, :mod:`packer.runtime.pool`: pre-imported worker processes)
nor warm-up with real shapes (``warmup``, :mod:`packer.runtime.graphs`).

:mod:`packer.warm.key` says what the state depends on and names the first part that differs;
:mod:`packer.warm.pins` pins every file of it (``OUT/warm/<name>/manifest.json``) and makes the
checked copy a server starts from; :mod:`packer.warm.capture` runs the engine once to make it.
The engine's own side (vLLM's plugin, which predicts hit or miss in every start) is
:mod:`packer.adapters.vllm_warm`.
"""
