"""The first lock on the HTTP path: a guard in Ray Serve's HTTP proxy itself, in front of the
ingress, on every request before any handler, buffer or API-key check of the app.

Why in the proxy: Serve's proxy reads a request's body from the client as fast as it arrives
and queues it without bound (``proxy_asgi_receive`` into a ``MessageQueue``), and the ingress
replica fetches it the same way (``ASGIReceiveProxy.fetch_until_disconnect``): nothing pushes
back on the client, and nothing times it out. The ingress's own checks (size cap, read
deadline, API key) answer only after a round trip through Ray, and until then the proxy
holds whatever the client sends, for as long as it likes: 200 connections that sent 64 KiB
of a declared 500 kB body and stopped were all still open a minute later.

What the guard does, per request, in this order:

1. **Per-client bound**: at most ``max_requests_per_client`` requests of one client address
   in the proxy at once (429 beyond);
2. **API key** (when the app has one and the proxy was given its SHA-256,
   :func:`proxy_env`): a request without the key is a 401 before a byte of its body is read,
   so unauthenticated clients hold no body buffers at all;
3. **Declared size**: a ``Content-Length`` over the cap is a 413 at once;
4. **Pending bodies**: at most ``max_pending_bodies`` bodies being read at once, and
   ``max_pending_bodies_per_client`` of one client (503 / 429 beyond);
5. **Size and deadline**: the body is buffered up to the cap (413 the moment it is exceeded)
   and must arrive whole within ``body_read_timeout_s`` (408), however slowly it drips.

Every refusal carries an OpenAI-style body (Anthropic's on ``/v1/messages``) and closes the
connection, so the server stops reading the rest. The ingress keeps its own checks (requests
that reach it by other paths).

Serve's public hook for proxy middleware is ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``
(:func:`proxy_middlewares`), read where each proxy starts: ``rbln-ray serve`` sets it and the
limits (:func:`proxy_env`) for the Ray instance it starts; a cluster started otherwise sets
them in its nodes' environment (``cluster_configs/``).

Client addresses: behind a load balancer every request comes from its address, so raise the
per-client bounds there (or give each balancer node its own).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "rbln_ray.serve.proxy_guard:proxy_middlewares"
# The proxy's settings, one variable each (the proxy process reads them when it starts). The
# values come from the Serve config's `limits` (rbln_ray.serve.config.RequestLimits).
LIMIT_ENV = {
    "max_request_bytes": "RBLN_RAY_MAX_REQUEST_BYTES",
    "body_read_timeout_s": "RBLN_RAY_BODY_READ_TIMEOUT_S",
    "max_pending_bodies": "RBLN_RAY_MAX_PENDING_BODIES",
    "max_pending_bodies_per_client": "RBLN_RAY_MAX_PENDING_BODIES_PER_CLIENT",
    "max_requests_per_client": "RBLN_RAY_MAX_REQUESTS_PER_CLIENT",
}
KEY_DIGEST_ENV = "RBLN_RAY_API_KEY_SHA256"
# Routes anyone may call when the app has an API key: probes, the version, the API docs.
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/docs", "/docs/oauth2-redirect",
                        "/openapi.json", "/redoc"})  # fmt: skip
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def key_digest(key: str) -> str:
    """What the proxy is told of the API key: its SHA-256 (the key itself stays out of every
    process environment)."""
    return hashlib.sha256(key.encode()).hexdigest()


def presented_key(headers: dict[bytes, bytes]) -> str:
    """The API key a request presents: ``Authorization: Bearer``, else Anthropic's
    ``x-api-key``."""
    given = headers.get(b"authorization", b"").decode("latin-1")
    if given.lower().startswith("bearer "):
        return given[7:]
    return headers.get(b"x-api-key", b"").decode("latin-1")


class BodyGuard:
    """Pure ASGI middleware: the checks of the module docstring, before the app runs."""

    def __init__(
        self,
        app: Any,
        max_request_bytes: int,
        body_read_timeout_s: float,
        max_pending_bodies: int,
        max_pending_bodies_per_client: int,
        max_requests_per_client: int,
        api_key_sha256: str | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_request_bytes
        self.read_timeout_s = body_read_timeout_s
        self.max_pending = max_pending_bodies
        self.max_pending_per_client = max_pending_bodies_per_client
        self.max_requests_per_client = max_requests_per_client
        self.key_digest = api_key_sha256
        self.requests: Counter[str] = Counter()  # per client, in the proxy now
        self.pending: Counter[str] = Counter()  # per client, bodies being read now

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        client = (scope.get("client") or ("unknown",))[0]
        path = scope.get("path", "")
        if self.requests[client] >= self.max_requests_per_client:
            message = (
                f"too many requests from {client} at once (at most "
                f"{self.max_requests_per_client}: limits.max_requests_per_client)"
            )
            return await refuse(send, 429, message, path)
        self.requests[client] += 1
        try:
            return await self._guarded(scope, receive, send, client, path)
        finally:
            _release(self.requests, client)

    async def _guarded(
        self, scope: MutableMapping[str, Any], receive: Receive, send: Send, client: str, path: str
    ) -> None:
        headers = dict(scope.get("headers") or [])
        if self.key_digest and path not in OPEN_PATHS:
            given = key_digest(presented_key(headers))
            if not hmac.compare_digest(given, self.key_digest):
                return await refuse(send, 401, "missing or invalid API key", path)
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await refuse(send, 413, f"request body exceeds {self.max_bytes} bytes", path)
        if sum(self.pending.values()) >= self.max_pending:
            message = f"the server is reading {self.max_pending} request bodies; retry later"
            return await refuse(send, 503, message, path)
        if self.pending[client] >= self.max_pending_per_client:
            message = (
                f"{self.max_pending_per_client} request bodies from {client} are still "
                "arriving (limits.max_pending_bodies_per_client)"
            )
            return await refuse(send, 429, message, path)
        self.pending[client] += 1
        try:
            async with asyncio.timeout(self.read_timeout_s):
                buffered = await self._read(receive)
        except TimeoutError:
            message = (
                f"the request body did not arrive within {self.read_timeout_s:g} s "
                "(limits.body_read_timeout_s)"
            )
            return await refuse(send, 408, message, path)
        finally:
            _release(self.pending, client)
        if buffered is None:
            return await refuse(send, 413, f"request body exceeds {self.max_bytes} bytes", path)
        pending = iter(buffered)

        async def replay() -> Message:
            return next(pending, None) or await receive()

        return await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> list[Message] | None:
        """The body's messages (a disconnect ends them: the app sees it), or None past the
        cap."""
        buffered: list[Message] = []
        size = 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                return buffered
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return None
            if not message.get("more_body"):
                return buffered


def _release(counts: Counter[str], client: str) -> None:
    counts[client] -= 1
    if counts[client] <= 0:
        del counts[client]


async def refuse(send: Send, status: int, message: str, path: str) -> None:
    """An error in the ingress's shape (OpenAI's, Anthropic's on ``/v1/messages``), and the
    connection closed after it so the server stops reading whatever the client still sends."""
    kind = {401: "AuthenticationError", 408: "RequestTimeoutError", 413:
            "RequestEntityTooLargeError", 429: "TooManyRequestsError",
            503: "ServiceUnavailableError"}.get(status, "Error")  # fmt: skip
    if path.startswith("/v1/messages"):
        error: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        error = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    body = json.dumps(error).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def guard_settings(environ: MutableMapping[str, str] | None = None) -> dict[str, Any]:
    """The guard's settings from the proxy's environment, each defaulting to the Serve
    config's default (:class:`~rbln_ray.serve.config.RequestLimits`)."""
    from rbln_ray.serve.config import RequestLimits

    environ = os.environ if environ is None else environ
    given = {f: environ[name] for f, name in LIMIT_ENV.items() if environ.get(name)}
    limits = RequestLimits.model_validate(given)  # types and bounds checked once, here
    settings: dict[str, Any] = {f: getattr(limits, f) for f in LIMIT_ENV}
    settings["api_key_sha256"] = environ.get(KEY_DIGEST_ENV) or None
    return settings


def proxy_middlewares() -> list[Any]:
    """Serve's proxy callback (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``)."""
    from starlette.middleware import Middleware

    return [Middleware(BodyGuard, **guard_settings())]


def proxy_env(limits: Any, api_key: str | None = None) -> dict[str, str]:
    """The environment a Ray instance's nodes need for this guard (proxies read it when they
    start): the callback, the app's ``limits`` (a ``RequestLimits``), and the API key's
    digest, empty when the app has none (every variable is set, so an environment updated
    for one app keeps nothing of an app started before it from the same process)."""
    env = {CALLBACK_ENV: CALLBACK}
    env.update({name: str(getattr(limits, f)) for f, name in LIMIT_ENV.items()})
    env[KEY_DIGEST_ENV] = key_digest(api_key) if api_key else ""
    return env
