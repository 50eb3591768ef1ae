"""The worker's device metrics: deltas per step into Ray's metrics, nothing outside Ray."""

from __future__ import annotations

import pytest

# rbln_ray.vllm_plugin is imported inside the tests: importing vLLM at collection, before the
# session's environment is set, would fix vLLM's platform for the whole process.


class Recorded:
    """Stands for a ray.util.metrics Counter/Gauge: keeps what was recorded, by tags."""

    log: list[tuple[str, str, float, dict]] = []

    def __init__(self, name: str, description: str = "", tag_keys: tuple = ()) -> None:
        self.name, self.tag_keys = name, tag_keys

    def inc(self, value: float, tags: dict) -> None:
        assert value > 0 and set(tags) == set(self.tag_keys)  # Ray refuses anything else
        Recorded.log.append(("inc", self.name, value, tags))

    def set(self, value: float, tags: dict) -> None:
        assert set(tags) == set(self.tag_keys)
        Recorded.log.append(("set", self.name, value, tags))


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> type[Recorded]:
    """Ray's Counter and Gauge replaced by :class:`Recorded`, its log emptied."""
    import ray.util.metrics

    monkeypatch.setattr(ray.util.metrics, "Counter", Recorded)
    monkeypatch.setattr(ray.util.metrics, "Gauge", Recorded)
    Recorded.log = []
    return Recorded


def test_outside_a_ray_worker_nothing_is_recorded():
    from rbln_ray.vllm_plugin.device_metrics import DeviceMetrics

    assert DeviceMetrics.for_this_worker("m", 4) is None


def test_counters_advance_by_each_steps_gain_and_gauges_take_the_value(recorded):
    from rbln_ray.vllm_plugin import device_metrics
    from rbln_ray.vllm_plugin.device_metrics import DeviceMetrics
    from rbln_ray.vllm_plugin.model_runner import StepStats

    tags = {"replica": "r1", "node": "n1", "devices": "0"}
    metrics = DeviceMetrics("demo", 4, tags)
    assert Recorded.log == []
    stats = StepStats(prefill_steps=1, prefill_tokens=100, device_seconds=0.5)
    metrics.observe(stats, slots_in_use=1)
    stats.decode_steps, stats.decode_rows, stats.padded_rows = 1, 1, 3
    stats.device_seconds = 0.75
    metrics.observe(stats, slots_in_use=1)
    metrics.observe(stats, slots_in_use=0)  # an empty step: no counter moves
    incs = [(n, v) for kind, n, v, _ in Recorded.log if kind == "inc"]
    assert incs == [
        ("rbln_prefill_steps", 1),
        ("rbln_prefill_tokens", 100),
        ("rbln_device_seconds", 0.5),
        ("rbln_decode_steps", 1),
        ("rbln_decode_rows", 1),
        ("rbln_padded_rows", 3),
        ("rbln_device_seconds", 0.25),
    ]
    slots = [v for kind, n, v, _ in Recorded.log if n == "rbln_slots_in_use"]
    assert slots == [1, 1, 0]
    # Every step sets the gauges again (Ray drops a gauge not set within two exports).
    assert [v for kind, n, v, _ in Recorded.log if n == "rbln_batch_size"] == [4, 4, 4]
    assert all(t["model"] == "demo" and t["replica"] == "r1" for *_, t in Recorded.log)
    assert set(device_metrics.TAG_KEYS) == {"model", "replica", "node", "devices"}


def test_a_replica_relays_its_in_process_workers_counters_until_the_engine_ends(
    monkeypatch, recorded
):
    """``distributed_executor_backend: uni``: the replica polls the worker's counters; a poll
    without a new step records nothing (so idle gauges age out), a dead engine ends it."""
    import asyncio
    from dataclasses import asdict

    from rbln_ray.vllm_plugin import device_metrics
    from rbln_ray.vllm_plugin.model_runner import StepStats

    tags = {"replica": "r1", "node": "n1", "devices": "2"}
    monkeypatch.setattr(
        device_metrics.DeviceMetrics,
        "for_this_worker",
        classmethod(lambda cls, model, batch: cls(model, batch, tags)),
    )

    def snapshot(**counts: float) -> dict:
        return asdict(StepStats(**counts)) | {"slots_in_use": 1, "batch_size": 4}

    first = snapshot(prefill_steps=1, device_seconds=0.5)
    later = snapshot(prefill_steps=1, decode_steps=2, device_seconds=0.75)
    polls = iter([[first], [first], [later]])

    class Engine:
        async def collective_rpc(self, method: str) -> list[dict]:
            assert method == "step_stats"
            try:
                return next(polls)
            except StopIteration:
                raise RuntimeError("EngineDeadError") from None

    asyncio.run(asyncio.wait_for(device_metrics.relay_engine_metrics(Engine(), "demo", 0), 5))
    incs = [(n, v) for kind, n, v, _ in Recorded.log if kind == "inc"]
    assert incs == [
        ("rbln_prefill_steps", 1),
        ("rbln_device_seconds", 0.5),
        ("rbln_decode_steps", 2),
        ("rbln_device_seconds", 0.25),
    ]
    assert [v for _, n, v, _ in Recorded.log if n == "rbln_batch_size"] == [4, 4]
    assert all(t == {"model": "demo", **tags} for *_, t in Recorded.log)
