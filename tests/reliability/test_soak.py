"""Soak at saturation: every request completes, slots drain to 0, memory stays flat.

CI runs 60 s; the documented long run is ``RBLN_RAY_SOAK_SECONDS=600``.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import httpx
import psutil
import pytest

from tests.ray_metrics import metric_sum
from tests.reliability.conftest import MODEL, replica_stats, wait_until
from tests.serve.conftest import RunningApp

pytestmark = pytest.mark.slow

SOAK_SECONDS = float(os.environ.get("RBLN_RAY_SOAK_SECONDS", "60"))
WARMUP_SECONDS = 15.0
CONCURRENCY = 16  # 2 replicas x 4 compiled slots, so requests queue: saturation


def engine_rss(app: RunningApp) -> int:
    """Resident memory of every replica process and its RBLN worker processes."""
    pids = set()
    for stats in replica_stats(app).values():
        pids.add(stats["pid"])
        pids.update(w["pid"] for w in stats["workers"])
    return sum(psutil.Process(pid).memory_info().rss for pid in pids)


async def closed_loop(app: RunningApp, until: float, results: list[int]) -> None:
    rng = random.Random(0)
    async with httpx.AsyncClient(timeout=120) as client:

        async def worker(w: int) -> None:
            while time.monotonic() < until:
                body = {
                    "model": MODEL,
                    "prompt": f"s{w} = {rng.randrange(1000)}",
                    "max_tokens": rng.randint(8, 48),
                    "stream": rng.random() < 0.5,
                }
                r = await client.post(f"{app.url}/v1/completions", json=body)
                results.append(r.status_code)

        await asyncio.gather(*(worker(w) for w in range(CONCURRENCY)))


def test_soak_at_saturation(tiny_app: RunningApp) -> None:
    results: list[int] = []
    start = time.monotonic()
    asyncio.run(closed_loop(tiny_app, start + WARMUP_SECONDS, results))
    baseline = engine_rss(tiny_app)
    asyncio.run(closed_loop(tiny_app, time.monotonic() + SOAK_SECONDS, results))
    wait_until(
        lambda: (
            metric_sum("ray_rbln_slots_in_use", model=MODEL) == 0
            and metric_sum("ray_vllm_num_requests_running", model_name=MODEL) == 0
        ),
        timeout=60,
        what="drain",
    )
    final = engine_rss(tiny_app)
    assert results and set(results) == {200}, {s: results.count(s) for s in set(results)}
    growth = (final - baseline) / baseline
    print(
        f"soak: {len(results)} requests in {SOAK_SECONDS + WARMUP_SECONDS:.0f} s, "
        f"RSS {baseline / 2**20:.0f} -> {final / 2**20:.0f} MiB ({growth:+.1%})"
    )
    assert growth < 0.10, f"RSS grew {growth:.1%}"
