"""What the ingress (and ``RBLNClient``) hands a model's replica: one HTTP request, as bytes.

Why bytes and not parsed request objects: the replica runs vLLM's own HTTP app
(:mod:`rbln_ray.serve.asgi_call`), so every route vLLM serves is served with vLLM's request
parsing, response shaping, status codes and error bodies, and a new vLLM route needs no
rbln-ray code. The ingress has validated the body already (with the same vLLM models) and
adds what only it knows: the routing hints below.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Any

# Request headers a replica gets: what vLLM's handlers read. Credentials (the ingress checked
# them), the connection's own headers and browser headers (the ingress answers CORS) stay.
FORWARDED_HEADERS = (
    b"content-type",
    b"accept",
    b"user-agent",
    b"x-request-id",
    b"traceparent",
    b"tracestate",
    b"endpoint-load-metrics-format",
    b"x-session-id",  # a routing key of routing: cache_aware (rbln_ray.serve.cache_routing)
)
# Response headers the ingress does not copy: its server sets them for its own connection.
HOP_BY_HOP = (b"content-length", b"transfer-encoding", b"connection", b"keep-alive")

PREFIX_CHARS = 256  # routing key length (rbln_ray.serve.routing)


@dataclass(frozen=True)
class HTTPCall:
    """One request for ``LLMServer.http``."""

    method: str
    path: str
    query: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None
    # The prompt's start, for prefix-affinity routing (rbln_ray.serve.routing).
    prefix: str = ""
    # The replica (its Serve unique id) that must serve this call: the one holding a stored
    # Responses API response (retrieve, cancel, previous_response_id).
    replica: str | None = None
    # Who is asking, for routing state kept per tenant (sessions): a digest of the API key the
    # client presented ("" without one). Never the key itself.
    tenant: str = ""


def tenant_of(credential: str) -> str:
    """The :attr:`HTTPCall.tenant` of a presented API key ("" for none)."""
    if not credential:
        return ""
    return hashlib.blake2b(credential.encode(), digest_size=8, person=b"rbln-tenant").hexdigest()


@dataclass(frozen=True)
class HTTPStart:
    """The first item a replica streams back: status, headers and the first body chunk (the
    whole body when ``more`` is False); further items are body chunks (bytes)."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    more: bool


def forwarded_headers(headers: Any) -> tuple[tuple[bytes, bytes], ...]:
    """The request headers (ASGI ``(name, value)`` byte pairs) a replica gets."""
    return tuple((k.lower(), v) for k, v in headers if k.lower() in FORWARDED_HEADERS)


def response_headers(headers: Any) -> dict[str, str]:
    """A replica's response headers as the ingress answers them."""
    return {
        k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k.lower() not in HOP_BY_HOP
    }


# ------------------------------------------------------------------ stored responses
RESPONSE_PREFIX = "resp_"


def model_tag(model: str) -> str:
    """A short stable tag of a served model's name (part of the response ids it issues)."""
    return hashlib.blake2b(model.encode(), digest_size=4).hexdigest()


def new_response_id(model: str, replica: str) -> str:
    """A Responses API id that says which model and which replica hold the response:
    ``resp_<uuid hex>-<model tag>-<replica unique id>`` (vLLM's own ids are
    ``resp_<uuid hex>``; clients treat ids as opaque)."""
    return f"{RESPONSE_PREFIX}{uuid.uuid4().hex}-{model_tag(model)}-{replica}"


def parse_response_id(response_id: str) -> tuple[str, str] | None:
    """(model tag, replica unique id) of an id :func:`new_response_id` made, else None."""
    if not response_id.startswith(RESPONSE_PREFIX):
        return None
    parts = response_id[len(RESPONSE_PREFIX) :].rsplit("-", 2)
    if len(parts) != 3 or len(parts[0]) != 32 or len(parts[1]) != 8 or not parts[2].isalnum():
        return None
    return parts[1], parts[2]


# ------------------------------------------------------------------ routing prefix
def _text(value: Any) -> str:
    """The text of a prompt-like value: a string, a list of messages or content parts, or
    token ids (stringified: equal prompts still share a key)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(_text(v) for v in value)
    if isinstance(value, dict):
        for key in ("content", "text", "input"):
            if key in value:
                return _text(value[key])
        return ""
    if hasattr(value, "model_dump"):
        return _text(value.model_dump())
    return str(value)


def routing_prefix(body: Any) -> str:
    """The routing key of a request body (a parsed vLLM request or a JSON dict): the start
    of its system text, then its prompt, messages or input."""

    def field(name: str) -> Any:
        return body.get(name) if isinstance(body, dict) else getattr(body, name, None)

    parts = [field("instructions"), field("system")]
    for name in ("messages", "input", "prompt"):
        if field(name) is not None:
            parts.append(field(name))
            break
    return "\n".join(t for t in (_text(p) for p in parts) if t)[:PREFIX_CHARS]
