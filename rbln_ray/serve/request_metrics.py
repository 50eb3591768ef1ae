"""The ingress's own request counter, ``rbln_request_retries`` (Prometheus:
``ray_rbln_request_retries_total``), through Ray's metrics pipeline.

Why a module of its own: the counter is the ingress's (which request it retried, and why), not
an engine's. Ray's metrics agent on the ingress replica's node exports it with every other
Ray metric; nothing of rbln-ray's moves it.
"""

from __future__ import annotations

from functools import cache
from typing import Any

# Why a retry happened (the values of the ``reason`` tag).
REPLICA_DIED = "replica_died"  # the replica's actor died (killed, crashed, node lost)
ENGINE_DIED = "engine_died"  # the replica lived, its engine did not (e.g. a worker died)


@cache
def _retries() -> Any:
    # Created on first use, inside the ingress replica (a Ray actor), where it is exported.
    from ray.util.metrics import Counter

    return Counter(
        "rbln_request_retries",
        description="Requests retried once on another replica because theirs died before "
        "the response began",
        tag_keys=("model", "reason"),
    )


def record_retry(model: str, reason: str) -> None:
    _retries().inc(1, tags={"model": model, "reason": reason})
