"""A replica's measured service times, reported to cache-aware routers with its cache.

Why measured: the router weighs, per replica, the wait for a decode slot against prefilling
the prompt blocks that replica does not hold (:mod:`rbln_ray.serve.cache_routing`). Both are
times on *this* device under *this* traffic (an ATOM or the emulator, prefill chunks
interleaved with decode steps, answer lengths of the workload), which no constant knows. The
engine's own request stats carry them: vLLM hands every finished request's stats to the stat
loggers an engine is built with (``StatLoggerBase``, its interface for users), and this one
keeps the last :data:`WINDOW` requests':

* **prefill seconds per token**: the window's prefill time (scheduled to first token) over
  the prompt tokens it prefilled (not served from the prefix cache), a ratio of sums so a
  cache hit's few tokens do not dominate;
* **service seconds**: the mean time a request holds a decode slot (scheduled to last
  token). With ``B`` slots busy, one frees every ``service / B`` seconds on average;
* **load**: the requests in the engine after its last step (vLLM's scheduler stats), with
  the report's sequence number: a router counts only its own sends, and with several ingress
  replicas this is how each learns the others' (BENCHMARKS, "Fleet simulation").

The replica's warm-up requests (a few tokens each) are dropped (:meth:`ServiceTimes.reset`),
so a report describes user traffic only; until the first user request ends it has no times,
and the router falls back to its load-slack rule.

This module stays importable without vLLM (the router imports its keys in every process that
holds a deployment handle, Python clients included): the stat logger class is built when a
replica asks for it (:meth:`ServiceTimes.stat_logger`).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from rbln_ray.upstream.vllm_internals import engine_load, finished_request_times

WINDOW = 64  # finished requests a report averages over
# Keys of ``routing_stats`` (read by rbln_ray.serve.cache_routing).
STATS_PREFILL_S_PER_TOKEN = "prefill_s_per_token"
STATS_SERVICE_S = "service_s"
STATS_LOAD = "load"  # requests in the engine (running and waiting) at the report
STATS_REPORT = "report"  # the report's sequence number (which report a load is from)


class ServiceTimes:
    """The last :data:`WINDOW` requests' times of one replica's engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # recorded on the engine's loop, read by Serve
        self._times: deque[tuple[int, float, float]] = deque(maxlen=WINDOW)
        self._load: int | None = None  # requests in the engine after its last step
        self._reports = 0

    def stat_logger(self) -> type:
        """A vLLM stat logger class (what an engine's ``stat_loggers`` list takes: vLLM calls
        it with the engine's config and index) whose instances record into this window."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        window = self

        class ServiceTimesLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(
                self,
                scheduler_stats: Any,
                iteration_stats: Any,
                mm_cache_stats: Any = None,
                engine_idx: int = 0,
            ) -> None:
                window.add(finished_request_times(iteration_stats))
                window.set_load(engine_load(scheduler_stats, iteration_stats))

            def log_engine_initialized(self) -> None:
                pass

        return ServiceTimesLogger

    def add(self, times: list[tuple[int, float, float]]) -> None:
        """Finished requests' (prefilled tokens, prefill s, slot s); ones that never ran a
        step (aborted while waiting) are left out."""
        with self._lock:
            self._times.extend(t for t in times if t[2] > 0)

    def set_load(self, load: int | None) -> None:
        if load is not None:
            with self._lock:
                self._load = load

    def reset(self) -> None:
        with self._lock:
            self._times.clear()

    def report(self) -> dict[str, float]:
        """The replica's times as ``routing_stats`` entries (none before a request ended),
        and its load (requests in its engine after its last step) with the report's number:
        every ingress replica's router learns from it what the others sent there."""
        with self._lock:
            times, load = list(self._times), self._load
            self._reports += 1
            seq = self._reports
        out: dict[str, float] = {}
        if load is not None:
            out[STATS_LOAD], out[STATS_REPORT] = load, seq
        if not times:
            return out
        out[STATS_SERVICE_S] = sum(t[2] for t in times) / len(times)
        tokens = sum(t[0] for t in times)
        if tokens:
            out[STATS_PREFILL_S_PER_TOKEN] = sum(t[1] for t in times) / tokens
        return out
