"""Run by the vLLM virtual environment's python (not by pytest): greedy token ids of vLLM.

``python tests/vllm_generate.py MODEL_DIR LOAD_FORMAT TP PROMPTS_JSON [EXTRA_JSON]`` prints one
JSON line ``{"ids": [[...], ...]}`` last on stdout; vLLM's own log (and packer's ``[startup]``
lines) go to stderr. ``PROMPTS_JSON`` is a list of token-id lists.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    model_dir, load_format, tp, prompts = argv[0], argv[1], int(argv[2]), json.loads(argv[3])
    extra = json.loads(argv[4]) if len(argv) > 4 else {}
    from vllm import LLM, SamplingParams

    llm = LLM(model_dir, load_format=load_format, tensor_parallel_size=tp, dtype="float32",
              enforce_eager=True, max_model_len=64, max_num_seqs=4, seed=0,
              model_loader_extra_config=extra)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    print(json.dumps({"ids": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
