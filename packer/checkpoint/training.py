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


# accelerate's save_state writes the first prepared model as model.safetensors (pytorch_model.bin
# unsafe) and the Nth after it as model_N.safetensors: a model of its own, not a variant of the first
_FURTHER = re.compile(r"(model|pytorch_model)_([1-9]\d*)\.(safetensors|bin)")


def further_model(name: str) -> str | None:
    """The note on a further model's file ``name`` (a base name) beside the first, or None.

    ``model_1.safetensors`` is the second model an ``Accelerator`` prepared (a discriminator, a
    teacher, an EMA copy): it is not loaded by ``from_pretrained`` and is no variant of
    ``model.safetensors`` (those are ``model.<variant>.safetensors``), so a build of the folder is the
    first model's, and this says how to build the other.
    """
    m = _FURTHER.fullmatch(name)
    if m is None:
        return None
    return (f"a further model (accelerate's save_state names the models it prepared {m.group(1)}, "
            f"{m.group(1)}_1, {m.group(1)}_2...), not a variant of the first: build it on its own with "
            f"weights.files = [\"{name}\"] (packer convert FOLDER/{name} -o DIR)")
