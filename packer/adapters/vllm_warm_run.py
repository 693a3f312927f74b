"""``packer warm``'s vLLM run: one engine start and one request, in the engine's own interpreter.

``python -m packer.adapters.vllm_warm_run MODEL_DIR [ENGINE_ARGS...]`` parses ``ENGINE_ARGS``
with vLLM's own parser (the flags of ``vllm serve``), starts ``LLM`` on ``MODEL_DIR`` with
them, runs one greedy request and prints ``{"ids": [...]}`` last on stdout. ``packer warm``
runs it with empty private cache directories and ``PACKER_WARM_CAPTURE`` set, so the plugin
(:mod:`packer.adapters.vllm_warm`) writes the key of exactly this start.
"""

from __future__ import annotations

import dataclasses
import json
import sys

PROMPT = list(range(2, 18))


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


def main(argv: list[str]) -> int:
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(argv[0], argv[1:]))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    print(json.dumps({"ids": list(out[0].outputs[0].token_ids)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
