"""Back-pressure: beyond a replica's admission and queue limits the app answers 429, cleanly."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers import compiled_model
from tests.serve.conftest import RunningApp, free_port, start_app, stop_app

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def narrow_app() -> Iterator[RunningApp]:
    """One replica that takes 1 request at a time and lets 1 more wait."""
    config = {
        "models": [
            {
                "name": "tiny",
                "model": str(compiled_model("llama")),
                "num_replicas": 1,
                "max_ongoing_requests": 1,
                "max_queued_requests": 1,
            }
        ]
    }
    app = start_app(config, free_port(), compiled_model("llama"))
    try:
        yield app
    finally:
        stop_app()


def test_overload_gets_429_with_an_openai_error_and_serving_continues(
    narrow_app: RunningApp,
) -> None:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 48, "ignore_eos": True}

    def one(_: int) -> httpx.Response:
        return httpx.post(f"{narrow_app.url}/v1/completions", json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(one, range(8)))
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429}, codes  # nothing lost, nothing 5xx
    for r in responses:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 48
        else:
            error = r.json()["error"]
            assert error["code"] == 429 and "capacity" in error["message"], error
    after = httpx.post(f"{narrow_app.url}/v1/completions", json=body, timeout=120)
    assert after.status_code == 200, after.text
