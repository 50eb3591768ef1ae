"""The ingress's own request counters: ``rbln_request_retries_total``.

Why a module of its own: the counters are the ingress's (which request it retried, and why),
not an engine's, and the way they reach Prometheus is about to change (issue 21 moves
rbln-ray's metrics onto Ray's metrics pipeline). Today the ingress pushes
:func:`exposition` to the app's ``MetricsHub`` like every server replica does, and
``/metrics`` shows it labelled with the ingress replica.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, generate_latest

# Why a retry happened (the label values of ``reason``).
REPLICA_DIED = "replica_died"  # the replica's actor died (killed, crashed, node lost)
ENGINE_DIED = "engine_died"  # the replica lived, its engine did not (e.g. a worker died)
REASONS = (REPLICA_DIED, ENGINE_DIED)

# Not prometheus_client's default registry: in a replica that one holds vLLM's metrics.
REGISTRY = CollectorRegistry()
RETRIES = Counter(
    "rbln_request_retries",
    "Requests retried once on another replica because theirs died before the response began",
    ["model", "reason"],
    registry=REGISTRY,
)


def declare_models(models: Iterable[str]) -> None:
    """Create every series at 0, so a scrape shows the counter before the first retry."""
    for model in models:
        for reason in REASONS:
            RETRIES.labels(model=model, reason=reason)


def record_retry(model: str, reason: str) -> None:
    RETRIES.labels(model=model, reason=reason).inc()


def exposition() -> str:
    """Prometheus text of this process's request counters."""
    return generate_latest(REGISTRY).decode()
