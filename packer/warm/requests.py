"""The requests ``packer warm`` sends the engine: the request paths a server will take.

An engine compiles some kernels only when a request first takes their path: vLLM 0.32's
``batched_count_greater_than`` (a ``@torch.compile``) at the first request that asks for
logprobs, the random sampler at the first one with a temperature, the penalties, a long
prompt's batch shape. What the warm run does not take, a hit start compiles at the first user
request. So the warm run sends a mix (:data:`DEFAULT_REQUESTS`, or the recipe's
``warm.requests``), one request after the other, each a table of:

===================== ==================================================================
``prompt_tokens``     prompt length in tokens (synthetic ids; capped to what ``max_model_len`` leaves)
``max_tokens``        tokens to generate (``ignore_eos``: always that many)
``n``                 sequences per request
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``   sampling
``logprobs``, ``prompt_logprobs``                            how many log-probabilities per token
``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``   penalties
===================== ==================================================================

Order matters: torch.compile traces a function's first call with its exact shapes and only a
second, different shape with a dynamic batch size. A fresh process's first logprobs request
is usually one sequence, so the default mix asks for logprobs first with ``n = 1`` (the graph
a hit's first logprobs request looks up), then with ``n = 2`` (the dynamic graph every later
batch size uses).

The mix is recorded in the state's key (``requests``) but never compared: every compiled
artifact in a cache is keyed by its compiler on what it was compiled for, so a state warmed
with another mix is as correct as this one, only covers other paths; a server says nothing at
start about the requests it will get, so there is nothing to compare it with.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from packer.errors import UsageError
from packer.reading import Kind, parse_json, read_bytes

# the exit status of ``packer warm``'s probe and runner when their interpreter cannot import vllm
# itself (not one of vLLM's own imports): told apart by status, not by the error's text
ENGINE_MISSING = 3

# each key, what its value must be (in words) and the check
_INT_MIN: dict[str, int] = {"prompt_tokens": 1, "max_tokens": 1, "n": 1, "logprobs": 0, "prompt_logprobs": 0,
                            "seed": 0, "top_k": -1}
_FLOAT_RANGE: dict[str, tuple[float, float, bool]] = {  # (low, high, low included)
    "temperature": (0.0, 100.0, True), "top_p": (0.0, 1.0, False), "min_p": (0.0, 1.0, True),
    "repetition_penalty": (0.0, 100.0, False), "presence_penalty": (-2.0, 2.0, True),
    "frequency_penalty": (-2.0, 2.0, True)}
KEYS = (*_INT_MIN, *_FLOAT_RANGE)
MAX_REQUESTS = 64
MAX_PROMPT_TOKENS = 1 << 20
REQUESTS_FILE = Kind("request mix", 1 << 20, 8)

REQUESTS_ENV = "PACKER_WARM_REQUESTS"  # the mix, as JSON, from packer warm to the engine's run

DEFAULT_REQUESTS: tuple[dict[str, Any], ...] = (
    {"prompt_tokens": 16, "max_tokens": 4, "logprobs": 5},  # first: a server's first logprobs request
    {"prompt_tokens": 16, "max_tokens": 4},  # greedy
    {"prompt_tokens": 16, "max_tokens": 4, "temperature": 0.8, "top_p": 0.95, "top_k": 40, "seed": 0},
    {"prompt_tokens": 16, "max_tokens": 4, "n": 2, "temperature": 1.0, "logprobs": 1, "seed": 0},
    {"prompt_tokens": 16, "max_tokens": 4, "repetition_penalty": 1.2, "presence_penalty": 0.5,
     "frequency_penalty": 0.5},
    {"prompt_tokens": 4, "max_tokens": 4, "prompt_logprobs": 1},  # a short prompt, echoed with logprobs
    {"prompt_tokens": 4096, "max_tokens": 4},  # a long prompt (capped to the model length)
)


def check_requests(value: Any, *, where: str, error: Callable[[str], Exception]) -> tuple[dict[str, Any], ...]:
    """``value`` as a request mix: a non-empty list of tables of :data:`KEYS` (see the module docstring).

    Args:
        where: the key path of ``value`` (``warm.requests``), named in every error.
        error: the exception type to raise.

    Returns:
        the mix, each table a new dict (numbers as given, integers where integers are expected).

    Raises:
        error: ``warm.requests[2].top_p: expected a number in (0, 1], got 1.5`` and the like.
    """
    if not isinstance(value, list | tuple) or not value:
        raise error(f"{where}: expected a non-empty list of request tables (keys: {', '.join(KEYS)}), "
                    f"got {_got(value)}")
    if len(value) > MAX_REQUESTS:
        raise error(f"{where}: {len(value)} requests; at most {MAX_REQUESTS} (each one is a request at warm time)")
    return tuple(_one(f"{where}[{i}]", item, error) for i, item in enumerate(value))


def load_requests(path: Path) -> tuple[dict[str, Any], ...]:
    """The request mix in the JSON file ``path`` (``packer warm --requests``): a list of request tables.

    Raises:
        UsageError: unreadable, not JSON, or not a mix (the message names the file and the place).
    """
    raw = read_bytes(path, REQUESTS_FILE, error=UsageError, what="the request mix")
    return check_requests(parse_json(raw, REQUESTS_FILE, where=str(path), error=UsageError),
                          where=f"--requests {path}", error=UsageError)


def _one(where: str, item: Any, error: Callable[[str], Exception]) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise error(f"{where}: expected a table (keys: {', '.join(KEYS)}), got {_got(item)}")
    out: dict[str, Any] = {}
    for key, v in item.items():
        path = f"{where}.{key}"
        if key in _INT_MIN:
            top = MAX_PROMPT_TOKENS if key == "prompt_tokens" else 1 << 31
            if isinstance(v, bool) or not isinstance(v, int) or not _INT_MIN[key] <= v <= top:
                raise error(f"{path}: expected an integer from {_INT_MIN[key]} to {top}, got {_got(v)}")
            if key == "top_k" and v == 0:
                raise error(f"{path}: expected -1 (off) or a positive integer, got 0")
        elif key in _FLOAT_RANGE:
            low, high, closed = _FLOAT_RANGE[key]
            ok = (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                  and (low <= v if closed else low < v) and v <= high)
            if not ok:
                raise error(f"{path}: expected a number in {'[' if closed else '('}{low:g}, {high:g}], got {_got(v)}")
        else:
            raise error(f"{path}: unknown key (allowed: {', '.join(sorted(KEYS))})")
        out[key] = v
    return out


def _got(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:39] + '…'}"
