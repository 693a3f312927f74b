"""Which name of a tied group is kept: the transformers convention, names and config.json.

transformers ties the output head to the input embedding: the embedding is the tie's
source and is loaded, the head is its target and is filled in by ``tie_weights()``. So the
kept name must be the input embedding wherever it sits in the module tree
(``model.decoder.embed_tokens`` in OPT, ``shared`` in T5 and BART), and an output head is
recognised by its own module name (``lm_head``, ``proj_out``, ``embed_out``, ``output``,
``…predictions.decoder``), never because a path component happens to read ``decoder``.

When the source directory holds a ``config.json`` saying ``tie_word_embeddings: false``,
the head is a tensor of its own to transformers: it is written under its own name even when
the checkpoint shares its storage with the embedding.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from packer.errors import WeightsError
from packer.reading import Kind, read_json

# module names (the component before weight/bias) of input embeddings
_INPUT_MODULES = frozenset({"embed_tokens", "wte", "word_embeddings", "tok_embeddings", "embed_in",
                            "shared", "embeddings", "embedding", "word_embedding", "token_embedding"})
# module paths that end in an output head
_HEAD = re.compile(r"(^|\.)(lm_head|proj_out|embed_out|output|output_layer|lm_logits|generator_lm_head|"
                   r"predictions\.decoder|lm_head\.decoder|cls\.decoder)$")
MAX_CONFIG_BYTES = 16 * 2**20
_CONFIG = Kind("model config", MAX_CONFIG_BYTES, 64)


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def is_input_embedding(name: str) -> bool:
    """True when the tensor's own module is an input embedding (any depth)."""
    return _module(name).rsplit(".", 1)[-1] in _INPUT_MODULES


def is_output_head(name: str) -> bool:
    """True when the tensor's module path ends in an output head's name."""
    return bool(_HEAD.search(_module(name)))


def rank(name: str, prefer: Sequence[str]) -> tuple[int, int, int, str]:
    """Sort key of a tied name: ``prefer`` patterns, then input embeddings (the tie's source;
    shallower first, so ``shared`` wins over ``encoder.embed_tokens``), then other names,
    then output heads (the tie's target)."""
    for i, pattern in enumerate(prefer):
        if name == pattern or fnmatch.fnmatchcase(name, pattern):
            return (0, i, 0, name)
    if is_input_embedding(name):
        return (1, 0, name.count("."), name)
    return (3, 0, 0, name) if is_output_head(name) else (2, 0, 0, name)


@dataclass(frozen=True)
class TieConfig:
    """What the model's ``config.json`` says about tied weights."""

    tie_word_embeddings: bool = True  # transformers' default
    source: Path | None = None


def read_tie_config(directory: Path | None, *, strict: bool = True) -> TieConfig:
    """Read ``tie_word_embeddings`` from ``directory/config.json`` (top level or ``text_config``).

    A missing file gives the transformers default (tied); so does an unreadable one when not
    ``strict``.

    Raises:
        WeightsError: ``strict`` and the file is too large or not a JSON object.
    """
    if directory is None or not (directory / "config.json").is_file():
        return TieConfig()
    path = directory / "config.json"
    try:
        data = read_json(path, _CONFIG, error=WeightsError, where=f"{path}: cannot read the model config")
        if not isinstance(data, dict):
            raise WeightsError(f"{path}: cannot read the model config: not a JSON object")
    except WeightsError:
        if not strict:
            return TieConfig()
        raise
    value = data.get("tie_word_embeddings")
    text = data.get("text_config")
    if value is None and isinstance(text, dict):
        value = text.get("tie_word_embeddings")
    return TieConfig(value is not False, path)


def split_group(names: Sequence[str], prefer: Sequence[str], ties: TieConfig) -> tuple[str, list[str]]:
    """The kept name of an exact-alias group and the names written as tensors of their own.

    With ``tie_word_embeddings: false`` an output head beside an input embedding is not an
    alias to transformers: it is kept too (the bytes are written twice).
    """
    keep = min(names, key=lambda n: rank(n, prefer))
    own: list[str] = []
    if not ties.tie_word_embeddings and is_input_embedding(keep):
        own = [n for n in names if n != keep and is_output_head(n)]
    return keep, own
