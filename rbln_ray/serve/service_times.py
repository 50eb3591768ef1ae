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
  token). With ``B`` slots busy, one frees every ``service / B`` seconds on average.

The replica's warm-up requests (a few tokens each) are dropped (:meth:`ServiceTimes.reset`),
so a report describes user traffic only; until the first user request ends it has no times,
and the router falls back to its load-slack rule.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from rbln_ray.upstream.vllm_internals import finished_request_times

WINDOW = 64  # finished requests a report averages over
# Keys of ``routing_stats`` (read by rbln_ray.serve.cache_routing).
STATS_PREFILL_S_PER_TOKEN = "prefill_s_per_token"
STATS_SERVICE_S = "service_s"


class ServiceTimes(StatLoggerBase):
    """A vLLM stat logger that keeps the last :data:`WINDOW` requests' times. One instance
    per replica; :meth:`factory` is what the engine's ``stat_loggers`` list takes."""

    def __init__(self, vllm_config: Any = None, engine_index: int = 0) -> None:
        self._lock = threading.Lock()  # recorded on the engine's loop, read by Serve
        self._times: deque[tuple[int, float, float]] = deque(maxlen=WINDOW)

    def factory(self, vllm_config: Any, engine_index: int = 0) -> ServiceTimes:
        """vLLM's per-engine stat logger factory: this instance, so the replica can read it."""
        return self

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        times = finished_request_times(iteration_stats)
        if times:
            with self._lock:
                self._times.extend(t for t in times if t[2] > 0)

    def log_engine_initialized(self) -> None:
        pass

    def reset(self) -> None:
        with self._lock:
            self._times.clear()

    def report(self) -> dict[str, float]:
        """The replica's times as ``routing_stats`` entries (none before a request ended)."""
        with self._lock:
            times = list(self._times)
        if not times:
            return {}
        out = {STATS_SERVICE_S: sum(t[2] for t in times) / len(times)}
        tokens = sum(t[0] for t in times)
        if tokens:
            out[STATS_PREFILL_S_PER_TOKEN] = sum(t[1] for t in times) / tokens
        return out
