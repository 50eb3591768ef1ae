"""Embeddings, scores and classifications from ``vllm.LLM(runner="pooling")`` for one or more
model dirs, one engine after another in this process; JSON on stdout.

The same script gives both sides of the comparison: rbln-ray (``RBLN_RAY_DEVICE=emulated``:
the RBLN platform runs the compiled encoder) and plain vLLM-CPU (``RBLN_RAY_DEVICE=auto`` with
no real runtime: the plugin stays out, vLLM runs its own BERT or RoBERTa in float32).
Usage: vllm_embed.py SPEC_JSON  (``models``, ``texts``, ``query``, ``max_model_len``,
``batch_size``; ``too_long``: token ids that must be refused; ``step_stats``: read them;
``hf_overrides``: per model dir, what vLLM is told about the checkpoint, e.g. a reranker read
from a causal LM). Per model: ``embeddings`` (embedding models), ``probs`` (classifiers),
``scores`` of ``query`` against each text (cosine for an embedding model, a cross-encoder's
relevance for a reranker), ``pair_probs``: a classifier's probabilities of each tokenized
(query, text) pair given as token ids alone (no segment ids), which differ from its scores
when the model reads segment ids.
"""

import gc
import json
import os
import sys


def run(spec: dict, model: str) -> dict:
    from vllm import LLM

    compile_settings = {"batch_size": spec["batch_size"], "max_seq_len": spec["max_model_len"]}
    llm = LLM(
        model=model,
        runner="pooling",
        dtype="float32",
        max_model_len=spec["max_model_len"],
        kv_cache_memory_bytes=1 << 26,
        enforce_eager=True,
        additional_config={"rbln_compile": compile_settings},  # plain vLLM ignores it
        hf_overrides=spec.get("hf_overrides", {}).get(model),
    )
    tasks = list(llm.llm_engine.get_supported_tasks())
    texts = spec["texts"]
    out: dict = {"tasks": tasks, "embeddings": None, "probs": None}
    if "embed" in tasks:
        embeds = llm.embed(texts)
        out["embeddings"] = [o.outputs.embedding for o in embeds]
        out["prompt_lens"] = [len(o.prompt_token_ids) for o in embeds]
    if "classify" in tasks:
        classified = llm.classify(texts)
        out["probs"] = [o.outputs.probs for o in classified]
        out["prompt_lens"] = [len(o.prompt_token_ids) for o in classified]
    out["scores"] = [o.outputs.score for o in llm.score(spec["query"], texts)]
    out["pair_probs"] = None
    if "classify" in tasks:
        tokenizer = llm.get_tokenizer()
        pairs = [{"prompt_token_ids": tokenizer(spec["query"], t)["input_ids"]} for t in texts]
        out["pair_probs"] = [o.outputs.probs for o in llm.classify(pairs)]
    out["refused"] = None
    if spec.get("too_long"):
        try:
            task = "embed" if "embed" in tasks else "classify"
            llm.encode([{"prompt_token_ids": spec["too_long"]}], pooling_task=task)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which checks it
            out["refused"] = f"{type(exc).__name__}: {exc}"
    out["step_stats"] = llm.collective_rpc("step_stats") if spec.get("step_stats") else []
    llm.llm_engine.engine_core.shutdown()  # frees the device before the next model's engine
    del llm
    gc.collect()
    return out


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    spec = json.loads(sys.argv[1])
    print("RESULT " + json.dumps({m: run(spec, m) for m in spec["models"]}))
