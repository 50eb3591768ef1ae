"""The app builder's check that a replica's placement group fits the cluster at all."""

from __future__ import annotations

import time

import pytest

from rbln_ray.executor.placement import PlacementError
from rbln_ray.serve import capacity
from rbln_ray.serve.capacity import ReplicaShape, placeable, wait_placeable

REPLICA = [{"CPU": 1}, {"RBLN": 1, "CPU": 1}]
HEAD = {"CPU": 1}
WORKER = {"CPU": 2, "RBLN": 2}


@pytest.mark.parametrize(
    ("bundles", "strategy", "nodes", "expected"),
    [
        (REPLICA, "PACK", [HEAD, WORKER, WORKER], True),
        (REPLICA, "PACK", [HEAD, {"CPU": 2}, {"CPU": 2}], False),  # no RBLN anywhere
        ([{"CPU": 1}, {"RBLN": 4, "CPU": 1}], "PACK", [HEAD, WORKER], False),  # too many
        # Two stages of 2 devices: one per worker, not both on one.
        ([{"CPU": 1}, {"RBLN": 2, "CPU": 1}, {"RBLN": 2, "CPU": 1}], "PACK", [WORKER], False),
        ([{"CPU": 1}, {"RBLN": 2, "CPU": 1}, {"RBLN": 2, "CPU": 1}], "PACK",
         [WORKER, WORKER], True),
        ([{"CPU": 1}, {"RBLN": 2, "CPU": 1}], "STRICT_PACK", [WORKER], True),
        ([{"CPU": 1}, {"RBLN": 2, "CPU": 2}], "STRICT_PACK", [HEAD, WORKER], False),
        ([{"RBLN": 1, "CPU": 1}, {"RBLN": 1, "CPU": 1}], "STRICT_SPREAD", [WORKER], False),
        ([{"RBLN": 1, "CPU": 1}, {"RBLN": 1, "CPU": 1}], "STRICT_SPREAD",
         [WORKER, WORKER], True),
        ([{"CPU": 1}, {"RBLN": 1, "CPU": 1}], "SPREAD", [HEAD, {"RBLN": 1, "CPU": 1}], True),
    ],
)  # fmt: skip
def test_placeable(bundles, strategy, nodes, expected):
    assert placeable(bundles, strategy, nodes) is expected


def shape(timeout_s: float) -> ReplicaShape:
    return ReplicaShape("demo", tuple(REPLICA), "PACK", timeout_s)


def test_wait_returns_once_the_workers_join(monkeypatch):
    monkeypatch.setattr(capacity, "POLL_S", 0.01)
    views = iter([[HEAD], [HEAD, {"CPU": 2}], [HEAD, WORKER]])
    wait_placeable([shape(30)], nodes=lambda: next(views), summary=lambda: "n/a")


def test_wait_fails_after_the_timeout_naming_asked_and_available(monkeypatch):
    monkeypatch.setattr(capacity, "POLL_S", 0.01)
    started = time.monotonic()
    with pytest.raises(PlacementError) as err:
        wait_placeable(
            [shape(0.3)], nodes=lambda: [HEAD, {"CPU": 2}], summary=lambda: "cluster has 0 RBLN"
        )
    assert 0.3 <= time.monotonic() - started < 5
    message = str(err.value)
    assert "model demo" in message and str(REPLICA) in message
    assert "placement_timeout_s=0.3" in message and message.endswith("cluster has 0 RBLN")


def test_the_failure_is_final_for_serve():
    # Serve's build task returns a RayServeException's message as DEPLOY_FAILED at once and
    # retries any other exception three times (each re-importing the app).
    from ray.serve.exceptions import RayServeException

    with pytest.raises(RayServeException):
        wait_placeable([shape(0)], nodes=lambda: [HEAD], summary=lambda: "")
