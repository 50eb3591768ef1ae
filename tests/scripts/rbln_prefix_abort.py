"""AsyncLLM on RBLN: aborting requests whose RBLN blocks hold a shared prefix.

argv[1] (JSON): ``{"model": dir, "prefix": [ids], "suffixes": [[ids] x 10]}``. Requests
``r0..r3`` (long) start together; ``r0, r1`` are aborted mid-decode, then ``r4..r7`` (short,
same prefix) run while ``r2, r3`` still hold it; ``r2, r3`` are aborted and ``r8, r9`` run.
Prints ``RESULT {"completed": {id: tokens}, "aborted": [...], "stats": step_stats}``.
"""

import asyncio
import json
import os
import sys

os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")


async def main(spec: dict) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=spec["model"], seed=0))
    prompts = [spec["prefix"] + s for s in spec["suffixes"]]
    long_params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    short_params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    started = {f"r{i}": asyncio.Event() for i in range(4)}
    tokens: dict[str, list[int]] = {}
    finished: dict[str, str | None] = {}

    async def run(i: int, params: SamplingParams) -> None:
        req_id = f"r{i}"
        async for out in engine.generate({"prompt_token_ids": prompts[i]}, params, req_id):
            tokens[req_id] = list(out.outputs[0].token_ids)
            finished[req_id] = out.outputs[0].finish_reason
            if len(tokens[req_id]) >= 3 and req_id in started:
                started[req_id].set()

    longs = [asyncio.create_task(run(i, long_params)) for i in range(4)]
    await asyncio.gather(*(e.wait() for e in started.values()))
    await engine.abort(["r0", "r1"])
    await asyncio.gather(*(run(i, short_params) for i in range(4, 8)))
    await engine.abort(["r2", "r3"])
    await asyncio.gather(*longs)
    await asyncio.gather(*(run(i, short_params) for i in range(8, 10)))
    # The engine tells the workers about finished requests with its next (empty) step, which
    # runs after the last output reached us: poll until the slots are released (bounded).
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        stats = (await engine.collective_rpc("step_stats"))[0]
        if stats["slots_in_use"] == 0 or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)
    engine.shutdown()
    stats.pop("history", None)
    completed = {r: t for r, t in tokens.items() if finished.get(r) == "length" and len(t) == 12}
    return {
        "completed": completed,
        "aborted": sorted(r for r in tokens if r not in completed),
        "stats": stats,
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(asyncio.run(main(json.loads(sys.argv[1])))), flush=True)
