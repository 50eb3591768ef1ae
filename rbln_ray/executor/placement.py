"""Placement of RBLN worker actors: one bundle ``{"RBLN": devices_per_worker, "CPU": 1}`` each.

Why a placement group: it reserves all of an engine's devices atomically (no half-started
engine holding devices another engine needs) and ties each worker to one node, so a shard
group's devices are on one host. Waiting is bounded: an unsatisfiable request fails with what
was asked and what the cluster has, instead of hanging the engine start.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rbln_ray.vllm_plugin.options import PREFIX, PlacementSettings, engine_options

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

DEVICE_KEY = "RBLN"  # Ray's built-in resource name for RBLN NPUs


class PlacementError(RuntimeError):
    """The cluster cannot (or did not in time) provide the devices the engine needs."""


def num_workers(vllm_config: VllmConfig) -> int:
    """How many worker actors the engine has: one per pipeline stage.

    The single place the worker count comes from: the compiled artifact's stage count
    (``rbln_pipeline.json``; 1 for an optimum-rbln artifact).
    """
    from rbln_ray.vllm_plugin.platform import compiled_model

    return compiled_model(vllm_config).num_stages


@dataclass(frozen=True)
class PlacementPlan:
    """What one engine asks of the cluster."""

    num_workers: int
    devices_per_worker: int
    settings: PlacementSettings = field(default_factory=PlacementSettings)

    @property
    def strategy(self) -> str:
        return self.settings.placement_strategy

    @property
    def timeout_s(self) -> float:
        return self.settings.placement_timeout_s

    @classmethod
    def from_config(cls, vllm_config: VllmConfig, devices_per_worker: int) -> PlacementPlan:
        settings = engine_options(vllm_config).placement()
        return cls(num_workers(vllm_config), devices_per_worker, settings)

    def bundles(self) -> list[dict[str, float]]:
        return [
            {DEVICE_KEY: float(self.devices_per_worker), "CPU": 1.0}
            for _ in range(self.num_workers)
        ]

    def describe(self) -> str:
        workers = "worker" if self.num_workers == 1 else "workers"
        devices = "device" if self.devices_per_worker == 1 else "devices"
        return (
            f"{self.num_workers} {workers} × {self.devices_per_worker} {DEVICE_KEY} {devices} "
            f"(+1 CPU each, strategy {self.strategy})"
        )


def cluster_summary() -> str:
    """RBLN and CPU per alive node, total and currently free, for error messages."""
    import ray

    try:
        free = ray.available_resources()
        total = ray.cluster_resources()
        rows = []
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            res = node.get("Resources", {})
            rows.append(
                f"node {node['NodeID'][:8]} ({node.get('NodeManagerAddress')}): "
                f"{res.get(DEVICE_KEY, 0):g} {DEVICE_KEY}, {res.get('CPU', 0):g} CPU"
            )
    except Exception as e:  # noqa: BLE001 - the summary must never mask the real error
        return f"(cluster resources unavailable: {e})"
    return (
        f"cluster has {total.get(DEVICE_KEY, 0):g} {DEVICE_KEY} in total, "
        f"{free.get(DEVICE_KEY, 0):g} free; per node: " + "; ".join(rows)
    )


def _usable_bundles(pg: PlacementGroup, plan: PlacementPlan) -> list[int]:
    return [
        i
        for i, spec in enumerate(pg.bundle_specs)
        if spec.get(DEVICE_KEY, 0) >= plan.devices_per_worker
    ]


def acquire(existing: PlacementGroup | None, plan: PlacementPlan) -> tuple[Any, list[int], bool]:
    """Return ``(placement group, bundle index per worker, created_here)``.

    Reuses ``existing`` (a Serve replica's group, or the caller's current group) when given;
    otherwise creates one and waits at most ``plan.timeout_s`` for it, removing it on timeout.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if existing is not None:
        usable = _usable_bundles(existing, plan)
        if len(usable) < plan.num_workers:
            raise PlacementError(
                f"the placement group provided for this engine has bundles "
                f"{existing.bundle_specs}; it needs {plan.describe()}"
            )
        logger.info("using the existing placement group, bundles %s", usable[: plan.num_workers])
        return existing, usable[: plan.num_workers], False

    pg = placement_group(plan.bundles(), strategy=plan.strategy)
    logger.info("waiting up to %.0f s for %s", plan.timeout_s, plan.describe())
    try:
        ready, _ = ray.wait([pg.ready()], timeout=plan.timeout_s)
    except BaseException:
        remove_placement_group(pg)
        raise
    if not ready:
        remove_placement_group(pg)
        raise PlacementError(
            f"could not place {plan.describe()} within {plan.timeout_s:g} s "
            f"({PREFIX}placement_timeout_s); {cluster_summary()}"
        )
    return pg, list(range(plan.num_workers)), True
