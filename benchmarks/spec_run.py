"""One speculative-decoding benchmark engine in a fresh process (vLLM resolves its platform
once per process).

argv[1] is a JSON spec::

    {"model": DIR, "max_num_seqs": B, "speculative_config": {...} | null,
     "policy": "auto" | "always", "prompts": [[ids]], "output_len": M,
     "warmup": [[ids]], "mode": "modelled" | "timing" | "compute", "shape": PRESET}

Prints one ``RESULT {...}`` line: output tok/s of the timed ``generate`` (after a warm-up
one), the output token ids, vLLM's spec-decode counters over the timed run, the runner's
step counters over the timed run and the emulator's call-log totals (modelled-mode overruns).
"""

from __future__ import annotations

import json
import os
import sys
import time

SPEC = json.loads(sys.argv[1]) if __name__ == "__main__" else {}
if SPEC:
    os.environ["RBLN_RAY_NODE_ID"] = f"spec-bench-{os.getpid()}"  # private emulated devices
    os.environ["RBLN_RAY_DEVICE"] = "emulated"
    os.environ["RBLN_RAY_EMULATOR_MODE"] = SPEC.get("mode", "modelled")
    if SPEC.get("shape"):
        os.environ["RBLN_RAY_TIMING_SHAPE"] = SPEC["shape"]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


def spec_counters(llm) -> dict:
    out: dict = {name: 0 for name in COUNTERS}
    out["per_position"] = []
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[m.name] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            old = out["per_position"] or [0] * len(m.values)
            out["per_position"] = [a + b for a, b in zip(old, m.values, strict=False)]
    return out


def main() -> None:
    from vllm import LLM, SamplingParams

    kwargs = {
        "model": SPEC["model"],
        "seed": 0,
        "max_num_seqs": SPEC["max_num_seqs"],
        "disable_log_stats": False,
        "worker_extension_cls": "rbln_ray.emulator.call_log.RuntimeCallsExtension",
    }
    if SPEC.get("speculative_config"):
        kwargs["speculative_config"] = SPEC["speculative_config"]
        kwargs["additional_config"] = {"rbln_spec_policy": SPEC.get("policy", "auto")}
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0, max_tokens=SPEC["output_len"], ignore_eos=True)
    warm = [{"prompt_token_ids": p} for p in SPEC.get("warmup", [])]
    if warm:
        llm.generate(warm, params, use_tqdm=False)
    before = spec_counters(llm)
    stats_before = llm.collective_rpc("step_stats")[0]
    llm.collective_rpc("emulator_calls_reset")
    prompts = [{"prompt_token_ids": p} for p in SPEC["prompts"]]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    after = spec_counters(llm)
    calls = llm.collective_rpc("emulator_calls")[0]
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    n_out = sum(len(t) for t in tokens)
    spec = {k: after[k] - before[k] for k in COUNTERS}
    spec["per_position"] = [
        a - b
        for a, b in zip(after["per_position"], before["per_position"] or [0] * 99, strict=False)
    ]
    stats = llm.collective_rpc("step_stats")[0]
    stats.pop("history", None)
    stats = {  # the timed run's (the warm-up's steps taken out)
        k: v - stats_before.get(k, 0) if isinstance(v, int | float) else v for k, v in stats.items()
    }
    kinds: dict[str, int] = {}
    for c in calls["calls"]:
        kinds[c["kind"]] = kinds.get(c["kind"], 0) + 1
    result = {
        "wall_s": wall,
        "output_tokens": n_out,
        "output_tok_s": n_out / wall,
        "tokens": tokens,
        "spec": spec,
        "step_stats": stats,
        "calls": {
            "mode": calls["mode"],
            "total_calls": calls["total_calls"],
            "total_seconds": calls["total_seconds"],
            "total_modelled_seconds": calls["total_modelled_seconds"],
            "overrun_calls": calls["overrun_calls"],
            "overrun_seconds": calls["overrun_seconds"],
            "by_kind": kinds,
        },
    }
    llm.llm_engine.engine_core.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
