"""Greedy token ids from plain vLLM-CPU (no RBLN plugin) for model dirs; JSON on stdout.

Run as a script (vLLM spawns its engine; the __main__ guard is required).
Usage: vllm_cpu_greedy.py MAX_TOKENS PROMPTS_JSON MODEL_DIR [MODEL_DIR ...]
"""

import gc
import json
import os
import sys

if __name__ == "__main__":
    # The engine core in this process: one engine per model, one after another, without
    # spawning (and importing vLLM in) two processes per model; a fixed KV budget instead of
    # profiling host memory that other tests' processes share.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    max_tokens, prompts = int(sys.argv[1]), json.loads(sys.argv[2])
    result = {}
    for model_dir in sys.argv[3:]:
        llm = LLM(
            model=model_dir,
            dtype="float32",
            max_model_len=512,
            max_num_seqs=8,
            kv_cache_memory_bytes=1 << 27,  # 128 MiB: ample for 8 x 512 tokens
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
        # The next engine sets up its own parallel groups (an MoE model's include expert
        # parallelism, which a dense model's do not).
        cleanup_dist_env_and_memory()
    print("RESULT " + json.dumps(result))
