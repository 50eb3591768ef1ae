"""Session-wide fixtures: the test environment and locally built models.

Shared helpers that are not fixtures (the transformers reference, the subprocess protocol,
compiled tiny models) are in :mod:`tests.helpers`.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# Test files that run in one xdist worker, one after another: the loopback "hosts"
# (127.0.0.10-12, sshd) and raylets on fixed addresses of tests/cluster, and beside them the
# other multi-raylet cluster under load (test_scaling_under_load): run at the same time, the
# two starved each other's raylets past Ray's hard-coded 30 s registration window (a `ray up`
# took 710 s instead of ~160 s); the one app that tests/reliability's files share (a
# package-scoped fixture); the two Serve apps of seven models each: a model replica is three
# processes (Serve replica, vLLM engine core, Ray worker actor), and the two apps side by side
# filled the 24 GiB machine until Ray's memory monitor killed the Serve controller.
MULTINODE = "tests/cluster + tests/serve/test_scaling_under_load.py"
SEVEN_MODEL_APPS = "tests/serve/test_openai_app.py + tests/serve/test_zoo_serve.py"
SERIAL_GROUPS = {
    "tests/cluster/": MULTINODE,
    "tests/serve/test_scaling_under_load.py": MULTINODE,
    "tests/reliability/": "tests/reliability",
    "tests/serve/test_openai_app.py": SEVEN_MODEL_APPS,
    "tests/serve/test_zoo_serve.py": SEVEN_MODEL_APPS,
}

# Seconds each unit of work took in an earlier `make test` on this 2-core machine (2 workers;
# eab8825, whose run prints this table at its end, "seconds per unit of work"), for units
# over 45 s; only the order depends on them (:func:`run_order`).
UNIT_SECONDS = {
    MULTINODE: 1786,
    SEVEN_MODEL_APPS: 1624,
    "tests/reliability": 1080,
    "tests/executor/test_ray_executor.py": 792,
    "tests/pipeline/test_pipeline.py": 736,
    "tests/serve/test_one_replica.py": 301,
    "tests/serve/test_cli_serve.py": 289,
    "tests/serve/test_prefix_affinity.py": 259,
    "tests/vllm_plugin/test_zoo_greedy.py": 211,
    "tests/vllm_plugin/test_vision_language.py": 189,
    "tests/vllm_plugin/test_spec_decode.py": 186,
    "tests/vllm_plugin/test_prefix_caching.py": 144,
    "tests/vllm_plugin/test_llm_greedy.py": 129,
    "tests/emulator/test_optimum_e2e.py": 96,
    "tests/test_foundation.py": 94,
    "tests/emulator/test_rebel_node.py": 88,
    "tests/serve/test_direct_routing.py": 86,
    "tests/vllm_plugin/test_embeddings.py": 75,
    "tests/vllm_plugin/test_vllm_serve.py": 75,
    "tests/peer/test_vllm_rbln.py": 69,
    "tests/vllm_plugin/test_host_kv_tier.py": 68,
    "tests/vllm_plugin/test_speech.py": 48,
}
# Units that start a Serve app, a Ray executor's actors or pipeline stages: a dozen or more
# processes importing vLLM at once. Beside one of them, the multi-node tests' raylets missed
# Ray's hard-coded 30 s window to register (`ray up`'s workers never joined), and a
# redeploy's replica starts outlasted its clients' read timeout.
STARTS_MANY_PROCESSES = ("tests/serve", "tests/reliability", "tests/executor", "tests/pipeline")


def run_order(unit: str) -> tuple[int, float]:
    """Where a unit goes in the hand-out order: the multi-node tests first, beside them the
    units that run one engine at a time (together about as long), then the rest; longest
    first within each, so that a long unit never starts last while the other worker idles
    (xdist's default order is most tests first); units not in :data:`UNIT_SECONDS` follow
    in file order."""
    if unit == MULTINODE:
        rank = 0
    elif unit.startswith(STARTS_MANY_PROCESSES):
        rank = 2
    else:
        rank = 1
    return rank, -UNIT_SECONDS.get(unit, 0)


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or its :data:`SERIAL_GROUPS` group."""
    path = nodeid.split("::", 1)[0]
    return next((g for p, g in SERIAL_GROUPS.items() if path.startswith(p)), path)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fast tier's marker on tests/unit (``pytest -m fast``); units in
    :func:`run_order` (a stable sort: tests keep their order within a unit)."""
    for item in items:
        if item.nodeid.startswith("tests/unit/"):
            item.add_marker(pytest.mark.fast)
    items.sort(key=lambda item: run_order(unit_of(item.nodeid)))


UNIT_TOTALS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Sum each unit's setup, call and teardown times (on xdist's controller, which gets
    every worker's reports), for :func:`pytest_terminal_summary`."""
    unit = unit_of(report.nodeid)
    UNIT_TOTALS[unit] = UNIT_TOTALS.get(unit, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: object) -> None:
    """Seconds per unit of work over 45 s: what :data:`UNIT_SECONDS` is refreshed from."""
    slow = sorted(((s, u) for u, s in UNIT_TOTALS.items() if s > 45), reverse=True)
    if slow:
        terminalreporter.write_sep("=", "seconds per unit of work (over 45 s)")
        for seconds, unit in slow:
            terminalreporter.write_line(f"{seconds:8.0f}  {unit}")


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``make test`` (``pytest -n N``): a unit of work (:func:`unit_of`) goes to one worker,
    so its module-scoped engines, clusters and Serve apps start once, and units are handed
    out in collection order (:func:`pytest_collection_modifyitems`)."""
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # keep run_order's order
    return FileScheduling(config, log)


@pytest.fixture(scope="session", autouse=True)
def test_environment() -> Iterator[None]:
    """The environment every test and the processes it starts run in, set for the session
    and restored after it (never at import):

    * the emulator (``RBLN_RAY_DEVICE=emulated``) on a private emulated node, so this
      session's device locks never meet another session's;
    * one OpenMP thread: tiny matmuls on a shared 2-core box are far faster single-threaded
      (no barriers), and children inherit it;
    * no tokenizers fork warning;
    * vLLM's ZMQ IPC sockets in a directory of the session, removed after it: a process the
      tests kill (a replica, an engine) leaves its socket files behind, which would otherwise
      pile up in /tmp.
    """
    ipc = Path(tempfile.mkdtemp(prefix="rbln-ray-ipc-"))  # short: a socket path has ~107 bytes
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_RPC_BASE_PATH", str(ipc))
        mp.setenv("RBLN_RAY_DEVICE", "emulated")
        mp.setenv("RBLN_RAY_NODE_ID", f"pytest-{uuid.uuid4().hex[:8]}")
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(threads)
    shutil.rmtree(ipc, ignore_errors=True)


@pytest.fixture(autouse=True)
def release_dropped_runtimes() -> Iterator[None]:
    """After each test, free runtimes a test dropped inside a reference cycle.

    An emulated device is held while a runtime object of this process lives; one dropped in
    a cycle (an optimum model's submodules reference each other) lives until Python's cyclic
    collector runs, and meanwhile every engine a later test starts in a subprocess is refused
    that device (seen once: 24 greedy tests failed with "device 0 ... is held by" the pytest
    worker). Collect when this process still holds a device, and say which test left it.
    """
    yield
    import gc
    import logging

    from rbln_ray.emulator import devices

    if devices.LEDGER.held_devices():
        gc.collect()
        still = devices.LEDGER.held_devices()
        if still:
            logging.getLogger(__name__).warning("devices %s still held after the test", still)


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    """One tiny random-weight model directory per supported family."""
    from rbln_ray.models import FAMILIES, build_tiny_model

    return {family: build_tiny_model(family=family) for family in FAMILIES}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Head (no RBLN) + 2 nodes × 2 RBLN; devices are 0..1 on each node. Yields the address.

    Module-scoped: the module's tests share it; it is torn down before the next module
    (later modules connect this process to Ray instances of their own)."""
    from tests.ray_cluster import DEVICES_PER_NODE, NODES, multinode_cluster

    with multinode_cluster(tmp_path_factory.mktemp("rbln-cache"), NODES, DEVICES_PER_NODE) as addr:
        yield addr
