"""Prefix-affinity routing end to end: a prefix group stays on one replica, whose vLLM prefix
cache then hits, visible per replica in Ray's metrics export."""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.ray_metrics import samples
from tests.serve.conftest import RunningApp, free_port, start_app, stop_app

pytestmark = pytest.mark.slow

GROUPS = 3
PER_GROUP = 8


@pytest.fixture(scope="module")
def affinity_app() -> Iterator[RunningApp]:
    os.environ["RBLN_RAY_DEVICE"] = "emulated"  # the compile below runs in this process
    from rbln_ray.cli.serve_cmd import DEMO_COMPILE
    from rbln_ray.compile import CompileSettings, resolve_compiled_dir
    from rbln_ray.models import demo_model_dir

    hf_dir = demo_model_dir()
    compiled = resolve_compiled_dir(hf_dir, CompileSettings.from_dict(DEMO_COMPILE))
    config = {
        "routing": "prefix_affinity",
        "models": [{"name": "demo", "model": str(compiled), "num_replicas": 2}],
    }
    app = start_app(config, free_port(), hf_dir)
    try:
        yield app
    finally:
        stop_app()


def replica_prefills() -> dict[int, int]:
    """Completed prefills per replica (keyed by replica pid), from every replica."""
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer:demo", "rbln-ray")
    seen: dict[int, int] = {}
    for _ in range(60):  # each call reaches one replica: 60 calls miss one w.p. 2^-60
        stats = handle.engine_stats.remote().result()
        seen[stats["pid"]] = sum(s["prefill_requests"] for s in stats["steps"])
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only reached replicas {sorted(seen)}")


def system_prompt(group: int) -> str:
    lines = [f"# group {group}: module {group} helpers"]
    lines += [f"def helper_{group}_{i}(value):\n    return value * {i + group}" for i in range(24)]
    return "\n".join(lines) + "\n"


def test_prefix_groups_stay_on_one_replica_and_hit_its_cache(affinity_app: RunningApp) -> None:
    url = f"{affinity_app.url}/v1/completions"

    def one(prompt: str) -> int:
        body = {"model": "demo", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        return httpx.post(url, json=body, timeout=300).status_code

    shares = []
    for group in range(GROUPS):
        before = replica_prefills()
        prompts = [system_prompt(group) + f"# request {i}\n" for i in range(PER_GROUP)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(one, prompts)) == [200] * PER_GROUP
        after = replica_prefills()
        served = {pid: after[pid] - before[pid] for pid in after}
        assert sum(served.values()) == PER_GROUP, served
        shares.append(max(served.values()) / PER_GROUP)
    assert min(shares) >= 0.9, f"share of each group on its busiest replica: {shares}"

    # vLLM's prefix-cache counters, per replica, through Ray's metrics export.
    deadline = time.monotonic() + 60
    hits: dict[str, float] = {}
    while time.monotonic() < deadline:
        hits = {s.labels["ReplicaId"]: s.value for s in samples("ray_vllm_prefix_cache_hits_total")}
        queries = {s.labels["ReplicaId"] for s in samples("ray_vllm_prefix_cache_queries_total")}
        if len(queries) == 2 and sum(hits.values()) > 0:
            break
        time.sleep(1)  # polling Ray's export (every second in tests)
    # vLLM's Ray counters start at their first increment: both replicas were queried, and
    # the shared system prompts hit.
    assert len(queries) == 2, f"per-replica prefix-cache query counters missing: {queries}"
    assert sum(hits.values()) > 0, hits
