"""The proxy's request-body cap (rbln_ray.serve.proxy_guard), driven as Serve's proxy drives
an ASGI middleware: it stops reading at the cap and answers 413 itself, and hands a body
under the cap to the app unchanged."""

from __future__ import annotations

import asyncio
import json

from rbln_ray.serve.proxy_guard import CALLBACK, BodyCap, proxy_env


def run(chunks: list[bytes], headers: list | None = None, cap: int = 10):
    """(messages the client sent that were read, what the app saw, what was sent back)."""
    read: list[bytes] = []
    seen: list[dict] = []
    sent: list[dict] = []

    async def receive():
        i = len(read)
        read.append(chunks[i])
        return {"type": "http.request", "body": chunks[i], "more_body": i + 1 < len(chunks)}

    async def app(scope, receive, send):
        while True:
            message = await receive()
            seen.append(message)
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "headers": headers or []}
    asyncio.run(BodyCap(app, cap)(scope, receive, send))
    return read, seen, sent


def test_an_upload_over_the_cap_is_a_413_read_no_further() -> None:
    read, seen, sent = run([b"x" * 4] * 1000)
    assert len(read) == 3 and seen == []  # 12 bytes > 10: the rest is never read
    assert sent[0]["status"] == 413 and (b"connection", b"close") in sent[0]["headers"]
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == 413 and "10 bytes" in error["message"]


def test_a_declared_length_over_the_cap_is_refused_before_reading() -> None:
    read, _, sent = run([b"x"], headers=[(b"content-length", b"11")])
    assert read == [] and sent[0]["status"] == 413


def test_a_body_under_the_cap_reaches_the_app_unchanged() -> None:
    read, seen, sent = run([b"ab", b"cd", b"e"])
    assert [m["body"] for m in seen] == [b"ab", b"cd", b"e"] and sent[0]["status"] == 200


def test_the_environment_names_serves_callback() -> None:
    env = proxy_env(2048)
    assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == CALLBACK
    assert env["RBLN_RAY_MAX_REQUEST_BYTES"] == "2048"
