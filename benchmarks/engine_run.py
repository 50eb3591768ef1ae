"""One engine run in a fresh process (vLLM resolves its platform once per process).

argv[1] is a JSON spec::

    {"backend": "rbln" | "vllm-cpu", "model": DIR, "api": "llm" | "async",
     "num_prompts": N, "input_len": L, "output_len": M, "max_num_seqs": B,
     "max_model_len": S, "concurrency": C (async), "warmup": W,
     "emulator_mode": "compute" | "timing", "timing_shape": PRESET (optional),
     "executor": "uni" (vLLM's in-process worker, default) | "ray" (RBLNRayExecutor on a
     local Ray instance: the worker is an actor, as in a Serve replica),
     "lora_modules": {NAME: DIR} (adapters compiled into MODEL: enable_lora),
     "phases": [{"num_prompts", "output_len", "jitter", "lora_mix": [NAME | null, ...]}]
     ("lora_mix": the adapter of each request in turn, null the base model)}

Prints one ``RESULT {...}`` line: throughput, per-request latencies (async) and, for rbln,
the runner's step counters and the runtime-call log used for host-overhead analysis.
The environment (``RBLN_RAY_DEVICE``, emulator mode) must be set before vLLM is imported.
"""

from __future__ import annotations

import json
import os
import sys
import time

SPEC = json.loads(sys.argv[1]) if __name__ == "__main__" else {}
if SPEC:
    os.environ["RBLN_RAY_NODE_ID"] = f"bench-{os.getpid()}"  # private emulated devices
    if SPEC["backend"] == "rbln":
        os.environ["RBLN_RAY_DEVICE"] = "emulated"
        os.environ["RBLN_RAY_EMULATOR_MODE"] = SPEC.get("emulator_mode", "compute")
        if SPEC.get("timing_shape"):
            os.environ["RBLN_RAY_TIMING_SHAPE"] = SPEC["timing_shape"]
    else:
        os.environ["RBLN_RAY_DEVICE"] = "auto"  # the RBLN plugin stays off: plain vLLM-CPU
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _engine_kwargs(spec: dict) -> dict:
    kwargs = {"model": spec["model"], "seed": 0, "max_num_seqs": spec["max_num_seqs"]}
    if spec["backend"] == "rbln":
        kwargs["worker_extension_cls"] = EXTENSION
        if spec.get("lora_modules"):
            kwargs.update(enable_lora=True, max_lora_rank=16)
        if spec.get("executor", "uni") == "ray":
            kwargs["distributed_executor_backend"] = "rbln_ray.executor.RBLNRayExecutor"
    if spec["backend"] == "vllm-cpu":
        kwargs.update(
            dtype="float32",
            max_model_len=spec["max_model_len"],
            gpu_memory_utilization=0.2,
            enforce_eager=not spec.get("vllm_cpu_compile", False),
            enable_prefix_caching=False,
        )
    return kwargs


EXTENSION = "rbln_ray.emulator.call_log.RuntimeCallsExtension"


def _rbln_stats(rpc, all_ranks: bool = False) -> dict:
    """Rank 0's step counters and call log, and every rank's call totals (pipeline stages);
    with ``all_ranks`` every rank's whole call log too (pipeline timelines)."""
    calls = rpc("emulator_calls")
    totals = [{k: v for k, v in c.items() if k != "calls"} for c in calls]
    stats = {"step_stats": rpc("step_stats")[0], "calls": calls[0], "calls_by_rank": totals}
    if all_ranks:
        stats["call_logs_by_rank"] = [c["calls"] for c in calls]
    return stats


def _params(spec: dict, n: int, output_len: int, jitter: float) -> list:
    """Greedy, ignore_eos; with ``jitter`` > 0 max_tokens is uniform in [out(1-j), out]."""
    import random

    from vllm import SamplingParams

    rng = random.Random(1)
    low = max(1, int(output_len * (1 - jitter)))
    return [
        SamplingParams(
            temperature=0,
            max_tokens=rng.randint(low, output_len) if jitter else output_len,
            ignore_eos=True,
        )
        for _ in range(n)
    ]


def _engine_core_cpu_s() -> float:
    """CPU seconds used so far by vLLM's engine-core process (a child of this one)."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name():
                times = child.cpu_times()
                total += times.user + times.system
        except psutil.Error:
            continue
    return total


def _lora_requests(spec: dict, n: int, mix: list[str | None] | None) -> list | None:
    """Each request's LoRARequest, cycling through ``mix`` (None: the base model)."""
    if not mix:
        return None
    from vllm.lora.request import LoRARequest

    modules = spec["lora_modules"]
    ids = {name: i for i, name in enumerate(modules, start=1)}
    names = [mix[i % len(mix)] for i in range(n)]
    return [LoRARequest(x, ids[x], modules[x]) if x else None for x in names]


def _generate(
    llm,
    spec: dict,
    prompts: list[list[int]],
    output_len: int,
    jitter: float,
    lora_mix: list[str | None] | None = None,
) -> dict:
    rbln = spec["backend"] == "rbln"
    if rbln:
        llm.collective_rpc("emulator_calls_reset")
        before = llm.collective_rpc("step_stats")[0]
    params = _params(spec, len(prompts), output_len, jitter)
    cpu_before = _engine_core_cpu_s()
    start = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        params,
        use_tqdm=True,
        lora_request=_lora_requests(spec, len(prompts), lora_mix),
    )
    elapsed = time.perf_counter() - start
    engine_cpu = _engine_core_cpu_s() - cpu_before
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "elapsed_s": elapsed,
        "requests": len(outs),
        "output_tokens": out_tokens,
        "req_per_s": len(outs) / elapsed,
        "output_tok_per_s": out_tokens / elapsed,
        "total_tok_per_s": (out_tokens + sum(len(p) for p in prompts)) / elapsed,
        "engine_core_cpu_s": engine_cpu,
        "engine_core_cpu_share": engine_cpu / elapsed,
    }
    if rbln:
        stats = _rbln_stats(llm.collective_rpc, spec.get("all_rank_calls", False))
        stats["step_stats_before"] = before
        stats["window"] = [start, start + elapsed]
        result["rbln"] = stats
    return result


def run_llm(spec: dict, prompts: list[list[int]]) -> dict:
    from vllm import LLM

    llm = LLM(**_engine_kwargs(spec))
    warm = prompts[: spec.get("warmup", 2)]
    if warm:
        _generate(llm, spec, warm, spec["output_len"], 0.0)
    phases = spec.get("phases")
    if not phases:
        return _generate(llm, spec, prompts, spec["output_len"], spec.get("jitter", 0.0))
    from benchmarks.common import prompts as make_prompts
    from benchmarks.common import vocab_of

    results = []
    for i, phase in enumerate(phases):
        ps = make_prompts(phase["num_prompts"], spec["input_len"], vocab_of(spec["model"]), i + 1)
        out = _generate(
            llm, spec, ps, phase["output_len"], phase.get("jitter", 0.0), phase.get("lora_mix")
        )
        results.append({"phase": phase, **out})
    return {"phases": results}


async def _run_async(spec: dict, prompts: list[list[int]]) -> dict:
    import asyncio

    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**_engine_kwargs(spec)))
    params = SamplingParams(temperature=0, max_tokens=spec["output_len"], ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> dict:
        sent = time.perf_counter()
        stamps, n = [], 0
        async for out in engine.generate({"prompt_token_ids": prompt}, params, f"r{i}"):
            now = time.perf_counter()
            got = len(out.outputs[0].token_ids)
            if got > n:
                stamps.append(now)
                n = got
        return {"sent": sent, "stamps": stamps, "output_tokens": n}

    for i, p in enumerate(prompts[: spec.get("warmup", 2)]):
        await one(-1 - i, p)
    queue: asyncio.Queue = asyncio.Queue()
    for item in enumerate(prompts):
        queue.put_nowait(item)
    records: list[dict] = []

    async def worker() -> None:
        while not queue.empty():
            i, p = queue.get_nowait()
            records.append(await one(i, p))

    rbln = spec["backend"] == "rbln"
    before = (await engine.collective_rpc("step_stats"))[0] if rbln else None
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(spec["concurrency"])))
    elapsed = time.perf_counter() - start
    after = (await engine.collective_rpc("step_stats"))[0] if rbln else None
    engine.shutdown()
    return {"elapsed_s": elapsed, "records": records, "step_stats": [before, after]}


def main() -> None:
    spec = SPEC
    if spec["backend"] == "rbln":
        from rbln_ray.emulator import ensure_runtime

        ensure_runtime()
        if spec.get("executor", "uni") == "ray":
            from benchmarks.common import start_local_ray

            start_local_ray(num_cpus=4, rbln_devices=8)
    from benchmarks.common import prompts as make_prompts
    from benchmarks.common import vocab_of

    prompts = make_prompts(spec["num_prompts"], spec["input_len"], vocab_of(spec["model"]))
    if spec.get("api", "llm") == "llm":
        result = run_llm(spec, prompts)
    else:
        import asyncio

        from benchmarks.loadgen import aggregate

        raw = asyncio.run(_run_async(spec, prompts))
        result = aggregate(raw["records"], raw["elapsed_s"])
        if raw["step_stats"][0] is not None:  # the engine's counters over the measured phase
            result["step_stats_before"], result["step_stats"] = raw["step_stats"]
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
