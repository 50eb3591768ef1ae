"""Faults under load: every request ends with exactly one terminal response, fast."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.reliability.conftest import MODEL, replica_stats, wait_until
from tests.serve.conftest import RunningApp

pytestmark = [pytest.mark.slow, pytest.mark.multinode]


async def stream_one(
    client: httpx.AsyncClient, url: str, i: int, first_token: asyncio.Event
) -> dict:
    """One streaming completion; returns how it ended (never raises)."""
    body = {
        "model": MODEL,
        "prompt": f"x{i} = ",
        "max_tokens": 300,
        "stream": True,
        "ignore_eos": True,
    }
    started = time.monotonic()
    outcome = {"status": None, "done": False, "error": None, "chunks": 0}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            outcome["status"] = r.status_code
            if r.status_code != 200:
                outcome["error"] = (await r.aread()).decode()[:200]
            else:
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        outcome["done"] = True
                    elif line.startswith("data: "):
                        payload = json.loads(line[6:])
                        if "error" in payload:
                            outcome["error"] = payload["error"]["message"]
                        else:
                            outcome["chunks"] += 1
                            first_token.set()
    except httpx.HTTPError as exc:
        outcome["error"] = f"transport: {exc!r}"
    outcome["ended"] = time.monotonic()
    outcome["seconds"] = outcome["ended"] - started
    return outcome


async def load_with_fault(app: RunningApp, fault) -> tuple[list[dict], float]:
    """16 concurrent streams; ``fault(stats)`` runs once 8 of them (all slots) stream tokens.

    Returns the outcomes and the monotonic time of the fault.
    """
    started = [asyncio.Event() for _ in range(16)]
    async with httpx.AsyncClient(timeout=180) as client:
        tasks = [asyncio.create_task(stream_one(client, app.url, i, started[i])) for i in range(16)]
        stats = await asyncio.to_thread(replica_stats, app)
        while sum(e.is_set() for e in started) < 8:
            await asyncio.wait(
                [asyncio.create_task(e.wait()) for e in started if not e.is_set()],
                timeout=60,
                return_when=asyncio.FIRST_COMPLETED,
            )
        fault(stats)
        fault_at = time.monotonic()
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=170)
    return outcomes, fault_at


def check_terminal_and_recovery(
    app: RunningApp, outcomes: list[dict], fault_at: float, label: str
) -> None:
    # Exactly one terminal outcome each: a complete stream ([DONE] without error), or an error.
    for o in outcomes:
        completed = o["status"] == 200 and o["done"] and o["error"] is None
        failed = o["error"] is not None
        assert completed != failed, o
    failed = [o for o in outcomes if o["error"]]
    assert failed, "the fault affected no request"
    # Recovery: Serve replaces the replica; then every request succeeds again.
    body = {"model": MODEL, "prompt": "y = ", "max_tokens": 8}

    def all_ok() -> bool:
        codes = [
            httpx.post(f"{app.url}/v1/completions", json=body, timeout=60).status_code
            for _ in range(8)
        ]
        return codes == [200] * 8

    recovered = wait_until(all_ok, timeout=300, interval=1, what="success back to 100 %")
    wait_until(lambda: httpx.get(f"{app.url}/health").status_code == 200, 300, 1, "health")
    assert len(replica_stats(app)) == 2
    slowest = max(o["ended"] - fault_at for o in failed)
    print(
        f"{label}: {len(failed)}/{len(outcomes)} streams failed, last error "
        f"{slowest:.1f} s after the fault; 100 % success again {recovered:.0f} s later"
    )


def test_killing_a_worker_actor_fails_only_its_requests_fast(tiny_app: RunningApp) -> None:
    def kill_worker(stats: dict) -> None:
        replica = next(iter(stats.values()))
        os.kill(replica["workers"][0]["pid"], signal.SIGKILL)

    outcomes, fault_at = asyncio.run(load_with_fault(tiny_app, kill_worker))
    # In-flight requests of the engine that lost its worker fail within 30 s of the kill.
    failed = [o for o in outcomes if o["error"]]
    assert all(o["ended"] - fault_at < 30 for o in failed), failed
    check_terminal_and_recovery(tiny_app, outcomes, fault_at, "worker kill")


def test_killing_a_replica_fails_only_its_requests_fast(tiny_app: RunningApp) -> None:
    import ray

    def kill_replica(stats: dict) -> None:
        name = next(iter(stats))
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

    outcomes, fault_at = asyncio.run(load_with_fault(tiny_app, kill_replica))
    failed = [o for o in outcomes if o["error"]]
    assert all(o["ended"] - fault_at < 30 for o in failed), failed
    check_terminal_and_recovery(tiny_app, outcomes, fault_at, "replica kill")
