"""The ingress's bounded work and its watchdog (rbln_ray.serve.ingress_work), in process: one
client's work cannot take every work thread, and an ingress whose work threads or event loop
stall says so on ``/health`` and to Serve's health check (which then replaces the replica)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from rbln_ray.serve.config import RequestLimits
from rbln_ray.serve.ingress_work import IngressWork, Watchdog

STALL_S = 0.3  # the tests' stall limit: a probe outstanding this long is a stall
WAIT_S = 60.0  # how long a test waits for the watchdog to see what it must see


async def until(condition: Callable[[], bool]) -> None:
    """Wait (yielding to the loop) until ``condition`` holds; fail after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.02)


def test_one_clients_work_cannot_take_every_work_thread() -> None:
    """Client a's five jobs hold at most two of three threads (the rest wait behind a's own);
    client b's job runs at once on the third."""

    async def scenario() -> None:
        work = IngressWork(threads=3, per_client=2)
        release = threading.Event()
        started: list[str] = []

        def job(name: str) -> str:
            started.append(name)
            release.wait()
            return name

        a_jobs = [asyncio.create_task(work.run("a", job, f"a{i}")) for i in range(5)]
        await until(lambda: len(started) == 2)
        assert await work.run("b", lambda: "b done") == "b done"
        assert len(started) == 2 and not any(t.done() for t in a_jobs)
        release.set()
        assert sorted(await asyncio.gather(*a_jobs)) == [f"a{i}" for i in range(5)]
        assert not work._slots and not work._users  # idle clients forgotten
        work.pool.shutdown()

    asyncio.run(scenario())


@pytest.fixture()
def ingress():
    from rbln_ray.serve.ingress import OpenAIIngress, build_ingress_app

    ingress = OpenAIIngress.__new__(OpenAIIngress)
    ingress.configure({}, None, RequestLimits(), {}, [], "app", stall_s=STALL_S)
    yield ingress, build_ingress_app(ingress)
    if ingress.watchdog:
        ingress.watchdog.stop()
    ingress.work.pool.shutdown(wait=False)


def test_starved_work_threads_make_the_ingress_unhealthy(ingress) -> None:
    ingress, app = ingress

    async def health() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            return await client.get("/health")

    async def scenario() -> None:
        watchdog = ingress.watch()
        release = threading.Event()
        blocked = [ingress.work.pool.submit(release.wait) for _ in range(2)]  # every thread
        try:
            await until(lambda: watchdog.problem() is not None)
            r = await health()
            assert r.status_code == 503 and "work threads ran nothing" in r.json()["status"]
            with pytest.raises(RuntimeError, match="work threads"):
                await ingress.check_health()
        finally:
            release.set()
        for future in blocked:
            await asyncio.wrap_future(future)
        rounds = watchdog.rounds
        await until(lambda: watchdog.rounds > rounds + 1)  # a probe ran since
        assert watchdog.problem() is None
        await ingress.check_health()  # healthy again

    asyncio.run(scenario())


def test_a_blocked_event_loop_is_reported() -> None:
    """The watchdog is a thread of its own: it sees a loop that runs nothing (a callback that
    never yields) while that loop cannot see anything."""
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    work = IngressWork()
    watchdog = Watchdog(loop, work.pool, stall_s=STALL_S, period_s=0.05).start()
    release, blocking = threading.Event(), threading.Event()

    def block() -> None:
        blocking.set()
        release.wait()

    try:
        loop.call_soon_threadsafe(block)
        assert blocking.wait(WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while watchdog.problem() is None:
            assert time.monotonic() < deadline, "the stall was never reported"
            release.wait(0.02)  # waiting on the watchdog thread, not on the loop
        assert "event loop ran nothing" in watchdog.problem()
    finally:
        release.set()
        watchdog.stop()
        loop.call_soon_threadsafe(loop.stop)
        runner.join(WAIT_S)
        loop.close()
        work.pool.shutdown()
