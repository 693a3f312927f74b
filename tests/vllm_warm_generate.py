"""Run by the vLLM virtual environment's python (not by pytest): greedy token ids in compile mode.

``python tests/vllm_warm_generate.py MODEL_DIR MAX_MODEL_LEN PROMPTS_JSON [LOAD_FORMAT]`` starts ``LLM``
with the arguments tests/test_vllm_warm.py warms with (``--dtype float32 --max-model-len N --max-num-seqs
4``, the ``packer`` load format unless another is named, compile mode: no ``enforce_eager``) and prints one JSON line
``{"ids": [[...], ...]}`` last on stdout; vLLM's log and packer's warm-state line go to stderr.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    from vllm import LLM, SamplingParams

    load_format = argv[3] if len(argv) > 3 else "packer"
    llm = LLM(argv[0], load_format=load_format, dtype="float32", max_model_len=int(argv[1]), max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(argv[2])], params, use_tqdm=False)
    print(json.dumps({"ids": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
