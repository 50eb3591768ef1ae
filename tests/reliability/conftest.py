"""A two-replica app of a tiny compiled Llama for fault, cancellation, fuzz and soak tests."""

from __future__ import annotations

import time
from collections.abc import Iterator

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


@pytest.fixture(scope="package")
def tiny_app() -> Iterator[RunningApp]:
    """One app for the package's files (they run in one xdist worker: tests/conftest.py's
    SERIAL_GROUPS); each test leaves it serving with both replicas up."""
    config = {
        "models": [{"name": MODEL, "model": str(compiled_model("llama")), "num_replicas": 2}],
        # a short read deadline: the stalled-body test waits for its 408
        "limits": {"max_n": 4, "max_tokens": 1000, "body_read_timeout_s": BODY_DEADLINE_S},
    }
    with pytest.MonkeyPatch.context() as mp:
        # read by the engine cores the replicas start (they inherit Ray's worker environment)
        mp.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(STEP_DEADLINE_S))
        mp.setenv("RBLN_RAY_TEST_STEP_FAULT", str(POISON_TOKEN))
        app = start_app(config, free_port(), compiled_model("llama"))
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
