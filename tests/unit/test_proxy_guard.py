"""The guard in Serve's HTTP proxy (rbln_ray.serve.proxy_guard), driven as Serve's proxy drives
an ASGI middleware: it stops reading at the cap and answers 413 itself, ends a body that does
not arrive in time with a 408, bounds the bodies it reads at once (per client and in all),
refuses a request without the API key before reading its body, and hands a body under every
limit to the app unchanged."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from rbln_ray.serve.config import RequestLimits
from rbln_ray.serve.proxy_guard import (
    CALLBACK,
    KEY_DIGEST_ENV,
    BodyGuard,
    guard_settings,
    key_digest,
    proxy_env,
)

SETTINGS = dict(max_request_bytes=10, body_read_timeout_s=60.0, max_pending_bodies=100,
                max_pending_bodies_per_client=100, max_requests_per_client=100)  # fmt: skip


class Client:
    """One request's client: sends ``chunks`` then, if ``stall``, nothing more (never ends)."""

    def __init__(self, chunks: list[bytes], stall: bool = False) -> None:
        self.chunks, self.stall = chunks, stall
        self.read: list[bytes] = []
        self.sent: list[dict] = []

    async def receive(self) -> dict:
        i = len(self.read)
        if i == len(self.chunks):
            await asyncio.Event().wait()  # a client that stopped sending
        self.read.append(self.chunks[i])
        more = self.stall or i + 1 < len(self.chunks)
        return {"type": "http.request", "body": self.chunks[i], "more_body": more}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int | None:
        return self.sent[0]["status"] if self.sent else None

    def error(self) -> dict:
        return json.loads(self.sent[1]["body"])["error"]


class App:
    def __init__(self) -> None:
        self.seen: list[dict] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            self.seen.append(message)
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})


def scope(headers: list | None = None, client: str = "10.0.0.1", path: str = "/v1/completions"):
    return {"type": "http", "headers": headers or [], "client": (client, 5000), "path": path}


def run(client: Client, headers: list | None = None, **settings: Any) -> App:
    app = App()
    asyncio.run(BodyGuard(app, **{**SETTINGS, **settings})(scope(headers), client.receive,
                                                             client.send))  # fmt: skip
    return app


def test_an_upload_over_the_cap_is_a_413_read_no_further() -> None:
    client = Client([b"x" * 4] * 1000)
    app = run(client)
    assert len(client.read) == 3 and app.seen == []  # 12 bytes > 10: the rest is never read
    assert client.status == 413 and (b"connection", b"close") in client.sent[0]["headers"]
    assert client.error()["code"] == 413 and "10 bytes" in client.error()["message"]


def test_a_declared_length_over_the_cap_is_refused_before_reading() -> None:
    client = Client([b"x"])
    run(client, headers=[(b"content-length", b"11")])
    assert client.read == [] and client.status == 413


def test_a_body_under_the_cap_reaches_the_app_unchanged() -> None:
    client = Client([b"ab", b"cd", b"e"])
    app = run(client)
    assert [m["body"] for m in app.seen] == [b"ab", b"cd", b"e"] and client.status == 200


def test_a_body_that_stops_arriving_is_a_408_before_the_app_sees_it() -> None:
    """Headers, part of the body, then silence: the guard's deadline covers the whole body
    (a slow drip gains nothing) and closes the connection; the app never runs."""
    client = Client([b"xy"], stall=True)
    app = run(client, body_read_timeout_s=0.05)
    assert client.status == 408 and app.seen == []
    assert (b"connection", b"close") in client.sent[0]["headers"]
    assert "limits.body_read_timeout_s" in client.error()["message"]


def test_bodies_in_flight_are_bounded_per_client_and_in_all() -> None:
    """Two stalled bodies of one client hold its two slots: its third request is a 429 at
    once, another client's still reads; with every slot of the proxy held, a 503."""

    async def scenario() -> None:
        guard = BodyGuard(App(), **{**SETTINGS, "max_pending_bodies_per_client": 2,
                                    "max_pending_bodies": 3})  # fmt: skip
        stalled = [Client([b"x"], stall=True) for _ in range(2)]
        tasks = [asyncio.create_task(guard(scope(), c.receive, c.send)) for c in stalled]
        while sum(guard.pending.values()) < 2:
            await asyncio.sleep(0)  # let both start reading
        third = Client([b"ok"])
        await guard(scope(), third.receive, third.send)
        assert third.status == 429 and third.read == []
        other = Client([b"x"], stall=True)
        tasks.append(asyncio.create_task(guard(scope(client="10.0.0.2"), other.receive,
                                               other.send)))  # fmt: skip
        while sum(guard.pending.values()) < 3:
            await asyncio.sleep(0)
        last = Client([b"ok"])
        await guard(scope(client="10.0.0.3"), last.receive, last.send)
        assert last.status == 503 and last.read == []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert not guard.pending and not guard.requests  # slots freed on the way out

    asyncio.run(scenario())


def test_requests_of_one_client_in_the_proxy_are_bounded() -> None:
    async def scenario() -> None:
        guard = BodyGuard(App(), **{**SETTINGS, "max_requests_per_client": 1})
        stalled = Client([b"x"], stall=True)
        task = asyncio.create_task(guard(scope(), stalled.receive, stalled.send))
        while not guard.requests:
            await asyncio.sleep(0)
        second = Client([b"ok"])
        await guard(scope(), second.receive, second.send)
        assert (
            second.status == 429 and "limits.max_requests_per_client" in second.error()["message"]
        )
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def test_without_the_api_key_no_body_is_read() -> None:
    """With the key's digest, a request that lacks the key is a 401 before its body is read
    (unauthenticated clients hold no buffers); the probes stay open; the key passes."""
    digest = key_digest("sekrit")
    client = Client([b"x"], stall=True)
    run(client, api_key_sha256=digest)
    assert client.status == 401 and client.read == []
    assert client.error()["type"] == "AuthenticationError"
    good = Client([b"ab"])
    app = run(good, headers=[(b"authorization", b"Bearer sekrit")], api_key_sha256=digest)
    assert good.status == 200 and app.seen[0]["body"] == b"ab"
    probe = Client([b""])
    app = App()
    asyncio.run(BodyGuard(app, **SETTINGS, api_key_sha256=digest)(
        scope(path="/health"), probe.receive, probe.send))  # fmt: skip
    assert probe.status == 200


def test_anthropic_routes_get_anthropics_error_shape() -> None:
    client = Client([b"x"])
    asyncio.run(BodyGuard(App(), **{**SETTINGS, "api_key_sha256": key_digest("k")})(
        scope(path="/v1/messages"), client.receive, client.send))  # fmt: skip
    body = json.loads(client.sent[1]["body"])
    assert body["type"] == "error" and body["error"]["type"] == "AuthenticationError"


def test_the_environment_carries_the_apps_limits_and_key_digest() -> None:
    limits = RequestLimits(max_request_bytes=2048, body_read_timeout_s=5,
                           max_pending_bodies_per_client=3)  # fmt: skip
    env = proxy_env(limits, "sekrit")
    assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == CALLBACK
    assert "sekrit" not in json.dumps(env) and env[KEY_DIGEST_ENV] == key_digest("sekrit")
    settings = guard_settings(env)
    assert settings["max_request_bytes"] == 2048 and settings["body_read_timeout_s"] == 5
    assert settings["max_pending_bodies_per_client"] == 3
    assert settings["api_key_sha256"] == key_digest("sekrit")
    default = guard_settings({})
    assert default["max_request_bytes"] == RequestLimits().max_request_bytes
    assert default["api_key_sha256"] is None
    # a process that starts an app without a key after one with a key (a test worker, a
    # benchmark): its proxies must not ask for the first app's key
    env.update(proxy_env(RequestLimits()))
    assert guard_settings(env)["api_key_sha256"] is None
