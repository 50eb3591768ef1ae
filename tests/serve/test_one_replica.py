"""One tiny Llama replica behind the Serve app (the smoke tier's app): a request through the
`openai` client equals transformers, bad input is an OpenAI-style 4xx, and beyond the
replica's admission and queue limits the app answers 429, cleanly.

The replica's engine runs on the RBLN Ray executor on an emulated device, so this one app
covers an engine on the emulator, Ray executor steps and a Serve request end to end.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers import compiled_model, hf_greedy
from tests.serve.conftest import RunningApp, free_port, start_app, stop_app

pytestmark = [pytest.mark.slow, pytest.mark.smoke]


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


def test_completion_through_the_openai_client_equals_transformers(
    narrow_app: RunningApp,
) -> None:
    import openai

    from rbln_ray.models import build_tiny_model

    client = openai.OpenAI(base_url=f"{narrow_app.url}/v1", api_key="unused", max_retries=0)
    prompt = [5, 6, 7, 300, 1200]
    out = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    got = [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]
    assert got == hf_greedy(build_tiny_model(family="llama"), [prompt], 12)[0]


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"model": "tiny", "prompt": [5] * 600, "max_tokens": 4}, 400, "context"),
        ({"model": "nope", "prompt": [5], "max_tokens": 4}, 404, "nope"),
        ({"model": "tiny", "prompt": [5], "max_tokens": -1}, 400, "max_tokens"),
    ],
)
def test_bad_input_is_an_openai_style_4xx(
    narrow_app: RunningApp, body: dict, status: int, needle: str
) -> None:
    r = httpx.post(f"{narrow_app.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["type"] and needle in error["message"].lower()


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
