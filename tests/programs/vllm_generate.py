"""Run in the vLLM venv: load a model with vLLM's offline LLM class in this one process,
greedy-generate from token ids, print one JSON line {"tokens": [[...], ...]}.

    python tests/programs/vllm_generate.py MODEL LOAD_FORMAT EXTRA_CONFIG_JSON PROMPTS_JSON MAX_TOKENS
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    model, load_format, extra, prompts, max_tokens = sys.argv[1:6]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        load_format=load_format,
        model_loader_extra_config=json.loads(extra),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=4,
        distributed_executor_backend="uni",  # the worker in this process too
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True)
    ids = [{"prompt_token_ids": p} for p in json.loads(prompts)]
    out = llm.generate(ids, params, use_tqdm=False)
    print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in out]}), flush=True)


if __name__ == "__main__":
    main()
