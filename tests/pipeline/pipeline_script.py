"""Drive one vLLM engine per model over a staged (or single-stage) artifact; print RESULT json.

Why a subprocess: vLLM keeps process-global state and each run needs its own Ray driver.

Spec keys: ``scenario`` (``generate`` | ``kill``), ``models`` (list of compiled dirs, served
one after another), ``prompts`` (token id lists), ``max_tokens`` (int or one per prompt),
``backend`` (``ray`` default, or ``uni`` for the single-stage reference), ``strategy``
(placement strategy), ``rpc`` (extra collective_rpc methods), ``kill_stage`` (kill scenario).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any


def _engine_kwargs(model: str, spec: dict) -> dict:
    return {
        "model": model,
        "distributed_executor_backend": spec.get("backend", "ray"),
        "additional_config": {"rbln_placement_strategy": spec.get("strategy", "PACK")},
        "skip_tokenizer_init": True,
    }


def _max_tokens(spec: dict) -> list[int]:
    m = spec["max_tokens"]
    return m if isinstance(m, list) else [m] * len(spec["prompts"])


def generate(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in _max_tokens(spec)
    ]
    results = []
    for model in spec["models"]:
        t0 = time.monotonic()
        llm = LLM(**_engine_kwargs(model, spec))
        started = time.monotonic() - t0
        infos = llm.collective_rpc("device_info")
        t0 = time.monotonic()
        outs = llm.generate(prompts, params, use_tqdm=False)
        served = time.monotonic() - t0
        rpc = {name: llm.collective_rpc(name) for name in spec.get("rpc", [])}
        llm.llm_engine.engine_core.shutdown()
        results.append(
            {
                "model": model,
                "devices": infos,
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "rpc": rpc,
                "start_s": started,
                "serve_s": served,
            }
        )
    return {"engines": results}


async def _kill(spec: dict) -> dict:
    """SIGKILL one stage's actor once tokens stream; report how requests end and when."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from tests.ray_cluster import kill_during_generation  # the repo root is on PYTHONPATH

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**_engine_kwargs(spec["models"][0], spec)))
    infos = await engine.collective_rpc("device_info")
    victim = next(i for i in infos if i["stage"] == spec["kill_stage"])
    outcome = await kill_during_generation(
        engine, victim["pid"], spec["prompts"], spec["max_tokens"]
    )
    engine.shutdown()
    return {**outcome, "devices": infos, "killed": victim}


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec.get("scenario") == "kill":
        result: dict[str, Any] = asyncio.run(_kill(spec))
    else:
        result = generate(spec)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
