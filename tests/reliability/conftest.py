"""A two-replica app of a tiny compiled Llama for fault, cancellation, fuzz and soak tests,
and beside it the same model disaggregated (one prefill and one decode replica)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import compiled_model
from tests.serve.conftest import RunningApp, free_port, start_app, stop_app

MODEL = "tiny"
# The app's step deadline (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS; vLLM's default is 300 s): short,
# so the frozen-worker test ends in time, and still far above any step of the tiny model.
STEP_DEADLINE_S = 20
# A token id whose prefill raises in the worker (RBLN_RAY_TEST_STEP_FAULT): the poison
# request of the fault tests; no other prompt of this package holds it.
POISON_TOKEN = 4093
BODY_DEADLINE_S = 5  # limits.body_read_timeout_s of the app
PD_MODEL = "tiny-pd"  # the tiny model again, disaggregated: pd {prefill 1, decode 1}
PREFILL_TIMEOUT_S = 20  # its pd.prefill_timeout_s: short, so a killed prefill pool costs little


@pytest.fixture(scope="package")
def pd_tier() -> Iterator[Path]:
    """The host KV tier of the app's disaggregated model (its handover)."""
    tier = Path(tempfile.mkdtemp(prefix="rbln-ray-pd-tier-"))
    yield tier
    shutil.rmtree(tier, ignore_errors=True)


@pytest.fixture(scope="package")
def tiny_app(pd_tier: Path) -> Iterator[RunningApp]:
    """One app for the package's files (they run in one xdist worker: tests/conftest.py's
    SERIAL_GROUPS); each test leaves it serving with both replicas up."""
    kv = {"kv_connector": "RBLNHostKVConnector",
          "kv_connector_extra_config": {"host_gib": 0.25, "root": str(pd_tier)}}  # fmt: skip
    pd = {"prefill_replicas": 1, "decode_replicas": 1, "prefill_timeout_s": PREFILL_TIMEOUT_S}
    config = {
        "models": [
            {"name": MODEL, "model": str(compiled_model("llama")), "num_replicas": 2},
            # test_disaggregation: the same model, prefill and decode on separate replicas
            {
                "name": PD_MODEL,
                "model": str(compiled_model("llama")),
                "pd": pd,
                "engine_kwargs": {"kv_transfer_config": kv},
            },
        ],
        # a short read deadline: the stalled-body test waits for its 408
        "limits": {"max_n": 4, "max_tokens": 1000, "body_read_timeout_s": BODY_DEADLINE_S},
    }
    with pytest.MonkeyPatch.context() as mp:
        # read by the engine cores the replicas start (they inherit Ray's worker environment)
        mp.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(STEP_DEADLINE_S))
        mp.setenv("RBLN_RAY_TEST_STEP_FAULT", str(POISON_TOKEN))
        app = start_app(config, free_port(), compiled_model("llama"), devices=6)
        try:
            yield app
        finally:
            stop_app()


def wait_until(predicate, timeout: float, interval: float = 0.5, what: str = "") -> float:
    """Poll ``predicate`` until true; return the seconds it took; fail after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"timed out after {timeout} s: {what}"
        time.sleep(interval)  # polling interval
    return time.monotonic() - start


def replica_stats(app: RunningApp, want: int = 2) -> dict[str, dict]:
    """engine_stats of every replica of the tiny model (Serve routes each call to one)."""
    from ray import serve

    handle = serve.get_deployment_handle(f"LLMServer:{MODEL}", "rbln-ray")
    found: dict[str, dict] = {}
    for _ in range(80):  # a replica missing after 80 random routings: p = 2^-80
        stats = handle.engine_stats.remote().result()
        found[stats["actor_name"]] = stats
        if len(found) == want:
            break
    return found
