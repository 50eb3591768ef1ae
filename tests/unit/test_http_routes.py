"""The ingress and the replica's HTTP path in process, without Ray: vLLM's route table and
how each route is served, vLLM's own app run through ASGI (``asgi_call``), and the ingress
app in front of fake model handles that run a vLLM app with stub serving objects.
"""

from __future__ import annotations

import asyncio
import json
import types
from pathlib import Path

import httpx
import pytest

from rbln_ray.serve.asgi_call import run
from rbln_ray.serve.config import RequestLimits
from rbln_ray.serve.http_call import (
    HTTPCall,
    HTTPStart,
    model_tag,
    new_response_id,
    parse_response_id,
    routing_prefix,
)
from rbln_ray.serve.routes import (
    Kind,
    markdown,
    table,
    text,
    unknown_model_param,
    vllm_routes,
)

GOLDEN = Path(__file__).parent / "data" / "vllm_routes.txt"
ROOT = Path(__file__).resolve().parents[2]
JSON = ((b"content-type", b"application/json"),)
KEY = "sekrit"
LIMITS = RequestLimits(max_request_bytes=8192, max_n=2, max_tokens=50, max_prompts=4,
                       max_sequences=6, body_read_timeout_s=2)  # fmt: skip


# ------------------------------------------------------------------ the route table
def test_the_route_table_is_vllms_sorted_by_kind() -> None:
    """Every (path, method) vLLM 0.30's server can answer, and how the ingress serves it.
    A vLLM upgrade shows its new routes here (regenerate the file with
    ``python -m rbln_ray.serve.routes | grep -v INFO > tests/unit/data/vllm_routes.txt``)."""
    rows = table()
    assert text() == GOLDEN.read_text()
    kinds = {(p, m): k for p, m, k, _ in rows}
    assert kinds[("/v1/responses/{response_id}", "GET")] is Kind.RESPONSE_ID
    assert kinds[("/tokenizer_info", "GET")] is Kind.QUERY_MODEL
    for path in ("/sleep", "/collective_rpc", "/v1/load_lora_adapter", "/metrics"):
        assert kinds[(path, "POST" if path != "/metrics" else "GET")] is Kind.UNSERVED
    served = {p for p, _, k, _ in rows if k is Kind.MODEL}
    assert {"/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/tokenize",
            "/detokenize", "/pooling", "/classify", "/v2/rerank"} <= served  # fmt: skip
    assert "| POST | `/sleep` | engine control" in markdown()
    assert markdown() in (ROOT / "docs" / "ROUTES.md").read_text(), "regenerate docs/ROUTES.md"


def test_an_unknown_model_is_named_as_vllm_names_it_per_route(ingress_app) -> None:
    """vLLM's 404 for an unknown model names ``param: model`` on its generating routes and no
    param on its pooling routes (``benchmarks.api_compat_pooling`` found the difference)."""
    routes = vllm_routes()
    assert unknown_model_param(routes[("/v1/completions", "POST")]) == "model"
    for path in ("/v1/embeddings", "/pooling", "/classify", "/v1/score", "/v2/rerank"):
        assert unknown_model_param(routes[(path, "POST")]) is None, path
    app, _ = ingress_app
    for path, param in (("/v1/completions", "model"), ("/v1/embeddings", None)):
        r = post(app, path, {"model": "nope", "input": "x", "prompt": "x"})
        assert r.status_code == 404 and r.json()["error"]["param"] == param, r.text


# ------------------------------------------------------------------ ids and prefixes
def test_response_ids_name_model_and_replica() -> None:
    rid = new_response_id("demo", "abc123XY")
    assert rid.startswith("resp_") and parse_response_id(rid) == (model_tag("demo"), "abc123XY")
    for foreign in ("resp_0123", "resp_" + "a" * 32, "chatcmpl-1", f"resp_{'a' * 32}-x-y"):
        assert parse_response_id(foreign) is None


def test_routing_prefix_reads_every_body_shape() -> None:
    long = "x" * 1000
    assert routing_prefix({"prompt": long}) == long[:256]
    chat = {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]}
    assert routing_prefix(chat) == "sys\nhi"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
    assert routing_prefix(parts) == "a"
    assert routing_prefix({"instructions": "be brief", "input": "q"}) == "be brief\nq"
    assert routing_prefix({"system": "s", "messages": [{"role": "user", "content": "u"}]}) == "s\nu"
    assert routing_prefix({"prompt": [1, 2, 3]}) == "1\n2\n3"


# ------------------------------------------------------------------ vLLM's app in process
class StubCompletion:
    """vLLM's completion serving object, reduced to what the tests look at."""

    def __init__(self) -> None:
        self.seen: list = []
        self.aborted: list[str] = []

    async def create_completion(self, request, raw_request=None):
        from vllm.entrypoints.openai.completion.protocol import (
            CompletionResponse,
            CompletionResponseChoice,
        )
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        self.seen.append((request, dict(raw_request.headers)))
        if request.prompt == "raise value":
            raise ValueError("bad thing from the serving layer")
        if request.prompt == "raise runtime":
            raise RuntimeError("engine exploded")
        if request.stream:
            return self._events(request)
        choice = CompletionResponseChoice(index=0, text=str(request.prompt)[::-1])
        usage = UsageInfo(prompt_tokens=1, completion_tokens=1, total_tokens=2)
        return CompletionResponse(model=request.model, choices=[choice], usage=usage)

    async def _events(self, request):
        try:
            for i in range(request.max_tokens or 3):
                yield f"data: {json.dumps({'i': i})}\n\n"
                await asyncio.sleep(0)
            yield "data: [DONE]\n\n"
        except BaseException as exc:
            self.aborted.append(type(exc).__name__)
            raise


@pytest.fixture(scope="module")
def vllm_app():
    """vLLM's app for a generating model (no engine), a stub completion server behind it."""
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m"])
    app = build_app(args, ("generate",), None)
    app.state.openai_serving_completion = StubCompletion()
    app.state.server = types.SimpleNamespace(should_exit=False)
    return app


def completion(body: dict | bytes, path: str = "/v1/completions", headers=JSON) -> HTTPCall:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return HTTPCall("POST", path, headers=headers, body=raw)


async def collect(app, call: HTTPCall) -> tuple[HTTPStart, bytes]:
    items = [item async for item in run(app, call)]
    return items[0], items[0].body + b"".join(items[1:])


def test_vllms_app_answers_json_errors_and_streams(vllm_app) -> None:
    async def go():
        start, body = await collect(vllm_app, completion({"model": "m", "prompt": "abc"}))
        assert start.status == 200 and not start.more
        assert json.loads(body)["choices"][0]["text"] == "cba"
        start, body = await collect(
            vllm_app, completion({"model": "m", "prompt": "x", "max_tokens": "lots"})
        )
        error = json.loads(body)["error"]
        assert start.status == 400 and error["param"] == "body.max_tokens"
        start, body = await collect(vllm_app, completion({"model": "m", "prompt": "raise value"}))
        assert start.status == 400 and "bad thing" in json.loads(body)["error"]["message"]
        # a 500 whose exception Starlette re-raises after answering: answered once
        start, body = await collect(vllm_app, completion({"model": "m", "prompt": "raise runtime"}))
        assert start.status == 500 and json.loads(body)["error"]["code"] == 500
        start, _ = await collect(vllm_app, completion({"model": "m", "prompt": "x"}, headers=()))
        assert start.status == 400  # vLLM's "Unsupported Media Type"
        stream = {"model": "m", "prompt": "x", "max_tokens": 3, "stream": True}
        start, body = await collect(vllm_app, completion(stream))
        assert start.status == 200 and start.more and start.body.startswith(b"data: {")
        assert dict(start.headers)[b"content-type"].startswith(b"text/event-stream")
        assert body.count(b"data: ") == 4 and body.endswith(b"data: [DONE]\n\n")

    asyncio.run(go())


def test_closing_the_call_aborts_the_request(vllm_app) -> None:
    """A caller that leaves (the ingress's client disconnected) makes vLLM's handler see
    ``http.disconnect``: its generator is cancelled, which aborts the engine request."""
    stub = vllm_app.state.openai_serving_completion

    async def go():
        stream = run(vllm_app, completion({"model": "m", "prompt": "x", "max_tokens": 10**6,
                                           "stream": True}))  # fmt: skip
        first = await stream.__anext__()
        assert first.status == 200
        await stream.__anext__()
        await stream.aclose()

    before = len(stub.aborted)
    asyncio.run(go())
    assert len(stub.aborted) == before + 1, stub.aborted


# ------------------------------------------------------------------ the ingress
class FakeStream:
    def __init__(self, items) -> None:
        self.items, self.cancelled = items, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.items.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


class FakeServer:
    """A model's deployment handle: ``http`` runs the call through vLLM's app (or raises
    the next of ``failures``), ``models`` lists the model."""

    def __init__(self, name: str, app) -> None:
        self.name, self.app = name, app
        self.calls: list[HTTPCall] = []
        self.failures: list[BaseException] = []
        self.http = types.SimpleNamespace(remote=self._http)
        self.models = types.SimpleNamespace(remote=self._models)

    def options(self, **_):
        return self

    def _http(self, call: HTTPCall) -> FakeStream:
        self.calls.append(call)
        if self.failures:
            failure = self.failures.pop(0)

            async def fail():
                raise failure
                yield  # an async generator

            return FakeStream(fail())
        return FakeStream(run(self.app, call))

    async def _models(self):
        return {"object": "list", "data": [{"id": self.name, "object": "model"}]}


@pytest.fixture(scope="module")
def ingress_app(vllm_app):
    from rbln_ray.serve.ingress import OpenAIIngress, build_ingress_app

    servers = {"m": FakeServer("m", vllm_app), "other": FakeServer("other", vllm_app)}
    ingress = OpenAIIngress.__new__(OpenAIIngress)
    ingress.configure(servers, KEY, LIMITS, {"m": 100}, [], "app")
    return build_ingress_app(ingress), servers


def post(app, path: str, body=None, *, key: str | None = KEY, content: bytes | None = None,
         headers: dict | None = None) -> httpx.Response:  # fmt: skip
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            sent = {"Authorization": f"Bearer {key}"} if key else {}
            sent.update(headers or {})
            if body is None and content is None:
                return await client.get(path, headers=sent)
            return await client.post(path, json=body, content=content, headers=sent)

    return asyncio.run(go())


def test_requests_are_forwarded_as_bytes_to_the_model_they_name(ingress_app) -> None:
    app, servers = ingress_app
    r = post(app, "/v1/completions", {"model": "other", "prompt": "hello"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "olleh"
    call = servers["other"].calls[-1]
    assert json.loads(call.body) == {"model": "other", "prompt": "hello"}
    assert call.prefix == "hello" and call.replica is None
    assert dict(call.headers)[b"content-type"] == b"application/json"
    assert b"authorization" not in dict(call.headers)  # the key stays at the ingress
    r = post(app, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 3,
                                      "stream": True})  # fmt: skip
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert r.headers["content-type"].startswith("text/event-stream")


@pytest.mark.parametrize(
    ("body", "status", "needle", "param"),
    [
        (b"{not json", 400, "JSON decode error", "body.1"),
        (b"[1, 2]", 400, "valid dictionary", "body"),
        (b"[" * 3000, 400, "nested too deeply", None),
        (b'{"model": "m", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, "digits",
         None),
        (json.dumps({"model": "m", "prompt": "x", "max_tokens": "lots"}).encode(), 400,
         "int_parsing", "body.max_tokens"),
        (json.dumps({"prompt": "x"}).encode(), 400, "model: field required", None),
        (json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), 404, "gpt-9", "model"),
        (json.dumps({"model": "m", "prompt": "x", "n": 3}).encode(), 400, "n=3", None),
        (json.dumps({"model": "m", "prompt": ["a"] * 5}).encode(), 400, "max_prompts", None),
        (json.dumps({"model": "m", "prompt": ["a"] * 4, "n": 2}).encode(), 400,
         "max_sequences", None),
        (json.dumps({"model": "m", "prompt": "x", "max_tokens": 60}).encode(), 400,
         "max_tokens=60 exceeds the limit of 50", None),
        (json.dumps({"model": "m", "prompt": "x" * 9000}).encode(), 413, "8192 bytes", None),
    ],
)  # fmt: skip
def test_bad_requests_get_vllms_or_the_apps_4xx_before_any_replica(
    ingress_app, body: bytes, status: int, needle: str, param: str | None
) -> None:
    app, servers = ingress_app
    before = len(servers["m"].calls)
    r = post(app, "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and needle in error["message"], error
    if param:
        assert error["param"] == param
    assert len(servers["m"].calls) == before


def test_auth_unserved_routes_and_ingress_routes(ingress_app) -> None:
    app, _ = ingress_app
    body = {"model": "m", "prompt": "x"}
    assert post(app, "/v1/completions", body, key=None).status_code == 401
    assert post(app, "/v1/completions", body, key="wrong").json()["error"]["code"] == 401
    anthropic = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    denied = post(app, "/v1/messages", anthropic, key=None)
    assert denied.status_code == 401 and denied.json()["type"] == "error"
    assert post(app, "/tokenize", {"model": "m", "prompt": "x"}, key=None).status_code == 401
    assert post(app, "/version", key=None).json()["version"].startswith("0.30")
    sleep = post(app, "/sleep", {})
    assert sleep.status_code == 404 and "engine control" in sleep.json()["error"]["message"]
    assert post(app, "/metrics").status_code == 404
    assert post(app, "/no/such/route", {}).json() == {"detail": "Not Found"}
    assert post(app, "/v1/models/other").json()["id"] == "other"
    missing = post(app, "/v1/models/gpt-9")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    ids = sorted(m["id"] for m in post(app, "/v1/models").json()["data"])
    assert ids == ["m", "other"]
    # x-api-key (Anthropic's SDK) is accepted too
    r = post(app, "/v1/completions", body, key=None, headers={"x-api-key": KEY})
    assert r.status_code == 200


def test_cors_preflight_is_answered_for_allowed_origins_only(vllm_app) -> None:
    from rbln_ray.serve.ingress import OpenAIIngress, build_ingress_app

    ingress = OpenAIIngress.__new__(OpenAIIngress)
    servers = {"m": FakeServer("m", vllm_app)}
    ingress.configure(servers, KEY, RequestLimits(), {}, [], "app", ["https://ui.example"])
    app = build_ingress_app(ingress)
    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"}

    async def go(origin: str):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            return await client.options("/v1/completions", headers={**preflight,
                                                                    "Origin": origin})  # fmt: skip

    allowed = asyncio.run(go("https://ui.example"))
    assert allowed.status_code == 200  # no API key needed for a preflight
    assert allowed.headers["access-control-allow-origin"] == "https://ui.example"
    assert asyncio.run(go("https://evil.example")).status_code == 400


def test_health_answers_while_the_controller_does_not(vllm_app, monkeypatch) -> None:
    """A controller that does not answer (Ray restarting it): every probe still gets a 503
    naming it within the timeout, probes never start a second status call beside the one in
    flight (the cache period is 0 here), and the first probe after it answers is a 200."""
    import threading

    from ray import serve

    from rbln_ray.serve import ingress as ingress_module
    from rbln_ray.serve.ingress import OpenAIIngress, build_ingress_app

    released, calls = threading.Event(), []

    def stalled_status():
        calls.append(threading.get_ident())
        released.wait(60)
        healthy = types.SimpleNamespace(status=types.SimpleNamespace(value="HEALTHY"))
        app_status = types.SimpleNamespace(deployments={"LLMServer:m": healthy})
        return types.SimpleNamespace(applications={"app": app_status})

    monkeypatch.setattr(serve, "status", stalled_status)
    monkeypatch.setattr(ingress_module, "HEALTH_TIMEOUT_S", 0.2)
    monkeypatch.setattr(ingress_module, "HEALTH_CACHE_S", 0.0)
    ingress = OpenAIIngress.__new__(OpenAIIngress)
    ingress.configure({"m": FakeServer("m", vllm_app)}, KEY, RequestLimits(), {}, [], "app")
    app = build_ingress_app(ingress)

    async def probe_twice_then_release():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            waves = [await asyncio.gather(*(client.get("/health") for _ in range(4)))
                     for _ in range(2)]  # fmt: skip
            released.set()
            return waves, await client.get("/health")

    try:
        waves, after = asyncio.run(probe_twice_then_release())
    finally:
        released.set()
    stalled = [r for wave in waves for r in wave]
    assert {r.status_code for r in stalled} == {503}
    assert stalled[0].json() == {"status": "Serve's controller did not answer within 0.2 s"}
    assert len(calls) == 1
    assert after.status_code == 200
    assert after.json() == {"status": "ok", "deployments": {"LLMServer:m": "HEALTHY"}}


def test_stored_response_calls_go_to_the_replica_in_their_id(ingress_app) -> None:
    app, servers = ingress_app
    rid = new_response_id("other", "replica7")
    post(app, f"/v1/responses/{rid}?stream=false")
    call = servers["other"].calls[-1]
    assert call.replica == "replica7" and call.method == "GET" and call.query == b"stream=false"
    post(app, f"/v1/responses/{rid}/cancel", {})
    assert servers["other"].calls[-1].replica == "replica7"
    assert post(app, f"/v1/responses/{rid}?starting_after=x").status_code == 400  # vLLM's query
    unknown = post(app, "/v1/responses/resp_123")
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "response_id"
    chained = {"model": "other", "input": "x", "previous_response_id": rid}
    post(app, "/v1/responses", chained)
    assert servers["other"].calls[-1].replica == "replica7"


def test_back_pressure_is_429_and_a_dead_replica_is_retried_once(ingress_app, monkeypatch):
    from ray.exceptions import ActorDiedError
    from ray.serve.exceptions import BackPressureError

    import rbln_ray.serve.request_metrics as metrics

    app, servers = ingress_app
    retried: list[str] = []
    monkeypatch.setattr(metrics, "record_retry", lambda model, why: retried.append(why))
    body = {"model": "m", "prompt": "abc"}
    servers["m"].failures = [BackPressureError(num_queued_requests=1, max_queued_requests=1)]
    r = post(app, "/v1/completions", body)
    assert r.status_code == 429 and "capacity" in r.json()["error"]["message"]
    servers["m"].failures = [ActorDiedError()]
    r = post(app, "/v1/completions", body)
    assert r.status_code == 200 and retried == ["replica_died"]
    servers["m"].failures = [ActorDiedError(), ActorDiedError()]
    assert post(app, "/v1/completions", body).status_code == 503
    servers["m"].failures = [RuntimeError("a bug")]
    assert post(app, "/v1/completions", body).status_code == 503  # not retried
    assert servers["m"].failures == []


def test_a_disaggregated_model_prefills_on_its_prefill_pool_first(vllm_app) -> None:
    """A completion or chat of a ``pd`` model: its prefill pool computes the prompt for one
    token first (vLLM's ``do_remote_decode``), then the decode pool gets the request as
    sent; other routes go to the decode pool only; a prefill that fails costs nothing but
    the handover (the decode pool answers from the prompt)."""
    from rbln_ray.serve.disaggregation import PrefillPool
    from rbln_ray.serve.ingress import OpenAIIngress, build_ingress_app

    decode, prefill = FakeServer("m", vllm_app), FakeServer("m", vllm_app)
    ingress = OpenAIIngress.__new__(OpenAIIngress)
    pool = PrefillPool(prefill, timeout_s=30)
    ingress.configure({"m": decode}, KEY, LIMITS, {"m": 100}, [], "app",
                      prefill_servers={"m": pool})  # fmt: skip
    app = build_ingress_app(ingress)
    body = {"model": "m", "prompt": "hello", "max_tokens": 5, "stream": True, "logprobs": 1}
    r = post(app, "/v1/completions", body)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    (asked,) = prefill.calls
    assert json.loads(asked.body) == {"model": "m", "prompt": "hello", "max_tokens": 1,
                                      "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    assert json.loads(decode.calls[-1].body) == body  # the client's request, as sent
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    post(app, "/v1/chat/completions", chat)
    assert len(prefill.calls) == 2 and json.loads(prefill.calls[-1].body)["max_tokens"] == 1
    post(app, "/tokenize", {"model": "m", "prompt": "hi"})  # (the stub app has no tokenizer)
    assert decode.calls[-1].path == "/tokenize" and len(prefill.calls) == 2  # decode pool only
    prefill.failures = [RuntimeError("prefill replica died")]
    r = post(app, "/v1/completions", {"model": "m", "prompt": "hello"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "olleh"
    assert prefill.failures == [] and len(prefill.calls) == 3

    # a pool that never answers (every replica restarting): the wait is bounded
    async def never():
        await asyncio.Event().wait()
        yield  # an async generator

    stuck = types.SimpleNamespace(http=types.SimpleNamespace(remote=lambda c: FakeStream(never())))
    stuck.options = lambda **_: stuck
    ingress.prefill_servers["m"] = PrefillPool(stuck, timeout_s=0.2)
    r = post(app, "/v1/completions", {"model": "m", "prompt": "hello"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "olleh"


def test_media_of_every_route_is_checked(ingress_app) -> None:
    """Images in chat messages, Responses input and Anthropic blocks reach the media
    policy (a text model refuses them all)."""
    app, servers = ingress_app
    url = "data:image/png;base64,aGVsbG8="
    bodies = {
        "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}]},
        "/v1/responses": {"model": "m", "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": url, "detail": "auto"}]}]},
        "/v1/messages": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": "aGVsbG8="}}]}]},
    }  # fmt: skip
    # images in tool results: a Responses function_call_output whose output is a list of
    # parts (vLLM makes it a tool message), an Anthropic tool_result block
    tool_outputs = {
        "/v1/responses": {"model": "m", "input": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [
                {"type": "input_image", "image_url": url, "detail": "auto"}]}]},
        "/v1/messages": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                              "data": "aGVsbG8="}}]}]}]},
    }  # fmt: skip
    before = len(servers["m"].calls)
    for path, body in [*bodies.items(), *tool_outputs.items()]:
        r = post(app, path, body)
        assert r.status_code == 400, (path, r.text)
        text = r.text
        assert "does not accept image inputs" in text, (path, text)
    assert post(app, "/v1/messages", bodies["/v1/messages"]).json()["type"] == "error"
    assert len(servers["m"].calls) == before


def test_every_limit_holds_on_every_route_of_vllms_table(ingress_app) -> None:
    """Generated from vLLM's route table (tests/route_limits.py), so a route vLLM adds cannot
    skip a limit: for every route forwarded by model, every shape of its body (each model of
    a union) and every limited field that shape has, an over-limit value is refused with a
    400 naming the limit (or vLLM's own validation naming the field) before any replica,
    JSON bodies and multipart uploads alike."""
    from tests.route_limits import limit_cases

    app, servers = ingress_app
    checked: list[tuple[str, str]] = []
    for case in limit_cases(LIMITS, "m"):
        before = len(servers["m"].calls)
        send = form_post if case.form else post
        r = send(app, case.path, case.body)
        where = (case.path, case.shape, case.field, r.text)
        assert r.status_code == 400, where
        # the app's limit, or vLLM's own validation refusing that field
        named = case.needle in r.text or r.json().get("error", {}).get("param") == case.field
        assert named, where
        assert len(servers["m"].calls) == before
        checked.append((case.path, case.field))
    routes = {p for p, _ in checked}
    assert {"/v1/audio/transcriptions", "/v1/audio/translations", "/v1/messages",
            "/v1/responses", "/v2/embed", "/v1/embeddings", "/v2/rerank",
            "/v1/chat/completions/batch"} <= routes, routes  # fmt: skip


def form_post(app, path: str, fields: dict) -> httpx.Response:
    from rbln_ray.models.speech import tone_clip, wav_bytes

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            files = {"file": ("a.wav", wav_bytes(tone_clip(0.1, 440)), "audio/wav")}
            data = {k: v if isinstance(v, str) else json.dumps(v) for k, v in fields.items()}
            headers = {"Authorization": f"Bearer {KEY}"}
            return await client.post(path, files=files, data=data, headers=headers)

    return asyncio.run(go())
