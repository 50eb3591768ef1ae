"""The ingress's CPU work, bounded, and a watchdog that tells Serve when the ingress can no
longer serve.

Why: the ingress is one event loop (plus a few threads) in front of every model. A request
that makes it compute (decode an image, read an audio header) must not hold it, and a
client must not be able to take all of it. Before this, eight requests that made the
ingress render a client's chat template put it at 100 % CPU for minutes while ``/health``
still answered 200, so nothing replaced it.

* :class:`IngressWork`: the threads that do a request's CPU work (:data:`WORK_THREADS`), and
  per client address at most :data:`WORK_PER_CLIENT` requests in them at once (the others
  wait their turn: one client queues behind itself, not in front of everyone).
* :class:`Watchdog`: a thread that posts a no-op to the event loop and to the work threads
  every :data:`PROBE_PERIOD_S`; if either has not run one for ``stall_s`` seconds
  (``ingress.unhealthy_after_stall_s`` of the config), the
  ingress reports it through :meth:`Watchdog.problem`, which ``/health`` answers as a 503 and
  Serve's replica health check (``OpenAIIngress.check_health``) raises, so Serve replaces
  the replica. A blocked event loop cannot answer either; Serve's health-check timeout then
  does the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
WORK_THREADS = 2
WORK_PER_CLIENT = 2
PROBE_PERIOD_S = 1.0


class IngressWork:
    """Runs a request's CPU work off the event loop, at most ``per_client`` of one client's
    at once."""

    def __init__(self, threads: int = WORK_THREADS, per_client: int = WORK_PER_CLIENT) -> None:
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rbln-ray-ingress")
        self.per_client = per_client
        self._slots: dict[str, asyncio.Semaphore] = defaultdict(self._new_slot)
        self._users: dict[str, int] = defaultdict(int)

    def _new_slot(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(self.per_client)

    async def run(self, client: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a work thread, after this client's earlier work has made room."""
        with self._user(client):
            async with self._slots[client]:
                return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    @contextlib.contextmanager
    def _user(self, client: str) -> Iterator[None]:
        self._users[client] += 1
        try:
            yield
        finally:
            self._users[client] -= 1
            if not self._users[client]:  # forget idle clients (their semaphores too)
                del self._users[client]
                self._slots.pop(client, None)


class Watchdog:
    """Times how long the ingress's event loop and work threads take to run a no-op (module
    docstring)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        pool: ThreadPoolExecutor,
        stall_s: float,
        period_s: float = PROBE_PERIOD_S,
    ) -> None:
        self.loop, self.pool = loop, pool
        self.stall_s, self.period_s = stall_s, period_s
        self.rounds = 0  # probe rounds finished (tests wait on it)
        self._posted: dict[str, float | None] = {"event loop": None, "work threads": None}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rbln-ray-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def problem(self) -> str | None:
        """Why the ingress cannot serve (a probe outstanding past ``stall_s``), else None."""
        now = time.monotonic()
        with self._lock:
            late = {name: now - t for name, t in self._posted.items() if t is not None}
        for name, waited in late.items():
            if waited > self.stall_s:
                return (
                    f"the ingress's {name} ran nothing for {waited:.0f} s (stalled; limit "
                    f"{self.stall_s:g} s)"
                )
        return None

    def _ran(self, name: str) -> None:
        with self._lock:
            self._posted[name] = None

    def _post(self, name: str) -> None:
        with self._lock:
            if self._posted[name] is not None:
                return  # the last probe has not run yet: its age is what counts
            self._posted[name] = time.monotonic()
        if name == "event loop":
            self.loop.call_soon_threadsafe(self._ran, name)
        else:
            self.pool.submit(self._ran, name)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._post("event loop")
                self._post("work threads")
            except RuntimeError:  # the loop or pool was closed: the ingress is going away
                return
            self.rounds += 1
            self._stop.wait(self.period_s)
