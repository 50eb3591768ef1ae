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

# Seconds each unit of work took in an earlier `make test` on this 2-core machine (2 workers,
# a fresh clone with an empty compile cache, as CI runs it: f4b2d28, whose run prints this
# table at its end, "seconds per unit of work"), for units over 45 s; only the order depends
# on them. xdist hands units out longest first, so a long one never starts last while the
# other worker idles (xdist's default order is most tests first); units not listed follow in
# file order.
UNIT_SECONDS = {
    MULTINODE: 2554,
    SEVEN_MODEL_APPS: 1359,
    "tests/reliability": 884,
    "tests/pipeline/test_pipeline.py": 446,
    "tests/executor/test_ray_executor.py": 423,
    "tests/serve/test_prefix_affinity.py": 377,
    "tests/serve/test_cli_serve.py": 328,
    "tests/serve/test_one_replica.py": 223,
    "tests/vllm_plugin/test_spec_decode.py": 199,
    "tests/vllm_plugin/test_vision_language.py": 177,
    "tests/vllm_plugin/test_prefix_caching.py": 175,
    "tests/vllm_plugin/test_zoo_greedy.py": 167,
    "tests/vllm_plugin/test_llm_greedy.py": 139,
    "tests/emulator/test_optimum_e2e.py": 102,
    "tests/test_foundation.py": 102,
    "tests/vllm_plugin/test_vllm_serve.py": 95,
    "tests/peer/test_vllm_rbln.py": 80,
    "tests/vllm_plugin/test_embeddings.py": 79,
    "tests/vllm_plugin/test_lora_quant_llm.py": 52,
    "tests/vllm_plugin/test_host_kv_tier.py": 47,
}


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or its :data:`SERIAL_GROUPS` group."""
    path = nodeid.split("::", 1)[0]
    return next((g for p, g in SERIAL_GROUPS.items() if path.startswith(p)), path)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fast tier's marker on tests/unit (``pytest -m fast``); longest units first (a
    stable sort: tests keep their order within a unit)."""
    for item in items:
        if item.nodeid.startswith("tests/unit/"):
            item.add_marker(pytest.mark.fast)
    items.sort(key=lambda item: -UNIT_SECONDS.get(unit_of(item.nodeid), 0))


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

    config.option.loadscopereorder = False  # keep the longest-first order
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
