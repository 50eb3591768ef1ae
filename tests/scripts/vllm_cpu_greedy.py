"""Greedy token ids from plain vLLM-CPU (no RBLN plugin) for model dirs; JSON on stdout.

Run as a script (vLLM spawns its engine; the __main__ guard is required).
Usage: vllm_cpu_greedy.py MAX_TOKENS PROMPTS_JSON MODEL_DIR [MODEL_DIR ...]
"""

import gc
import json
import sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    max_tokens, prompts = int(sys.argv[1]), json.loads(sys.argv[2])
    result = {}
    for model_dir in sys.argv[3:]:
        llm = LLM(
            model=model_dir,
            dtype="float32",
            max_model_len=512,
            max_num_seqs=8,
            gpu_memory_utilization=0.2,
            enforce_eager=True,
            seed=0,
        )
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        )
        result[model_dir] = [list(o.outputs[0].token_ids) for o in outs]
        del llm
        gc.collect()
    print("RESULT " + json.dumps(result))
