"""RBLNRayExecutor on a 2-node × 2-RBLN Ray cluster on this machine (issue #5 acceptance).

One cluster is shared by the module. Each scenario runs ``engine_script.py`` in a fresh
process (vLLM and Ray keep per-process state), connected to the cluster through
``RAY_ADDRESS`` unless the scenario tests the driver-initialised path.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from rbln_ray.executor import PlacementPlan
from rbln_ray.vllm_plugin.options import PlacementSettings
from tests.helpers import hf_greedy
from tests.ray_cluster import ENGINE_ENV, run_engine_script, wait_all_rbln_free

SCRIPT = Path(__file__).with_name("engine_script.py")
PROMPTS = [[1, 17, 42, 99, 7], [5, 6, 7, 8, 9, 10, 11], [300, 200, 100]]
MAX_TOKENS = 12


# -- no cluster needed ------------------------------------------------------------------------


def test_plan_bundles_and_description() -> None:
    plan = PlacementPlan(num_workers=1, devices_per_worker=5)
    assert plan.bundles() == [{"RBLN": 5.0, "CPU": 1.0}]
    assert "1 worker × 5 RBLN devices" in plan.describe()


# -- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Compiled tiny Llama for 1 and 2 devices, and a 5-device one no node can host."""
    os.environ.update(ENGINE_ENV)
    from rbln_ray.compile import CompileSettings, compile_hf_model
    from rbln_ray.emulator import ensure_runtime
    from rbln_ray.models import build_tiny_model

    ensure_runtime()
    root = tmp_path_factory.mktemp("executor-artifacts")
    hf = build_tiny_model(family="llama")
    out = {"hf": Path(hf)}
    for n in (1, 2):
        out[f"nd{n}"] = root / f"nd{n}"
        settings = CompileSettings(
            batch_size=4, max_seq_len=512, decoder_batch_sizes=(4, 2, 1), num_devices=n
        )
        compile_hf_model(hf, out[f"nd{n}"], settings)
    # Placement fails before anything loads, so a relabelled copy is enough.
    nd5 = root / "nd5"
    shutil.copytree(out["nd1"], nd5)
    cfg = json.loads((nd5 / "rbln_config.json").read_text())
    for compile_cfg in cfg["_compile_cfgs"]:
        compile_cfg["num_devices"] = 5
    (nd5 / "rbln_config.json").write_text(json.dumps(cfg))
    out["nd5"] = nd5
    return out


def run_script(address: str, spec: dict, timeout: float = 600) -> dict:
    return run_engine_script(SCRIPT, address, spec, timeout)


@pytest.fixture(scope="module")
def reference(artifacts: dict[str, Path]) -> list[list[int]]:
    return hf_greedy(artifacts["hf"], PROMPTS, MAX_TOKENS)


# -- acceptance -----------------------------------------------------------------------------


@pytest.mark.multinode
@pytest.mark.slow
def test_four_engines_one_per_device(cluster, artifacts, reference) -> None:
    """Acceptance 1 + 2: four engines (``"ray"``, class, qualname) alive and serving at once,
    one per (node, device), outputs equal to transformers' and the uni executor's (a fifth
    engine in the same driver, on the driver's own emulated device).

    The driver connects with ``ray.init`` and no ``RAY_ADDRESS`` (``ray_init``): the spawned
    engine cores must use the same cluster (the platform records the address before spawning);
    the other tests' drivers find it through ``RAY_ADDRESS``."""
    import ray

    workers = {n["NodeID"] for n in ray.nodes() if n["Resources"].get("RBLN")}
    result = run_script(
        cluster,
        {
            "model": str(artifacts["nd1"]),
            "prompts": PROMPTS,
            "max_tokens": MAX_TOKENS,
            "backends": ["ray", "class", "qualname", "ray", "uni"],
            "ray_init": True,
        },
    )
    *ray_engines, uni = result["engines"]
    assert uni["tokens"] == reference
    # vLLM's in-process worker builds each step's inputs between device calls; the Ray
    # workers' step loops build decode inputs while the previous step is on the device.
    assert uni["stats"][0]["decode_inputs_ahead"] == 0
    placed = set()
    for engine in ray_engines:
        assert engine["tokens"] == reference
        (stats,) = engine["stats"]
        assert stats["decode_inputs_ahead"] > stats["decode_steps"] // 2, stats
        (info,) = engine["devices"]
        assert info["device_ids"] == [0] and info["node"] in workers
        placed.add((info["node"], info["rbln_devices"]))
    assert len(placed) == 4, placed
    assert len({node for node, _ in placed}) == 2
    assert {dev for _, dev in placed} == {"0", "1"}
    assert wait_all_rbln_free() == 4


@pytest.mark.multinode
@pytest.mark.slow
def test_shard_group_gets_two_devices_of_one_node(cluster, artifacts, reference) -> None:
    """Acceptance 3: a num_devices=2 artifact → one actor holding both devices of a node."""
    result = run_script(
        cluster,
        {"model": str(artifacts["nd2"]), "prompts": PROMPTS, "max_tokens": MAX_TOKENS},
    )
    (engine,) = result["engines"]
    (info,) = engine["devices"]
    assert sorted(info["rbln_devices"].split(",")) == ["0", "1"]
    assert info["device_ids"] == [0, 1]
    assert engine["tokens"] == reference
    assert wait_all_rbln_free() == 4


@pytest.mark.multinode
@pytest.mark.slow
def test_killed_worker_fails_requests_fast_and_frees_devices(cluster, artifacts) -> None:
    """Acceptance 4: SIGKILL the worker mid-generation → every in-flight request errors
    within 30 s, nothing hangs, the device is released, and a new engine serves."""
    result = run_script(
        cluster,
        {
            "scenario": "kill",
            "model": str(artifacts["nd1"]),
            "prompts": PROMPTS,
            "max_tokens": 400,
        },
    )
    print({k: v for k, v in result.items() if k != "stderr"})
    assert result["pending"] == 0
    assert len(result["errors"]) == len(PROMPTS)
    assert all("finished without error" not in e for e in result["errors"]), result["errors"]
    assert result["error_s"] < 30, result
    assert result["holder_after_shutdown"] is None
    assert result["restart_tokens"], result
    assert wait_all_rbln_free() == 4


@pytest.mark.multinode
@pytest.mark.slow
def test_unplaceable_request_fails_with_clear_message(cluster, artifacts) -> None:
    """Acceptance 5: 5 devices on a 4-device cluster fail within the configured timeout."""
    timeout_s = 5
    result = run_script(
        cluster,
        {
            "scenario": "placement",
            "model": str(artifacts["nd5"]),
            "additional_config": {"rbln_placement_timeout_s": timeout_s},
        },
    )
    assert result["error"] is not None
    # The driver gets vLLM's "Engine core initialization failed"; the cause is in the engine
    # core's log, which shares the script's stderr.
    assert "PlacementError" in result["stderr"]
    assert "1 worker × 5 RBLN devices" in result["stderr"]
    assert "cluster has 4 RBLN in total" in result["stderr"]
    assert result["elapsed_s"] < timeout_s + 60, result
    assert wait_all_rbln_free() == 4


@pytest.mark.multinode
@pytest.mark.slow
def test_placement_error_message_names_request_and_cluster(cluster) -> None:
    """The placement error states what was asked and what each node has, within the bound."""
    from rbln_ray.executor import placement

    plan = PlacementPlan(1, 5, PlacementSettings(placement_timeout_s=2))
    t0 = time.monotonic()
    with pytest.raises(placement.PlacementError) as err:
        placement.acquire(None, plan)
    assert time.monotonic() - t0 < 10
    message = str(err.value)
    assert "1 worker × 5 RBLN devices" in message
    assert "cluster has 4 RBLN in total" in message
    assert message.count("2 RBLN") == 2  # both worker nodes listed
    assert wait_all_rbln_free() == 4
