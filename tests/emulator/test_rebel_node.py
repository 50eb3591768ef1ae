"""REBEL per Ray node: a node started with ``RBLN_RAY_EMULATED_NPU=rebel`` is a REBEL node
(Ray's own accelerator probe labels it, its workers' ``rebel`` reports RBLN-CR13) while the
other node of the same cluster stays ATOM."""

from __future__ import annotations

import os

import pytest

from rbln_ray.emulator import ensure_runtime
from rbln_ray.npu import kinds

pytestmark = pytest.mark.multinode


@pytest.fixture
def mixed_cluster(tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    saved = dict(os.environ)
    os.environ.update(
        RBLN_RAY_DEVICE="emulated", RBLN_RAY_CACHE=str(tmp_path), RAY_USAGE_STATS_ENABLED="0"
    )
    os.environ.pop(kinds.KIND_ENV, None)
    ensure_runtime()  # raylets and workers inherit the emulator's PYTHONPATH shim
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"RBLN": 0}}
    )
    try:
        cluster.add_node(num_cpus=1, resources={"RBLN": 1})
        os.environ[kinds.KIND_ENV] = "rebel"  # this node's environment only
        cluster.add_node(num_cpus=1, resources={"RBLN": 1})
        os.environ.pop(kinds.KIND_ENV)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield ray
    finally:
        ray.shutdown()
        cluster.shutdown()
        os.environ.clear()
        os.environ.update(saved)


def test_each_node_reports_its_own_kind(mixed_cluster):
    ray = mixed_cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=1, resources={"RBLN": 1})
    def npu_name() -> str:
        from rbln_ray.emulator import ensure_runtime

        ensure_runtime()
        import rebel

        return rebel.get_npu_name(0)

    seen = {}
    for node in ray.nodes():
        if not node["Alive"] or not node["Resources"].get("RBLN"):
            continue
        labels = [
            r.split(":", 1)[1] for r in node["Resources"] if r.startswith("accelerator_type:")
        ]
        strategy = NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False)
        seen[node["NodeID"]] = (
            labels,
            ray.get(npu_name.options(scheduling_strategy=strategy).remote()),
        )
    assert sorted(seen.values()) == [(["RBLN-CA25"], "RBLN-CA25"), (["RBLN-CR13"], "RBLN-CR13")]
