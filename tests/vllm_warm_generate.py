"""Run by the vLLM virtual environment's python (not by pytest): greedy token ids in compile mode.

``python tests/vllm_warm_generate.py MODEL_DIR MAX_MODEL_LEN PROMPTS_JSON [LOAD_FORMAT [SAMPLING_JSON]]``
starts ``LLM`` with the arguments tests/test_vllm_warm.py warms with (``--dtype float32 --max-model-len N
--max-num-seqs 4``, the ``packer`` load format unless another is named, compile mode: no ``enforce_eager``),
sends the prompts in one batch (greedy, 8 tokens; ``SAMPLING_JSON`` adds sampling parameters, e.g.
``{"logprobs": 5}``) and prints one JSON line ``{"ids": [[...], ...], "logprobs": [n, ...]}`` last on
stdout (the log-probabilities per generated token, 0 where none were asked for); vLLM's log and
packer's warm-state line go to stderr.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    from vllm import LLM, SamplingParams

    load_format = argv[3] if len(argv) > 3 else "packer"
    llm = LLM(argv[0], load_format=load_format, dtype="float32", max_model_len=int(argv[1]), max_num_seqs=4)
    more = json.loads(argv[4]) if len(argv) > 4 else {}
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **more}, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(argv[2])], params, use_tqdm=False)
    print(json.dumps({"ids": [list(o.outputs[0].token_ids) for o in outs],
                      "logprobs": [len((o.outputs[0].logprobs or [{}])[0]) for o in outs]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
