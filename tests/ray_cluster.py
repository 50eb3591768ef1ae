"""A multi-raylet Ray cluster on this machine, and engine scripts run against it.

Shared by the executor and pipeline tests: a head with no RBLN plus worker nodes with their
own emulated devices (numbered 0..N-1 on each node, as on real hosts).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import run_python

ENGINE_ENV = {"RBLN_RAY_DEVICE": "emulated", "OMP_NUM_THREADS": "1"}
NODES, DEVICES_PER_NODE = 2, 2  # the shared test cluster: head (no RBLN) + 2 nodes × 2 RBLN


@contextlib.contextmanager
def multinode_cluster(
    cache_dir: Path,
    nodes: int = 2,
    devices_per_node: int = 2,
    head_args: dict | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """Start the cluster, connect this process, yield its address; tear it all down after.

    ``head_args`` add to the head's ``ray start`` arguments (e.g. a dashboard); ``env`` is set
    for every raylet and so for every process they start."""
    import ray
    from ray.cluster_utils import Cluster

    from rbln_ray.emulator import ensure_runtime

    saved = dict(os.environ)  # restored after: later tests must not inherit this cache dir
    os.environ.update(ENGINE_ENV)
    ensure_runtime()  # raylets and workers inherit the emulator's PYTHONPATH shim
    os.environ["RBLN_RAY_CACHE"] = str(cache_dir)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.update(env or {})
    cluster = Cluster(
        initialize_head=True,
        # no dashboard unless asked for (head_args): no test of these clusters reads Ray's
        # state API, and its processes would take CPU from the raylets and engines
        head_node_args={
            "num_cpus": 1,
            "resources": {"RBLN": 0},
            "include_dashboard": False,
            **(head_args or {}),
        },
    )
    for _ in range(nodes):
        cluster.add_node(num_cpus=2, resources={"RBLN": devices_per_node})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    try:
        yield cluster.address
    finally:
        ray.shutdown()
        cluster.shutdown()
        os.environ.clear()
        os.environ.update(saved)


def run_engine_script(script: Path, address: str, spec: dict, timeout: float = 600) -> dict:
    """Run ``script`` (an engine driver) against the cluster; return its ``RESULT`` JSON."""
    result, proc = run_python(
        [str(script), json.dumps(spec)],
        env={"RAY_ADDRESS": address, **ENGINE_ENV},
        timeout=timeout,
        check=False,
    )
    if result is None:
        tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        raise AssertionError(f"{script.name} failed (rc {proc.returncode}):\n{tail}")
    return {**result, "stderr": proc.stderr}


def wait_all_rbln_free(total: float = NODES * DEVICES_PER_NODE, timeout: float = 30) -> float:
    """Bounded poll until ``total`` RBLN of the cluster are free again; returns what is free."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        free = ray.available_resources().get("RBLN", 0)
        if free == total or time.monotonic() > deadline:
            return free
        time.sleep(0.2)  # polling a condition with a deadline, not synchronising by sleep


async def kill_during_generation(
    engine, victim_pid: int, prompts: list[list[int]], max_tokens: int
) -> dict:
    """In an engine script: stream ``prompts``, SIGKILL ``victim_pid`` at the first token and
    report how every request ended (``errors``), how long that took, and what never ended."""
    import asyncio
    import signal

    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    first_token = asyncio.Event()
    errors: list[str] = []

    async def one(i: int, prompt: list[int]) -> None:
        try:
            async for _ in engine.generate({"prompt_token_ids": prompt}, params, f"r{i}"):
                first_token.set()
        except Exception as e:  # noqa: BLE001 - the errors are what we report
            errors.append(f"{type(e).__name__}: {e}")
        else:
            errors.append("finished without error")

    tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
    await asyncio.wait_for(first_token.wait(), timeout=120)
    os.kill(victim_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    _, pending = await asyncio.wait(tasks, timeout=60)
    error_s = time.monotonic() - killed_at
    for task in pending:
        task.cancel()
    return {"errors": errors, "error_s": error_s, "pending": len(pending)}
