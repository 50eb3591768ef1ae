"""Drive vLLM engines through ``RBLNRayExecutor`` in a fresh process; print one JSON line.

Why a subprocess: vLLM keeps process-global state (platform, env cache, engine-core
processes), and each scenario needs its own Ray driver connection.

Usage: ``python engine_script.py '<json spec>'``. Spec keys:

* ``scenario``: ``generate`` (default), ``kill`` or ``placement``;
* ``model``, ``prompts`` (token id lists), ``max_tokens``;
* ``backends``: one engine per entry, all alive at once, generating concurrently (one thread
  each); an entry is ``"ray"``, ``"class"`` (the class object), ``"qualname"`` or ``"uni"``;
* ``ray_init``: connect this driver to ``RAY_ADDRESS`` with ``ray.init`` before building
  engines and *remove* ``RAY_ADDRESS`` from the environment (the engine core must then find
  the cluster through the recorded address);
* ``additional_config``: passed to the engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any


def _backend(name: str) -> Any:
    if name == "class":
        from rbln_ray.executor import RBLNRayExecutor

        return RBLNRayExecutor
    return {"ray": "ray", "qualname": "rbln_ray.executor.RBLNRayExecutor", "uni": "uni"}[name]


def _engine_kwargs(spec: dict, backend: str = "ray") -> dict:
    return {
        "model": spec["model"],
        "distributed_executor_backend": _backend(backend),
        "additional_config": dict(spec.get("additional_config", {})),
        "skip_tokenizer_init": True,
    }


def generate(spec: dict) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from vllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    t0 = time.monotonic()
    engines = [LLM(**_engine_kwargs(spec, b)) for b in spec.get("backends", ["ray"])]
    started = time.monotonic() - t0

    def run(llm: Any) -> dict:
        infos = llm.collective_rpc("device_info")
        outs = llm.generate(prompts, params, use_tqdm=False)
        return {
            "devices": infos,
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "stats": llm.collective_rpc("step_stats"),
        }

    t0 = time.monotonic()
    with ThreadPoolExecutor(len(engines)) as pool:  # every engine serves at the same time
        results = list(pool.map(run, engines))
    served = time.monotonic() - t0
    for llm in engines:
        llm.llm_engine.engine_core.shutdown()
    return {"engines": results, "start_s": started, "serve_s": served}


async def _kill(spec: dict) -> dict:
    """Kill the worker actor once tokens are streaming; expect errors within 30 s."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from tests.ray_cluster import kill_during_generation  # the repo root is on PYTHONPATH

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**_engine_kwargs(spec)))
    info = (await engine.collective_rpc("device_info"))[0]
    outcome = await kill_during_generation(engine, info["pid"], spec["prompts"], spec["max_tokens"])
    engine.shutdown()
    from rbln_ray.emulator import list_devices

    physical = int(info["rbln_devices"])
    holder = next(d.pid for d in list_devices(info["node"]) if d.id == physical)
    # The devices must be free again: a new engine starts and serves.
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**_engine_kwargs(spec)))
    restarted = (await engine.collective_rpc("device_info"))[0]
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens: list[int] = []
    async for out in engine.generate({"prompt_token_ids": spec["prompts"][0]}, short, "after"):
        tokens = list(out.outputs[0].token_ids)
    engine.shutdown()
    return {
        **outcome,
        "killed": info,
        "holder_after_shutdown": holder,
        "restarted": restarted,
        "restart_tokens": tokens,
    }


def placement(spec: dict) -> dict:
    from vllm import LLM

    t0 = time.monotonic()
    try:
        LLM(**_engine_kwargs(spec, spec.get("backends", ["ray"])[0]))
    except Exception as e:  # noqa: BLE001 - the message is the result
        return {"error": f"{type(e).__name__}: {e}", "elapsed_s": time.monotonic() - t0}
    return {"error": None, "elapsed_s": time.monotonic() - t0}


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec.get("ray_init"):
        import ray

        ray.init(address=os.environ.pop("RAY_ADDRESS"))
    scenario = spec.get("scenario", "generate")
    if scenario == "kill":
        result = asyncio.run(_kill(spec))
    elif scenario == "placement":
        result = placement(spec)
    else:
        result = generate(spec)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
