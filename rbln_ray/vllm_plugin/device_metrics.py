"""RBLN device counters of one worker, recorded through Ray's metrics pipeline.

Why here, in the worker: the worker is the process that drives its devices and counts what
ran (:class:`~rbln_ray.vllm_plugin.model_runner.StepStats`). Inside a Ray actor (the Ray
executor's workers, hence every Serve replica's), ``ray.util.metrics`` hands each value to
the actor's core worker, which Ray's metrics agent on that node exports for Prometheus as
``ray_<name>``. Outside Ray (vLLM's in-process or multiprocessing executors) there is no
exporter, and the worker records nothing. A Serve replica that drives its devices itself
(``distributed_executor_backend: uni``) runs its worker in vLLM's engine process, which is no
Ray worker, while the replica is: the replica relays that worker's counters
(:func:`relay_engine_metrics`).

The worker calls :meth:`DeviceMetrics.observe` after each step: counters advance by what the
step added, gauges take their current value. Ray 2.60 drops a gauge series that is not set
again within two export intervals (its metrics agent's gauge TTL; vLLM's own gauges share
this), so the gauges are set at every step: an idle engine's gauges age out, its counters
stay. Tags say whose devices: the served model, the Serve replica (``RBLN_RAY_REPLICA``, set
by the replica and forwarded to its workers), the node and the devices (``RBLN_DEVICES``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from types import SimpleNamespace
from typing import Any

from rbln_ray.common import envs

logger = logging.getLogger(__name__)

TAG_KEYS = ("model", "replica", "node", "devices")
# How often a replica asks its in-process worker for its counters: within one export interval
# of Ray's metrics agent in the suite (1 s), a tenth of Ray's default (10 s), so a stepping
# engine's gauges never age out.
RELAY_PERIOD_S = 1.0

# Exported name (``ray_`` + name + ``_total`` for counters) -> (StepStats field, help).
COUNTERS = {
    "rbln_prefill_steps": ("prefill_steps", "Prefill calls on the device"),
    "rbln_prefill_tokens": ("prefill_tokens", "Prompt tokens the prefill calls computed"),
    "rbln_prefix_reused_tokens": ("prefix_reused_tokens", "Prompt tokens served from cached KV"),
    "rbln_kv_copies": ("kv_copies", "On-device KV block copies for prefix-cache hits"),
    "rbln_decode_steps": ("decode_steps", "Decode calls on the device"),
    "rbln_decode_rows": ("decode_rows", "Live rows in decode calls"),
    "rbln_padded_rows": ("padded_rows", "Padding rows in decode calls"),
    "rbln_device_seconds": ("device_seconds", "Seconds inside rebel.Runtime calls"),
    "rbln_verify_steps": ("verify_steps", "Speculative-decoding verify calls on the device"),
    "rbln_verify_rows": ("verify_rows", "Live rows in verify calls"),
    "rbln_draft_calls": ("draft_calls", "Draft-model calls on the device"),
    "rbln_draft_seconds": ("draft_seconds", "Seconds inside draft-model calls"),
}
GAUGES = {
    "rbln_slots_in_use": "Requests holding a compiled batch slot",
    "rbln_batch_size": "Compiled batch size (slots)",
}


def _inside_ray_worker() -> bool:
    import ray

    return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


class DeviceMetrics:
    """The Ray metrics of one worker's devices (see module docstring)."""

    def __init__(self, model: str, batch_size: int, tags: dict[str, str]) -> None:
        from ray.util.metrics import Counter, Gauge

        self.tags = {"model": model, **tags}
        self._counters = {
            name: Counter(name, description=doc, tag_keys=TAG_KEYS)
            for name, (_, doc) in COUNTERS.items()
        }
        self._gauges = {
            name: Gauge(name, description=doc, tag_keys=TAG_KEYS) for name, doc in GAUGES.items()
        }
        self._last: dict[str, float] = {}
        self.batch_size = batch_size
        self._lock = threading.Lock()  # the Ray threads finishing steps may overlap

    @classmethod
    def for_this_worker(cls, model: str, batch_size: int) -> DeviceMetrics | None:
        """The worker's metrics when it runs in a Ray actor; None elsewhere (no exporter)."""
        if not _inside_ray_worker():
            return None
        import ray

        tags = {
            "replica": envs.get("RBLN_RAY_REPLICA") or "",
            "node": envs.get("RBLN_RAY_NODE_ID") or ray.get_runtime_context().get_node_id(),
            "devices": os.environ.get("RBLN_DEVICES", ""),
        }
        return cls(model, batch_size, tags)

    def observe(self, stats: Any, slots_in_use: int) -> None:
        """Record one step: counters by what ``stats`` (a StepStats) gained since the last
        call, the gauges at their current values."""
        with self._lock:
            self._record(stats, slots_in_use)

    def _record(self, stats: Any, slots_in_use: int) -> None:
        for name, (field, _) in COUNTERS.items():
            value = getattr(stats, field)
            delta = value - self._last.get(field, 0)
            if delta > 0:
                self._counters[name].inc(delta, tags=self.tags)
                self._last[field] = value
        self._gauges["rbln_slots_in_use"].set(slots_in_use, tags=self.tags)
        self._gauges["rbln_batch_size"].set(self.batch_size, tags=self.tags)


async def relay_engine_metrics(engine: Any, model: str, period_s: float = RELAY_PERIOD_S) -> None:
    """Record the device metrics of ``engine``'s in-process worker from this Ray actor (the
    Serve replica that started the engine), until the engine ends.

    Every ``period_s`` it asks the worker for its counters (``step_stats``, one utility call
    between steps) and records them as the worker would after a step. A poll that finds no new
    step records nothing, so an idle engine's gauges age out as a worker actor's do.
    """
    metrics: DeviceMetrics | None = None
    last: dict[str, Any] | None = None
    while True:
        try:
            (stats,) = await engine.collective_rpc("step_stats")
        except Exception as exc:  # noqa: BLE001 - a dead engine ends the relay, not the replica
            logger.debug("device metrics relay of %s ends: %s", model, exc)
            return
        if stats != last:
            if metrics is None:
                metrics = DeviceMetrics.for_this_worker(model, stats["batch_size"])
                if metrics is None:
                    return
            metrics.observe(SimpleNamespace(**stats), stats["slots_in_use"])
            last = stats
        await asyncio.sleep(period_s)
