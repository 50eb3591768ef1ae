"""One AsyncLLM run of a prefix-cache or long-prompt workload, in a fresh process.

argv[1] is a JSON spec::

    {"model": DIR, "emulator_mode": "compute" | "timing", "timing_shape": PRESET,
     "enable_prefix_caching": bool, "enable_chunked_prefill": bool,
     "decode_steps_between_chunks": N (optional),
     "workload": {"kind": "shared_prefix", "system_len": 1024, "user_len": 64,
                  "num_requests": 32, "output_len": 64, "concurrency": 4}
               | {"kind": "long_prompt", "short_len": 64, "short_output_len": 128,
                  "num_short": 16, "short_concurrency": 3, "long_len": 2048,
                  "long_output_len": 8, "num_long": 4, "long_every_s": 4.0}}

``shared_prefix``: every request is one system prompt plus its own user turn, sent by
``concurrency`` closed-loop workers. ``long_prompt``: short requests keep the batch decoding
while long prompts arrive every ``long_every_s`` seconds (an arrival schedule, not a
synchronisation). Prints one ``RESULT {...}`` line: latency summaries (``vllm bench serve``
definitions, :func:`benchmarks.loadgen.aggregate`) and the runner's step counters.
"""

from __future__ import annotations

import json
import os
import sys
import time

SPEC = json.loads(sys.argv[1]) if __name__ == "__main__" else {}
if SPEC:
    os.environ["RBLN_RAY_NODE_ID"] = f"bench-{os.getpid()}"  # private emulated devices
    os.environ["RBLN_RAY_DEVICE"] = "emulated"
    os.environ["RBLN_RAY_EMULATOR_MODE"] = SPEC.get("emulator_mode", "compute")
    if SPEC.get("timing_shape"):
        os.environ["RBLN_RAY_TIMING_SHAPE"] = SPEC["timing_shape"]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _engine(spec: dict):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from rbln_ray.vllm_plugin.options import PREFIX

    extra = {}
    if spec.get("decode_steps_between_chunks") is not None:
        extra[PREFIX + "decode_steps_between_chunks"] = spec["decode_steps_between_chunks"]
    args = AsyncEngineArgs(
        model=spec["model"],
        seed=0,
        enable_prefix_caching=spec["enable_prefix_caching"],
        enable_chunked_prefill=spec["enable_chunked_prefill"],
        additional_config=extra,
    )
    return AsyncLLM.from_engine_args(args)


async def _run(spec: dict) -> dict:
    import asyncio
    import random

    from vllm import SamplingParams

    from benchmarks.common import vocab_of
    from benchmarks.loadgen import aggregate

    engine = _engine(spec)
    work = spec["workload"]
    vocab = vocab_of(spec["model"])
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab - 10) for _ in range(n)]

    async def one(req_id: str, prompt: list[int], output_len: int) -> dict:
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        sent = time.perf_counter()
        stamps, n = [], 0
        async for out in engine.generate({"prompt_token_ids": prompt}, params, req_id):
            got = len(out.outputs[0].token_ids)
            if got > n:
                stamps.extend([time.perf_counter()] * (got - n))
                n = got
        return {"sent": sent, "stamps": stamps, "output_tokens": n}

    async def closed_loop(name: str, prompts: list[list[int]], out: int, workers: int) -> list:
        queue = list(enumerate(prompts))
        records: list[dict] = []

        async def worker() -> None:
            while queue:
                i, prompt = queue.pop(0)
                records.append(await one(f"{name}{i}", prompt, out))

        await asyncio.gather(*(worker() for _ in range(workers)))
        return records

    await one("warmup", tokens(16), 4)
    before = (await engine.collective_rpc("step_stats"))[0]
    start = time.perf_counter()
    if work["kind"] == "shared_prefix":
        system = tokens(work["system_len"])
        prompts = [system + tokens(work["user_len"]) for _ in range(work["num_requests"])]
        records = await closed_loop("r", prompts, work["output_len"], work["concurrency"])
        result = {"all": aggregate(records, time.perf_counter() - start)}
    else:
        shorts = [tokens(work["short_len"]) for _ in range(work["num_short"])]
        longs = [tokens(work["long_len"]) for _ in range(work["num_long"])]

        async def long_arrivals() -> list[dict]:
            tasks = []
            for i, prompt in enumerate(longs):
                due = start + (i + 1) * work["long_every_s"]
                await asyncio.sleep(max(0.0, due - time.perf_counter()))  # arrival schedule
                tasks.append(asyncio.create_task(one(f"long{i}", prompt, work["long_output_len"])))
            return list(await asyncio.gather(*tasks))

        short_task = closed_loop(
            "short", shorts, work["short_output_len"], work["short_concurrency"]
        )
        short_records, long_records = await asyncio.gather(short_task, long_arrivals())
        elapsed = time.perf_counter() - start
        result = {
            "short": aggregate(short_records, elapsed),
            "long": aggregate(long_records, elapsed),
        }
    after = (await engine.collective_rpc("step_stats"))[0]
    engine.shutdown()
    keys = ("prefill_steps", "prefill_tokens", "prefix_reused_tokens", "kv_copies", "decode_steps")
    result["steps"] = {k: after[k] - before[k] for k in keys}
    return result


if __name__ == "__main__":
    import asyncio

    print("RESULT " + json.dumps(asyncio.run(_run(SPEC))), flush=True)
