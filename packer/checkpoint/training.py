"""Training state by its file name: what Trainer, accelerate and Lightning save beside the model.

A training run's checkpoint folder holds the model and the state to resume it: optimizer moments,
the learning-rate schedule, random-number generator states, the run's arguments. None of it is
model weights, and offering it as such (a key to choose, a flag to allow) leads a release
engineer into building AdamW moments or RNG bytes. These names are recognised before a file is
opened: a build leaves them out with a note that calls them training state, and ``convert`` or
``inspect`` of one answers in one line what it is.
"""

from __future__ import annotations

import re

# (file-name pattern, what it holds); names as transformers' Trainer, accelerate's save_state and
# DeepSpeed/Lightning loops write them
_KINDS: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), what) for p, what in (
    (r"optimizer(_\d+)?\.(pt|bin|pth)", "optimizer state (the optimizer's moments and step counts)"),
    (r"scheduler(_\d+)?\.(pt|bin|pth)", "learning-rate scheduler state"),
    (r"(rng_state(_\d+)?\.pth|random_states_\d+\.pkl)", "random-number generator state"),
    (r"scaler(_\d+)?\.(pt|bin|pth)", "mixed-precision gradient scaler state"),
    (r"sampler(_\d+)?\.(bin|pt)", "data sampler state"),
    (r"training_args\.bin", "the run's arguments (a pickled TrainingArguments object)"),
    (r"trainer_state\.json", "the trainer's progress log (steps, metrics)"),
))


def training_state(name: str) -> str | None:
    """What the training-state file ``name`` (a base name) holds, or None for any other name."""
    return next((what for rx, what in _KINDS if rx.fullmatch(name)), None)


def refusal(path: str, name: str) -> str | None:
    """The one-line answer to converting or inspecting a training-state file, or None."""
    what = training_state(name)
    if what is None:
        return None
    return (f"{path}: {what}: training state, which holds no model weights and builds nothing (the "
            "model's weights lie beside it: model.safetensors or pytorch_model.bin)")
