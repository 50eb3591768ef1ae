"""AsyncLLM on RBLN: abort frees a slot; an over-long prompt is rejected; serving goes on.

argv[1]: compiled model dir (batch size 4, max_seq_len 512). Prints ``RESULT {...}``.
"""

import asyncio
import json
import os
import sys
import time

os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")


async def main(model: str) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, seed=0))
    events: list[tuple[float, str]] = []
    long_params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    started = {f"long{i}": asyncio.Event() for i in range(4)}

    async def run(req_id: str, prompt: list[int], params: SamplingParams) -> int:
        n = 0
        async for out in engine.generate({"prompt_token_ids": prompt}, params, req_id):
            n = len(out.outputs[0].token_ids)
            if n >= 3 and req_id in started:
                started[req_id].set()
        events.append((time.monotonic(), req_id))
        return n

    longs = [
        asyncio.create_task(run(rid, [10 + i, 20, 30], long_params))
        for i, rid in enumerate(started)
    ]
    await asyncio.gather(*(e.wait() for e in started.values()))
    await engine.abort("long0")
    short = await run("short", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10))
    short_done_while_longs_running = not any(t.done() for t in longs[1:])
    await engine.abort(["long1", "long2", "long3"])
    long_tokens = await asyncio.gather(*longs)

    try:
        async for _ in engine.generate(
            {"prompt_token_ids": [1] * 600}, SamplingParams(max_tokens=4), "too-long"
        ):
            pass
        too_long_error = None
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever vLLM raised
        too_long_error = f"{type(exc).__name__}: {exc}"
    after = await run("after", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10))
    engine.shutdown()
    return {
        "short_tokens": short,
        "short_done_while_longs_running": short_done_while_longs_running,
        "long_tokens": long_tokens,
        "too_long_error": too_long_error,
        "after_tokens": after,
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(asyncio.run(main(sys.argv[1]))), flush=True)
