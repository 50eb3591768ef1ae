"""Embeddings and scores from ``vllm.LLM(runner="pooling")`` for one model dir; JSON on stdout.

The same script gives both sides of the comparison: rbln-ray (``RBLN_RAY_DEVICE=emulated``:
the RBLN platform runs the compiled encoder) and plain vLLM-CPU (``RBLN_RAY_DEVICE=auto`` with
no real runtime: the plugin stays out, vLLM runs its own BERT in float32).
Usage: vllm_embed.py SPEC_JSON  (``model``, ``texts``, ``query``, ``max_model_len``,
``batch_size``; ``too_long``: token ids that must be refused; ``step_stats``: read them)
"""

import json
import os
import sys

if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    spec = json.loads(sys.argv[1])
    compile_settings = {"batch_size": spec["batch_size"], "max_seq_len": spec["max_model_len"]}
    llm = LLM(
        model=spec["model"],
        runner="pooling",
        dtype="float32",
        max_model_len=spec["max_model_len"],
        kv_cache_memory_bytes=1 << 26,
        enforce_eager=True,
        additional_config={"rbln_compile": compile_settings},  # plain vLLM ignores it
    )
    embeds = llm.embed(spec["texts"])
    scores = llm.score(spec["query"], spec["texts"])
    refused = None
    if spec.get("too_long"):
        try:
            llm.embed([{"prompt_token_ids": spec["too_long"]}])
        except Exception as exc:  # noqa: BLE001 - reported to the test, which checks it
            refused = f"{type(exc).__name__}: {exc}"
    rpc = llm.collective_rpc("step_stats") if spec.get("step_stats") else []
    print(
        "RESULT "
        + json.dumps(
            {
                "embeddings": [o.outputs.embedding for o in embeds],
                "prompt_lens": [len(o.prompt_token_ids) for o in embeds],
                "scores": [o.outputs.score for o in scores],
                "tasks": list(llm.llm_engine.get_supported_tasks()),
                "step_stats": rpc,
                "refused": refused,
            }
        )
    )
