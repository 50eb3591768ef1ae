"""A request-body cap in Ray Serve's HTTP proxy itself, in front of the ingress.

Why in the proxy: Serve's proxy reads a request's body from the client as fast as it arrives
and queues it without bound (``proxy_asgi_receive`` into a ``MessageQueue``), and the ingress
replica fetches it the same way (``ASGIReceiveProxy.fetch_until_disconnect``): nothing pushes
back on the client. The ingress refuses a body over ``limits.max_request_bytes`` after reading
just past the cap, but its 413 reaches the client only after a round trip through Ray, and
until then the proxy keeps reading (and holding) whatever the client sends: a 256 MiB upload
was read almost whole under load (RELIABILITY.md, "Malformed input"). Here the proxy buffers a
request's body up to the cap before the application sees it and answers 413 itself the
moment it is exceeded, closing the connection: the client cannot get more than the cap plus
the sockets' buffers through, whatever the load. The ingress keeps its own check (requests
that reach it by other paths).

Serve's public hook for proxy middleware is ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``
(:func:`proxy_middlewares`), read where each proxy starts: ``rbln-ray serve`` sets it (and
the cap, ``RBLN_RAY_MAX_REQUEST_BYTES``) for the Ray instance it starts; a cluster started
otherwise sets both in its nodes' environment (``cluster_configs/``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from rbln_ray.common import envs

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "rbln_ray.serve.proxy_guard:proxy_middlewares"
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyCap:
    """Pure ASGI middleware: a body over ``max_bytes`` is a 413 before the app runs."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(send)
        buffered: list[Message] = []
        size = 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break  # the client went away: the app sees the disconnect
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._too_large(send)
            if not message.get("more_body"):
                break
        pending = iter(buffered)

        async def replay() -> Message:
            return next(pending, None) or await receive()

        return await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        """An OpenAI-style 413 (the ingress's shape), and the connection closed after it so
        the server stops reading the rest of the upload."""
        body = json.dumps(
            {
                "error": {
                    "message": f"request body exceeds {self.max_bytes} bytes",
                    "type": "RequestEntityTooLargeError",
                    "param": None,
                    "code": 413,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def proxy_middlewares() -> list[Any]:
    """Serve's proxy callback (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``)."""
    from starlette.middleware import Middleware

    from rbln_ray.serve.config import RequestLimits

    default = RequestLimits.model_fields["max_request_bytes"].default
    cap = envs.get("RBLN_RAY_MAX_REQUEST_BYTES") or default
    return [Middleware(BodyCap, max_bytes=cap)]


def proxy_env(max_request_bytes: int) -> dict[str, str]:
    """The environment a Ray instance's nodes need for this guard (proxies read it)."""
    return {CALLBACK_ENV: CALLBACK, "RBLN_RAY_MAX_REQUEST_BYTES": str(max_request_bytes)}
