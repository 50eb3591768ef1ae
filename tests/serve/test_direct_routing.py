"""``routing: direct`` (:mod:`rbln_ray.serve.direct`): the model's replica is the app's HTTP
ingress, with no ingress deployment in front of it. Through the `openai` client a completion
and a streamed completion equal transformers'; the ingress's checks answer from the replica
as they do from the routed app's ingress (the API key, an unknown model, the token limit,
health); beyond the replica's admission and queue limits Serve's proxy answers 429; the
Python client's handle reaches the same replica; the app has one deployment.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.helpers import compiled_model, hf_greedy
from tests.serve.conftest import RunningApp, free_port, overload, start_app, stop_app

pytestmark = pytest.mark.slow

API_KEY = "direct-secret"
PROMPT = [5, 6, 7, 300, 1200]


@pytest.fixture(scope="module")
def direct_app() -> Iterator[RunningApp]:
    from rbln_ray.models import build_tiny_model

    config = {
        "routing": "direct",
        "api_key": API_KEY,
        "models": [
            {
                "name": "tiny",
                "model": str(compiled_model()),
                "num_replicas": 1,
                "max_ongoing_requests": 1,  # one request at a time, one more waits
                "max_queued_requests": 1,
            }
        ],
    }
    app = start_app(config, free_port(), build_tiny_model(family="llama"), devices=1)
    try:
        yield app
    finally:
        stop_app()


def test_completions_through_the_openai_client_equal_transformers(direct_app: RunningApp) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{direct_app.url}/v1", api_key=API_KEY, max_retries=0)
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 1,
          "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}}  # fmt: skip
    expected = hf_greedy(direct_app.model_dir, [PROMPT], 12)[0]

    out = client.completions.create(**kw)
    assert [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens] == expected

    streamed = []
    for chunk in client.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            streamed += [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
    assert streamed == expected


@pytest.mark.parametrize(
    ("headers", "body", "status", "needle"),
    [
        ({}, {"model": "tiny", "prompt": [5], "max_tokens": 4}, 401, "api key"),
        (None, {"model": "nope", "prompt": [5], "max_tokens": 4}, 404, "nope"),
        (None, {"model": "tiny", "prompt": [5], "max_tokens": 10**6}, 400, "max_tokens"),
    ],
)
def test_the_ingress_checks_answer_from_the_replica(
    direct_app: RunningApp, headers: dict | None, body: dict, status: int, needle: str
) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"} if headers is None else headers
    r = httpx.post(f"{direct_app.url}/v1/completions", json=body, headers=auth, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and needle in error["message"].lower(), error


def test_one_deployment_serves_http_and_the_python_client(direct_app: RunningApp) -> None:
    from ray import serve

    from rbln_ray.client import RBLNClient
    from rbln_ray.serve import APP_NAME

    deployments = serve.status().applications[APP_NAME].deployments
    assert set(deployments) == {"LLMServer:tiny"}
    assert httpx.get(f"{direct_app.url}/health", timeout=60).json()["status"] == "ok"

    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    auth = {"Authorization": f"Bearer {API_KEY}"}
    http = httpx.post(f"{direct_app.url}/v1/completions", json=body, headers=auth, timeout=60)
    handle = RBLNClient("tiny").complete(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    assert handle.text == http.json()["choices"][0]["text"]
    assert handle.completion_tokens == 8


def test_overload_gets_429_and_serving_continues(direct_app: RunningApp) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 48, "ignore_eos": True}
    refused = overload(direct_app, body, {"Authorization": f"Bearer {API_KEY}"})
    assert all("backpressure" in r.text for r in refused)  # Serve's proxy's own answer
