"""What Prometheus would scrape: Ray's metrics export of every alive node of the connected
cluster (vLLM's engine metrics, rbln-ray's device and request counters, Ray's own)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Test clusters export every second (Ray's default: every 10 s), so polls settle quickly.
FAST_EXPORT = {"metrics_report_interval_ms": 1000}


def export_urls() -> list[str]:
    import ray

    return [
        f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
        for n in ray.nodes()
        if n.get("Alive") and n.get("MetricsExportPort")
    ]


def samples(*names: str) -> list:
    """Every sample called one of ``names`` (e.g. ``ray_vllm_generation_tokens_total``) on
    every node, from one scrape of each."""
    found = []
    for url in export_urls():
        text = httpx.get(url, timeout=30).text
        for family in text_string_to_metric_families(text):
            found += [s for s in family.samples if s.name in names]
    return found


def metric_sum(name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(
        s.value for s in samples(name) if all(s.labels.get(k) == v for k, v in labels.items())
    )
