"""Client disconnects abort engine work; generated garbage always gets a 4xx."""

from __future__ import annotations

import asyncio
import json
import string

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ray_metrics import metric_sum
from tests.reliability.conftest import MODEL, wait_until
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
    tokens_before = metric_sum("ray_vllm_generation_tokens_total", model_name=MODEL)

    async def run() -> list[int]:
        return await asyncio.gather(*(stream_then_leave(tiny_app.url, i) for i in range(32)))

    assert asyncio.run(run()) == [2] * 32

    def drained() -> bool:
        return (
            metric_sum("ray_rbln_slots_in_use", model=MODEL) == 0
            and metric_sum("ray_vllm_num_requests_running", model_name=MODEL) == 0
            and metric_sum("ray_vllm_num_requests_waiting", model_name=MODEL) == 0
        )

    wait_until(drained, timeout=60, what="slots in use back to 0")
    generated = metric_sum("ray_vllm_generation_tokens_total", model_name=MODEL) - tokens_before
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


def read_answer(sock, first: bytes) -> bytes:
    """The whole HTTP answer that starts with ``first``: headers, then ``content-length``
    bytes of body (the server may send them in separate segments)."""
    data = first
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        if not more:
            return data
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length:
        more = sock.recv(65536)
        if not more:
            break
        body += more
    return head + b"\r\n\r\n" + body


def chunked_upload_until_answer(url: str, total: int, chunk: int) -> tuple[bytes, int]:
    """POST a chunked body of ``total`` bytes (a JSON object's start, then whitespace) over a
    raw socket, checking for the server's answer after every chunk; return the answer and
    how much had been sent when it arrived.

    Why a raw socket: HTTP clients send the whole body before reading the response, which
    hides *when* the server answered.
    """
    import select
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        head = b'{"model": "tiny", "prompt": "x", '
        sock.sendall(b"%x\r\n%s\r\n" % (len(head), head))
        sent, frame = len(head), b"%x\r\n%s\r\n" % (chunk, b" " * chunk)
        while sent < total:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                return read_answer(sock, sock.recv(65536)), sent
            try:
                sock.sendall(frame)
            except OSError:  # the server closed the connection: read its answer
                break
            sent += chunk
        readable, _, _ = select.select([sock], [], [], 60)
        return (read_answer(sock, sock.recv(65536)) if readable else b""), sent


# What a client may get through before the 413: the 1 MiB cap, plus what the kernel's socket
# buffers on both sides of a loopback connection hold (a few MiB), whatever the load.
UPLOAD_BOUND = 16 << 20


def test_over_limit_body_is_rejected_without_reading_it(tiny_app: RunningApp) -> None:
    """A chunked upload (no Content-Length) far over the 1 MiB cap gets its 413 while the
    client is still sending, after a bounded amount that does not depend on the load: Serve's
    proxy itself stops reading at the cap (rbln_ray.serve.proxy_guard). Without that guard
    the proxy read the upload as fast as it came until the ingress's 413 had travelled back
    through Ray (230 MiB of 256 once, under load)."""
    cap, total = 1 << 20, 256 << 20
    answer, sent = chunked_upload_until_answer(tiny_app.url, total, 64 << 10)
    print(f"413 after the client had sent {sent / 2**20:.1f} MiB of {total / 2**20:.0f} MiB")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert str(cap).encode() in answer
    assert sent <= UPLOAD_BOUND, f"answered only after {sent} bytes of a {total}-byte upload"
    ok = httpx.post(f"{tiny_app.url}/v1/completions", json=VALID, timeout=60)
    assert ok.status_code == 200


def test_stalled_bodies_get_a_408_from_the_proxy(tiny_app: RunningApp) -> None:
    """Twelve connections declare a 500 kB body, send 64 KiB of it and stop (RELIABILITY.md's
    read deadline): each gets a 408 once limits.body_read_timeout_s has passed, from Serve's
    proxy (the guard: before any handler or buffer of the app holds the body), and the app
    still serves. Before the guard had a deadline they were held open indefinitely."""
    import socket

    from tests.reliability.conftest import BODY_DEADLINE_S

    host, port = tiny_app.url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
            "application/json\r\nContent-Length: 500000\r\n\r\n").encode()  # fmt: skip
    stalled = []
    for _ in range(12):
        sock = socket.create_connection((host, int(port)), timeout=30 * BODY_DEADLINE_S)
        sock.sendall(head + b"{" + b" " * (64 * 1024 - 1))
        stalled.append(sock)

    def answer(sock: socket.socket) -> bytes:
        """Everything the server sends until it closes (it blocks until the server acts)."""
        got = b""
        while chunk := sock.recv(4096):
            got += chunk
        return got

    try:
        answers = [answer(sock) for sock in stalled]
    finally:
        for sock in stalled:
            sock.close()
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"limits.body_read_timeout_s" in answer
    ok = httpx.post(f"{tiny_app.url}/v1/completions", json=VALID, timeout=60)
    assert ok.status_code == 200


@pytest.mark.parametrize("max_tokens", [600, 5000])
def test_max_tokens_over_context_or_cap_gets_one_message(
    tiny_app: RunningApp, max_tokens: int
) -> None:
    """The tiny model is compiled with max_seq_len 512 and the app caps max_tokens at 1000:
    600 (over the context only) and 5000 (over both) get the same message and limit."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": max_tokens}
    r = httpx.post(f"{tiny_app.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        f"max_tokens={max_tokens} exceeds the limit of 512 for model 'tiny' (the smaller of "
        "the configured limit and the compiled max_seq_len)"
    )


def test_system_fingerprint_is_the_same_on_every_replica(tiny_app: RunningApp) -> None:
    from tests.reliability.conftest import replica_stats

    def prefills() -> dict[str, int]:
        return {
            name: sum(s["prefill_requests"] for s in stats["steps"])
            for name, stats in replica_stats(tiny_app).items()
        }

    before = prefills()
    with httpx.Client(timeout=60) as client:
        fingerprints = {
            client.post(f"{tiny_app.url}/v1/completions", json=VALID).json()["system_fingerprint"]
            for _ in range(16)
        }
    after = prefills()
    assert all(after[name] > before[name] for name in before), (before, after)  # both served
    assert len(fingerprints) == 1 and None not in fingerprints, fingerprints
    assert next(iter(fingerprints)).startswith("vllm-0.30.0-rbln-")


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"[" * 200_000, "nested too deeply"),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "digits"),
        (
            json.dumps({"model": MODEL, "prompt": [[5, 6]] * 1024, "n": 1}).encode(),
            "limits.max_prompts",
        ),
        (
            json.dumps({"model": MODEL, "prompt": ["x"] * 20, "n": 4}).encode(),
            "limits.max_sequences",
        ),
        (
            json.dumps(
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 2,
                    "max_completion_tokens": 100_000,
                }
            ).encode(),
            "max_tokens=100000",
        ),
        (
            json.dumps(
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "x"}],
                    "mm_processor_kwargs": {"min_pixels": 10**9},
                }
            ).encode(),
            "limits.allowed_mm_processor_kwargs",
        ),
    ],
    ids=["deep-json", "huge-int", "1024-prompts", "prompts-x-n", "max_completion_tokens",
         "mm_processor_kwargs"],
)  # fmt: skip
def test_amplifying_or_hostile_bodies_are_4xx_with_an_openai_body(
    tiny_app: RunningApp, body: bytes, needle: str
) -> None:
    """Bodies under 1 MiB that would become thousands of sequences, blow up a parser, or
    slip past a limit through another field: each a 4xx naming the problem, before any
    replica sees it."""
    chat = b'"messages"' in body
    route = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(
        f"{tiny_app.url}{route}",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert 400 <= r.status_code < 500, r.text[:300]
    error = r.json()["error"]
    assert error["code"] == r.status_code and error["type"], error
    assert needle in error["message"], error["message"]
