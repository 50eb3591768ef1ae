"""One plugin's engine run for ``benchmarks/peer_vllm_rbln.py``, in a fresh process.

Runs under either interpreter: the project venv (rbln-ray's ``rbln`` plugin) or the vllm-rbln
side env (Rebellions' ``rbln`` plugin); both see the same emulator. ``vllm.LLM`` with each
plugin's defaults on a compiled directory; greedy, ``ignore_eos``; a warm-up on prompts that
share nothing with the measured ones (so prefix caching only helps where a workload shares).

argv[1]: a JSON spec ``{"model": DIR, "warmup": [[ids]], "workloads": {name: {"prompts":
[[ids]], "output_len": M}}, "llm_kwargs": {...}}`` (``llm_kwargs``, optional: more ``vllm.LLM``
arguments, e.g. rbln-ray's ``speculative_config``). The environment (``RBLN_RAY_DEVICE``,
``RBLN_RAY_EMULATOR_MODE``, ``OMP_NUM_THREADS``) is set by the caller. Prints one ``RESULT
{...}`` line: per workload, wall time and output tok/s, a digest of the output token ids
(greedy: equal digests, equal tokens), plus the emulator's device-call log summary for that
window (device seconds, number of on-device KV copies = prefix-cache hits served by copying).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

EXTENSION = "rbln_ray.emulator.call_log.RuntimeCallsExtension"


def _window(llm) -> dict:
    calls = llm.collective_rpc("emulator_calls")[0]["calls"]
    return {
        "device_s": sum(c["end"] - c["start"] for c in calls if c["kind"] != "copy"),
        "kv_copies": sum(1 for c in calls if c["kind"] == "copy"),
        "prefill_calls": sum(1 for c in calls if c["kind"] == "prefill"),
        "decode_calls": sum(1 for c in calls if c["kind"] == "decode"),
        "verify_calls": sum(1 for c in calls if c["kind"] == "verify"),
    }


def _generate(llm, prompts: list[list[int]], output_len: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.collective_rpc("emulator_calls_reset")
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ids = [list(o.outputs[0].token_ids) for o in outs]
    tokens = sum(len(t) for t in ids)
    return {
        "elapsed_s": elapsed,
        "requests": len(outs),
        "output_tokens": tokens,
        "output_tok_per_s": tokens / elapsed,
        "tokens_digest": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16],
        **_window(llm),
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM
    from vllm.platforms import current_platform

    kwargs = spec.get("llm_kwargs") or {}
    llm = LLM(model=spec["model"], seed=0, worker_extension_cls=EXTENSION, **kwargs)
    _generate(llm, spec["warmup"], 8)
    result = {
        "platform": f"{type(current_platform).__module__}.{type(current_platform).__name__}",
        # the worker's own torch threads; device calls use RBLN_RAY_EMULATOR_THREADS if set
        "host_torch_threads": llm.collective_rpc("emulator_calls")[0]["torch_threads"],
        "device_threads": os.environ.get("RBLN_RAY_EMULATOR_THREADS"),
        "config": {
            "max_num_seqs": llm.llm_engine.vllm_config.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": (
                llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
            ),
            "enable_prefix_caching": llm.llm_engine.vllm_config.cache_config.enable_prefix_caching,
            "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
        },
        "workloads": {
            name: _generate(llm, w["prompts"], w["output_len"])
            for name, w in spec["workloads"].items()
        },
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
