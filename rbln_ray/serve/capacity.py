"""Before Serve schedules a model's replicas: could this cluster hold one at all?

Why: a Serve replica whose placement group cannot be placed is never started, so the bounded
wait of rbln-ray's executor (:mod:`rbln_ray.executor.placement`) never runs. Serve itself only
notes in the deployment's message that replicas "have taken more than 30s to be scheduled" and
keeps waiting (Ray 2.60, ``serve/_private/deployment_state.py``): a cluster whose workers lack
the ``RBLN`` resources a replica needs (``ray start`` without ``--resources '{"RBLN": N}'`` on
hosts where Ray does not detect the devices, or more devices per worker than any node has)
leaves ``serve deploy`` DEPLOYING forever.

So the app builder checks each model's replica bundles against the *total* resources of the
alive nodes. It waits up to the model's ``placement_timeout_s`` for nodes that can hold them
(workers may still be joining: ``ray up`` returns before the head's autoscaler has started
them) and otherwise fails the deploy naming what was asked and what the cluster has. Devices
that exist but are busy are not this check's business: Serve waits for those, as it should.

The failure is :class:`InfeasibleReplicaError`, a ``RayServeException``: Serve's build task
(Ray 2.60, ``build_serve_application``: ``max_retries=3, retry_exceptions=True``) retries any
other exception three times, each in a fresh worker that re-imports the app, but returns a
``RayServeException``'s message as the app's DEPLOY_FAILED status at once. An infeasible
cluster stays infeasible for a retry, so the first failure is final.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ray.serve.exceptions import RayServeException

from rbln_ray.executor.placement import PlacementError, cluster_summary

logger = logging.getLogger(__name__)

Bundle = dict[str, float]
POLL_S = 1.0


@dataclass(frozen=True)
class ReplicaShape:
    """One model's replica placement group, as the builder gives it to Serve."""

    model: str
    bundles: tuple[Bundle, ...]
    strategy: str
    timeout_s: float

    def describe(self) -> str:
        return f"placement group {list(self.bundles)} (strategy {self.strategy})"


class InfeasibleReplicaError(PlacementError, RayServeException):
    """No node set of the cluster can hold a model's replica (final: Serve does not retry)."""


def _fits(bundle: Bundle, free: Bundle) -> bool:
    return all(free.get(k, 0.0) >= v for k, v in bundle.items() if v > 0)


def _take(bundle: Bundle, free: Bundle) -> Bundle:
    return {k: free.get(k, 0.0) - bundle.get(k, 0.0) for k in set(free) | set(bundle)}


def placeable(bundles: Sequence[Bundle], strategy: str, nodes: Sequence[Bundle]) -> bool:
    """Whether ``bundles`` could be placed with ``strategy`` on empty ``nodes`` (totals).

    Exact search (replica groups are 1 + pipeline stages bundles): ``STRICT_PACK`` needs one
    node for all, ``STRICT_SPREAD`` a different node per bundle, ``PACK``/``SPREAD`` any.
    """
    if strategy == "STRICT_PACK":
        total: Bundle = {}
        for b in bundles:
            for k, v in b.items():
                total[k] = total.get(k, 0.0) + v
        return any(_fits(total, n) for n in nodes)
    distinct = strategy == "STRICT_SPREAD"
    order = sorted(bundles, key=lambda b: sorted(b.items()), reverse=True)

    def search(i: int, free: list[Bundle], used: frozenset[int]) -> bool:
        if i == len(order):
            return True
        seen: set[tuple] = set()
        for j, node in enumerate(free):
            key = tuple(sorted(node.items()))
            if (distinct and j in used) or key in seen or not _fits(order[i], node):
                continue
            seen.add(key)  # identical free nodes are interchangeable
            rest = free[:j] + [_take(order[i], node)] + free[j + 1 :]
            if search(i + 1, rest, used | {j}):
                return True
        return False

    return search(0, [dict(n) for n in nodes], frozenset())


def alive_node_totals() -> list[Bundle]:
    """Total resources of every alive node of the connected cluster."""
    import ray

    return [
        {k: float(v) for k, v in n.get("Resources", {}).items()}
        for n in ray.nodes()
        if n.get("Alive")
    ]


def wait_placeable(
    shapes: Sequence[ReplicaShape],
    nodes: Callable[[], list[Bundle]] = alive_node_totals,
    summary: Callable[[], str] = cluster_summary,
) -> None:
    """Return once every shape fits the cluster; raise :class:`InfeasibleReplicaError` for
    the first that still does not fit after its ``timeout_s``."""
    started = time.monotonic()
    pending = list(shapes)
    logged = False
    while pending:
        totals = nodes()
        pending = [s for s in pending if not placeable(s.bundles, s.strategy, totals)]
        if not pending:
            return
        waited = time.monotonic() - started
        late = [s for s in pending if waited >= s.timeout_s]
        if late:
            s = late[0]
            raise InfeasibleReplicaError(
                f"model {s.model}: no node of this cluster can hold a replica's "
                f"{s.describe()} within placement_timeout_s={s.timeout_s:g} (waited "
                f"{waited:.0f} s); {summary()}"
            )
        if not logged:
            logger.warning(
                "waiting up to %g s for nodes that can hold %s",
                max(s.timeout_s for s in pending),
                "; ".join(f"model {s.model}: {s.describe()}" for s in pending),
            )
            logged = True
        time.sleep(POLL_S)  # polling the cluster's nodes, bounded by timeout_s
