"""Client disconnects abort engine work; generated garbage always gets a 4xx."""

from __future__ import annotations

import asyncio
import json
import string

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.conftest import MODEL, metric_sum, wait_until
from tests.serve.conftest import RunningApp

pytestmark = pytest.mark.slow

MAX_TOKENS = 400


async def stream_then_leave(url: str, i: int) -> int:
    """Start a long stream, read two token events, then drop the connection."""
    body = {
        "model": MODEL,
        "prompt": f"z{i} = ",
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "ignore_eos": True,
    }
    seen = 0
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                seen += 1
                if seen == 2:
                    break  # leaving the block closes the connection mid-stream
    return seen


def test_32_disconnects_abort_their_requests(tiny_app: RunningApp) -> None:
    tokens_before = metric_sum(tiny_app, "vllm:generation_tokens", model_name=MODEL)

    async def run() -> list[int]:
        return await asyncio.gather(*(stream_then_leave(tiny_app.url, i) for i in range(32)))

    assert asyncio.run(run()) == [2] * 32

    def drained() -> bool:
        return (
            metric_sum(tiny_app, "rbln_slots_in_use", model=MODEL) == 0
            and metric_sum(tiny_app, "vllm:num_requests_running", model_name=MODEL) == 0
            and metric_sum(tiny_app, "vllm:num_requests_waiting", model_name=MODEL) == 0
        )

    wait_until(drained, timeout=60, what="slots in use back to 0")
    generated = metric_sum(tiny_app, "vllm:generation_tokens", model_name=MODEL) - tokens_before
    # Run to completion they would have produced 32 x 400 tokens; aborted, a small fraction.
    assert generated < 0.25 * 32 * MAX_TOKENS, generated


LETTERS = st.text(alphabet="qxzjw", min_size=2, max_size=8)
BAD_FIELDS = {
    "model": st.one_of(
        st.integers(),
        st.lists(st.integers(), min_size=1),
        st.just(""),
        st.text(string.ascii_letters, min_size=1).filter(lambda s: s != MODEL),
    ),
    "prompt": st.one_of(
        st.integers(),
        st.just(""),
        st.just([]),
        st.booleans(),
        st.dictionaries(st.text(min_size=1), st.integers(), min_size=1),
    ),
    "max_tokens": st.one_of(
        st.integers(max_value=0),
        st.integers(min_value=1001),
        LETTERS,
        st.floats(0.1, 1e6).filter(lambda f: not f.is_integer()),
    ),
    "temperature": st.one_of(st.floats(max_value=-1e-3, allow_infinity=False), LETTERS),
    "top_p": st.one_of(st.floats(min_value=1.001, max_value=1e6), st.floats(-1e6, 0.0)),
    "n": st.one_of(st.integers(max_value=0), st.integers(min_value=5, max_value=10**6)),
    "logprobs": st.integers(min_value=21, max_value=10**6),
    "stop": st.one_of(st.integers(), st.dictionaries(st.text(), st.integers(), min_size=1)),
    "stream": st.one_of(LETTERS, st.integers(min_value=2)),
}
VALID = {"model": MODEL, "prompt": "x = ", "max_tokens": 4}
BAD_BODIES = st.one_of(
    # one field of an otherwise valid request made invalid
    st.sampled_from(sorted(BAD_FIELDS)).flatmap(
        lambda field: BAD_FIELDS[field].map(lambda v: json.dumps({**VALID, field: v}).encode())
    ),
    # a valid request missing a required field
    st.sampled_from(["model", "prompt"]).map(
        lambda f: json.dumps({k: v for k, v in VALID.items() if k != f}).encode()
    ),
    # JSON that is not an object, and bytes that are not JSON
    st.one_of(st.integers(), st.text(), st.lists(st.integers()), st.none()).map(
        lambda v: json.dumps(v).encode()
    ),
    st.binary(min_size=1, max_size=64).filter(lambda b: not _is_json_object(b)),
)


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except (ValueError, UnicodeDecodeError):
        return False


def test_1000_malformed_requests_get_4xx_and_never_5xx(tiny_app: RunningApp) -> None:
    statuses: list[int] = []
    with httpx.Client(timeout=60) as client:

        @settings(
            max_examples=1000,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(body=BAD_BODIES)
        def send(body: bytes) -> None:
            r = client.post(
                f"{tiny_app.url}/v1/completions",
                content=body,
                headers={"Content-Type": "application/json"},
            )
            statuses.append(r.status_code)
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text[:300])
            assert r.json()["error"]["message"]

        send()
        ok = client.post(f"{tiny_app.url}/v1/completions", json=VALID)
    assert len(statuses) >= 1000
    assert ok.status_code == 200
