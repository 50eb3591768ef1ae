"""How many ingress replicas a fleet needs, from measured CPU per streamed token and the
router's own measured work per request.

An ingress replica is one process: one event loop relays its streams and runs its router
(the router runs in every process holding the model's deployment handle), so it has one
core, planned to be busy at most ``target_utilization`` of the time. Its CPU per second is

    streamed tokens/s x CPU per streamed token (BENCHMARKS 16)
  + requests/s x (the router's read and decision CPU per request, measured)
  + report broadcasts/s x (unpickling one broadcast of every replica's report, and the
    router's re-index of it: both measured, and paid by every ingress replica)

The first two are shared among the ingress replicas; the last is not, so past some fleet
size adding ingress replicas stops helping (:func:`replicas_needed` says so).

BENCHMARKS 16 measured the ingress process of one replica relaying 256 concurrent streams
(768 requests, 196,608 streamed tokens): 121.45 CPU-seconds in Serve's default mode, 18.82
in its high-throughput mode (``RAY_SERVE_THROUGHPUT_OPTIMIZED``: HAProxy in front, gRPC
between deployments). Its requests were 256 tokens long, so its per-request work is folded
into the per-token figure (about 0.6 and 0.1 ms per token); for shorter answers that
under-counts what a request costs beyond its tokens, by up to its parse and validation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# BENCHMARKS 16 (benchmarks/results/ingress_streams*.json): ingress CPU-seconds / tokens.
STREAMED_TOKENS = 196_608
DEFAULT_MODE_CPU_S = 121.45
THROUGHPUT_MODE_CPU_S = 18.82


@dataclass(frozen=True)
class IngressCosts:
    cpu_s_per_token: float = DEFAULT_MODE_CPU_S / STREAMED_TOKENS
    target_utilization: float = 0.8


DEFAULT_MODE = IngressCosts()
THROUGHPUT_MODE = IngressCosts(THROUGHPUT_MODE_CPU_S / STREAMED_TOKENS)


def ingress_cpu(
    tokens_per_s: float,
    requests_per_s: float,
    router_s_per_request: float,
    broadcasts_per_s: float,
    router_s_per_broadcast: float,
    costs: IngressCosts = DEFAULT_MODE,
) -> float:
    """Cores the whole ingress deployment keeps busy."""
    return (
        tokens_per_s * costs.cpu_s_per_token
        + requests_per_s * router_s_per_request
        + broadcasts_per_s * router_s_per_broadcast
    )


def replicas_needed(
    tokens_per_s: float,
    requests_per_s: float,
    router_s_per_request: float,
    broadcasts_per_s: float,
    router_s_per_broadcast: float,
    costs: IngressCosts = DEFAULT_MODE,
) -> int:
    """The smallest number of ingress replicas ``k`` whose CPU fits: the streams and the
    routers' per-request work are shared among them, every one of them re-indexes every
    broadcast."""
    shared = ingress_cpu(tokens_per_s, requests_per_s, router_s_per_request, 0, 0, costs)
    per_replica = broadcasts_per_s * router_s_per_broadcast
    budget = costs.target_utilization
    if per_replica >= budget:
        raise ValueError(
            f"re-indexing alone keeps an ingress replica {per_replica:.2f} cores busy "
            f"(target {budget}): no number of ingress replicas fits"
        )
    return max(1, math.ceil(shared / (budget - per_replica)))
