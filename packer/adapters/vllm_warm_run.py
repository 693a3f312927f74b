"""``packer warm``'s vLLM run: one engine start and its request mix, in the engine's own interpreter.

``python -m packer.adapters.vllm_warm_run MODEL_DIR [ENGINE_ARGS...]`` parses ``ENGINE_ARGS``
with vLLM's own parser (the flags of ``vllm serve``), starts ``LLM`` on ``MODEL_DIR`` with
them, sends the request mix (``PACKER_WARM_REQUESTS``, JSON; default
:data:`packer.warm.requests.DEFAULT_REQUESTS`) one request after the other, and prints
``{"ids": [...], "requests": N}`` last on stdout (the first request's token ids). ``packer warm``
runs it with empty private cache directories and ``PACKER_WARM_CAPTURE`` set, so the plugin
(:mod:`packer.adapters.vllm_warm`) writes the key of exactly this start.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

from packer.runtime.reading import loads_json
from packer.warm.requests import DEFAULT_REQUESTS, ENGINE_MISSING, REQUESTS_ENV, check_requests

_PARAMS_ASIDE = ("prompt_tokens",)


def engine_kwargs(model_dir: str, argv: list[str]) -> dict[str, object]:
    """``LLM`` keyword arguments from vLLM's command-line flags (only those not at their defaults)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="packer warm -- "))
    ns = parser.parse_args(["--model", model_dir, *argv])
    args = EngineArgs.from_cli_args(ns)
    defaults = EngineArgs(model=model_dir)
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)
            if f.name == "model" or getattr(args, f.name) != getattr(defaults, f.name)}


def mix() -> tuple[dict[str, Any], ...]:
    """The request mix ``packer warm`` passed (checked again here), or the default one."""
    raw = os.environ.get(REQUESTS_ENV)
    if not raw:
        return DEFAULT_REQUESTS
    return check_requests(loads_json(raw, REQUESTS_ENV, top=list), where=REQUESTS_ENV, error=ValueError)


def prompt(length: int, vocab: int) -> list[int]:
    """A synthetic prompt of ``length`` token ids, all inside the vocabulary and away from its first ids."""
    span = max(vocab - 3, 1)
    return [3 + (i * 7) % span for i in range(length)]


def main(argv: list[str]) -> int:
    try:
        from vllm import LLM, SamplingParams
    except ModuleNotFoundError as e:
        if e.name != "vllm":  # one of vLLM's own imports: its traceback says which
            raise
        print(f"{sys.executable} cannot import vllm: {e}", file=sys.stderr)
        return ENGINE_MISSING

    llm = LLM(**engine_kwargs(argv[0], argv[1:]))
    model = llm.llm_engine.model_config
    first: list[int] | None = None
    requests = mix()
    for spec in requests:
        params = {k: v for k, v in spec.items() if k not in _PARAMS_ASIDE}
        params.setdefault("max_tokens", 4)
        params.setdefault("temperature", 0.0)
        # the prompt and the answer fit the model's length (a long prompt is as long as it may be)
        room = max(model.max_model_len - params["max_tokens"], 1)
        ids = prompt(min(spec.get("prompt_tokens", 16), room), model.get_vocab_size())
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(**params, ignore_eos=True), use_tqdm=False)
        first = first if first is not None else list(out[0].outputs[0].token_ids)
    print(json.dumps({"ids": first, "requests": len(requests)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
