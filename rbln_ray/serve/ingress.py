"""The HTTP ingress: every route of vLLM's OpenAI-compatible server, in front of one server
deployment per model.

The routes are vLLM's (:mod:`rbln_ray.serve.routes`): each one the ingress serves is a clone
of vLLM's endpoint (its path, methods, dependencies and request model), so a malformed body
gets exactly vLLM's 400 before it costs a replica anything. A valid request is routed by its
``model`` field and checked against the app's limits (prompts x ``n``, ``max_tokens``,
media; a multipart upload to ``/v1/audio/*``: its ``model`` form field, and its audio's
header, :mod:`rbln_ray.serve.audio`); its body is then forwarded as bytes
(:class:`~rbln_ray.serve.http_call.HTTPCall`) through a streaming ``DeploymentHandle`` to
the model's replica, which runs it through vLLM's own app, and the answer is relayed as it
comes (JSON, SSE, bytes). A client that disconnects cancels the handle call, which aborts
the request in the engine.

Before any route: the API key (``Authorization: Bearer`` or Anthropic's ``x-api-key``), the
body size cap (413) and the body read deadline (408), in one ASGI middleware, because
FastAPI reads a body before its endpoint runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import inspect
import json
import logging
import time
import types
import typing
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rbln_ray.serve.disaggregation import PD_PATHS, PrefillPool, prefill_first
from rbln_ray.serve.http_call import (
    HTTPCall,
    forwarded_headers,
    model_tag,
    parse_response_id,
    response_headers,
    routing_prefix,
    tenant_of,
)
from rbln_ray.serve.ingress_work import IngressWork, Watchdog
from rbln_ray.serve.media_policy import check_media, check_processor_kwargs, request_media_parts
from rbln_ray.serve.proxy_guard import OPEN_PATHS, presented_key
from rbln_ray.serve.routes import (
    ANTHROPIC_PREFIX,
    Kind,
    classify,
    unknown_model_param,
    vllm_routes,
)

logger = logging.getLogger(__name__)

HEALTH_CACHE_S = 1.0  # how long one Serve status answers /health probes
# How long a probe waits for Serve's status: a controller that is restarting (Ray's memory
# monitor may kill it; max_restarts brings it back) answers nothing until it is back.
HEALTH_TIMEOUT_S = 5.0
BODY_METHODS = {"POST", "PUT", "PATCH", "DELETE"}
# Fields that may hold several prompts (completions, embeddings, scores, rerank, pooling).
PROMPT_FIELDS = ("prompt", "input", "text_1", "text_2", "data_1", "data_2", "queries",
                 "documents", "items", "texts")  # fmt: skip
# Routes whose `input` / `messages` is one conversation, not a list of prompts.
CONVERSATION_ROUTES = ("/v1/responses", ANTHROPIC_PREFIX)
CHAT_ROUTES = ("/v1/chat/completions",)
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
FAN_OUT_FIELDS = ("n", "best_of")  # sequences one prompt becomes (best_of: beam width too)
# Every body field a limit reads: a route of vLLM's whose request model has one of these is
# checked for it (tests/unit/test_http_routes.py goes over the route table).
LIMITED_FIELDS = (*FAN_OUT_FIELDS, *TOKEN_FIELDS, *PROMPT_FIELDS, "messages",
                  "mm_processor_kwargs", "media_io_kwargs")  # fmt: skip
BODY_KEY = "rbln_ray.body"  # the request body in its ASGI scope (read once, by Admission)
WARM_UP_MODEL = "rbln-ray-warm-up"  # a name no model has (the ingress's own warm-up)


# ------------------------------------------------------------------ error bodies
def family_of(path: str) -> str:
    """Which error shape a route answers with: Anthropic's on the Messages routes (as vLLM),
    OpenAI's elsewhere."""
    return "anthropic" if path.startswith(ANTHROPIC_PREFIX) else "openai"


def error_response(
    status: int,
    message: str,
    err_type: str | None = None,
    param: str | None = None,
    family: str = "openai",
) -> JSONResponse:
    """An error body in vLLM's shape: OpenAI's ``ErrorResponse`` (built by vLLM's own
    ``create_error_response``), or Anthropic's ``{"type": "error", "error": {...}}``."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    kind = err_type or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    if family == "anthropic":
        body = {"type": "error", "error": {"type": kind, "message": message}}
        return JSONResponse(body, status_code=status)
    err = create_error_response(message, kind, HTTPStatus(status), param=param)
    return JSONResponse(err.model_dump(), status_code=status)


def stream_error(path: str, message: str) -> bytes:
    """The last event of a stream whose model failed mid-way, in the route's own format."""
    if path.startswith(ANTHROPIC_PREFIX):
        data = {"type": "error", "error": {"type": "internal_error", "message": message}}
        return f"event: error\ndata: {json.dumps(data)}\n\n".encode()
    if path.startswith("/v1/responses"):
        data = {"type": "error", "code": "503", "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(data)}\n\n".encode()
    error = {"message": message, "type": "ServerError", "param": None, "code": 503}
    return f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def not_json(exc: BaseException) -> JSONResponse:
    """The 400 of a body that does not parse as JSON for a reason beyond its syntax."""
    if isinstance(exc, RecursionError):
        return error_response(400, "request body is not valid JSON: nested too deeply")
    return error_response(400, f"request body is not valid JSON: {exc}")


# ------------------------------------------------------------------ limits
def max_tokens_limit(cap: int, max_model_len: int | None) -> int:
    """The largest ``max_tokens`` a model accepts: the configured cap, or its compiled
    ``max_seq_len`` when that is smaller (no completion can be longer than the context)."""
    return cap if max_model_len is None else min(cap, max_model_len)


def max_tokens_message(model: str, max_tokens: int, limit: int) -> str:
    """The one message for a ``max_tokens`` above the cap or the compiled context."""
    return (
        f"max_tokens={max_tokens} exceeds the limit of {limit} for model {model!r} (the "
        "smaller of the configured limit and the compiled max_seq_len)"
    )


def _int(value: Any, default: int) -> int:
    """An integer field's value: a JSON integer, or a form field's digits."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def client_of(raw: Request) -> str:
    """The client's address (the key of per-client bounds)."""
    client = raw.scope.get("client")
    return str(client[0]) if client else "unknown"


def count_prompts(body: dict[str, Any], path: str = "") -> int:
    """How many prompts one request asks the engine to run (a list of strings, of token
    lists or of documents counts each; one string or one token list counts one; a batch of
    chat conversations counts each)."""
    if path.startswith(CONVERSATION_ROUTES):
        return 1
    most = 1
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], list):
        most = len(messages)  # a batch of conversations (/v1/chat/completions/batch)
    # a chat route's `documents` are its template's context, not prompts
    for name in () if path.startswith(CHAT_ROUTES) else PROMPT_FIELDS:
        value = body.get(name)
        if isinstance(value, list) and value and not isinstance(value[0], int):
            most = max(most, len(value))
    return most


# ------------------------------------------------------------------ cloned routes
Handler = Callable[[Any, Request, dict[str, Any]], Awaitable[Response]]


def clone_endpoint(route: Any, handler: Handler) -> Callable[..., Awaitable[Response]]:
    """An endpoint with the signature of vLLM's ``route.endpoint`` (its request model, path
    and query parameters) that calls ``handler(route, raw_request, params)``: FastAPI then
    parses and validates a request exactly as vLLM's server does."""
    from fastapi import Request as FastAPIRequest

    hints = typing.get_type_hints(route.endpoint, include_extras=True)
    signature = inspect.signature(route.endpoint)  # follows vLLM's decorators (__wrapped__)
    params = [p.replace(annotation=hints.get(p.name, p.annotation))
              for p in signature.parameters.values()]  # fmt: skip
    raw_name = next((p.name for p in params if p.annotation is FastAPIRequest), None)
    if raw_name is None:
        raw_name = "rbln_raw_request"
        params.append(
            inspect.Parameter(raw_name, inspect.Parameter.KEYWORD_ONLY, annotation=FastAPIRequest)
        )

    async def endpoint(**kwargs: Any) -> Response:
        raw = kwargs.pop(raw_name)
        return await handler(route, raw, kwargs)

    endpoint.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=params, return_annotation=inspect.Signature.empty
    )
    endpoint.__name__ = route.endpoint.__name__
    endpoint.__doc__ = route.endpoint.__doc__
    return endpoint


# ------------------------------------------------------------------ admission middleware
class _Disconnected(Exception):
    pass


async def read_body(receive: Callable[[], Awaitable[dict]], cap: int) -> bytes | None:
    """The request body, read message by message; None as soon as it exceeds ``cap`` bytes.

    Why not buffer it first: a chunked upload has no ``Content-Length`` to check, and a
    body read whole before its size is known could be any size.
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > cap:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class Admission:
    """ASGI middleware: the API key, then the body's size cap and read deadline."""

    def __init__(self, app: Any, ingress: OpenAIIngress) -> None:
        self.app = app
        self.ingress = ingress

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = dict(scope["headers"])
        if path not in OPEN_PATHS and not self.ingress.authorized(headers):
            denied = error_response(
                401, "missing or invalid API key", "AuthenticationError", family=family_of(path)
            )
            await denied(scope, receive, send)
            return
        if scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        limits = self.ingress.limits
        cap = limits.max_request_bytes
        try:
            declared = int(headers.get(b"content-length") or 0)
        except ValueError:
            declared = 0
        if declared > cap:
            await error_response(413, f"request body exceeds {cap} bytes")(scope, receive, send)
            return
        deadline = limits.body_read_timeout_s
        try:
            body = await asyncio.wait_for(read_body(receive, cap), deadline)
        except TimeoutError:
            message = (
                f"the request body did not arrive within {deadline:g} s "
                "(limits.body_read_timeout_s)"
            )
            await error_response(408, message)(scope, receive, send)
            return
        except _Disconnected:
            return
        if body is None:
            await error_response(413, f"request body exceeds {cap} bytes")(scope, receive, send)
            return
        scope[BODY_KEY] = body  # a multipart body is relayed as it came (forward_upload)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # the client's disconnect, for streaming responses

        await self.app(scope, replay, send)


# ------------------------------------------------------------------ the ingress
class OpenAIIngress:
    """The ingress deployment; ``servers`` maps served model names to their deployment
    handles.

    ``max_model_lens`` maps each model to its compiled ``max_seq_len`` (when known), so a
    ``max_tokens`` beyond it or beyond the configured cap gets one message;
    ``media_models`` maps each multimodal model to the media a request may give it (images,
    videos, audio; any other model takes none, :mod:`rbln_ray.serve.media_policy`);
    ``lora_bases`` maps each LoRA adapter's name to the model whose deployment serves it
    (:mod:`rbln_ray.serve.lora_models`).
    """

    async def __init__(
        self,
        servers: dict[str, Any],
        api_key: str | None,
        limits: dict[str, Any] | None = None,
        max_model_lens: dict[str, int | None] | None = None,
        media_models: dict[str, list[str]] | None = None,
        cors_allowed_origins: list[str] | None = None,
        lora_bases: dict[str, str] | None = None,
        stall_s: float | None = None,
        prefill_servers: dict[str, PrefillPool] | None = None,
    ) -> None:
        from ray import serve

        from rbln_ray.serve.config import RequestLimits
        from rbln_ray.serve.replica_bind import bind_replica_grpc_to_loopback

        bind_replica_grpc_to_loopback()
        self.configure(
            servers,
            api_key,
            RequestLimits.model_validate(limits or {}),
            max_model_lens,
            media_models,
            serve.get_replica_context().app_name,
            cors_allowed_origins,
            lora_bases,
            stall_s,
            prefill_servers,
        )

    def configure(
        self,
        servers: dict[str, Any],
        api_key: str | None,
        limits: Any,
        max_model_lens: dict[str, int | None] | None,
        media_models: dict[str, list[str]] | None,
        app_name: str,
        cors_allowed_origins: list[str] | None = None,
        lora_bases: dict[str, str] | None = None,
        stall_s: float | None = None,
        prefill_servers: dict[str, PrefillPool] | None = None,
    ) -> None:
        """Set the ingress up (its constructor's work without a Serve replica: tests);
        ``stall_s``: the config's ``ingress.unhealthy_after_stall_s`` (its default when
        None); ``prefill_servers``: the prefill pools of disaggregated models
        (:mod:`rbln_ray.serve.disaggregation`)."""
        from rbln_ray.serve.config import IngressConfig

        self.cors_allowed_origins = list(cors_allowed_origins or ())
        self.limits = limits
        self.servers = servers
        self.prefill_servers = dict(prefill_servers or {})
        self.max_model_lens = dict(max_model_lens or {})
        self.media_models = {k: tuple(v) for k, v in dict(media_models or {}).items()}
        self.lora_bases = dict(lora_bases or {})
        self.api_key = api_key
        self.app_name = app_name
        self.tags = {model_tag(name): name for name in servers}
        if len(self.tags) != len(servers):  # 2^-32 per pair: rename one model
            raise ValueError(f"two model names share a response-id tag: {sorted(servers)}")
        self._status_task: asyncio.Future | None = None
        self._status_at = 0.0
        self.work = IngressWork()
        self.stall_s = stall_s or IngressConfig().unhealthy_after_stall_s
        self.watchdog: Watchdog | None = None

    async def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve's late-bound ingress app (built in the replica, after ``__init__``)."""
        app = build_ingress_app(self)
        await warm_up(app, self.api_key)
        self.watch()
        return app

    def watch(self) -> Watchdog:
        """Start watching this ingress's event loop (the running one) and work threads."""
        if self.watchdog is None:
            loop = asyncio.get_running_loop()
            self.watchdog = Watchdog(loop, self.work.pool, self.stall_s).start()
        return self.watchdog

    async def check_health(self) -> None:
        """Serve's replica health check: an ingress whose loop or work threads stalled is
        unhealthy, and Serve replaces it (:mod:`rbln_ray.serve.ingress_work`)."""
        problem = self.watchdog.problem() if self.watchdog else None
        if problem:
            raise RuntimeError(problem)

    # ---------------------------------------------------------------- helpers
    def authorized(self, headers: dict[bytes, bytes]) -> bool:
        if not self.api_key:
            return True
        return hmac.compare_digest(presented_key(headers).encode(), self.api_key.encode())

    async def _status(self) -> Any:
        """Serve's status, fetched in a thread, shared by the probes of one cache period."""
        from ray import serve

        now = time.monotonic()
        task = self._status_task
        # a call still in flight is awaited again, never doubled: probes of a stalled
        # controller must not pile threads up
        if task is None or (task.done() and now - self._status_at > HEALTH_CACHE_S):
            self._status_at = now
            self._status_task = task = asyncio.ensure_future(asyncio.to_thread(serve.status))
        return await asyncio.wait_for(asyncio.shield(task), HEALTH_TIMEOUT_S)

    def _model(self, model: Any, family: str, param: str | None = "model") -> str | JSONResponse:
        """The served model whose deployment answers a request naming ``model`` (a LoRA
        adapter's base model: its replicas' vLLM serves the adapter), or the 4xx that says
        why there is none (``param``: what vLLM's 404 names, routes.unknown_model_param)."""
        known = ", ".join(sorted([*self.servers, *self.lora_bases]))
        if isinstance(model, str) and model in self.lora_bases:
            return self.lora_bases[model]
        if not model:
            return error_response(
                400, f"model: field required (served models: {known})", family=family
            )
        if not isinstance(model, str) or model not in self.servers:
            return error_response(
                404, f"The model `{model}` does not exist.", "NotFoundError", param, family
            )
        return model

    async def _admit(
        self, path: str, model: str, body: dict[str, Any], client: str
    ) -> JSONResponse | None:
        """The app's limits on one request (None: admitted): the same checks on every route,
        whatever its body is (JSON, or a multipart form's fields), keyed by field name, so a
        route vLLM adds is checked for every limited field it has (``LIMITED_FIELDS``; a unit
        test goes over vLLM's route table)."""
        family = family_of(path)
        limits = self.limits
        for field in FAN_OUT_FIELDS:  # sequences per prompt: n, best_of (beam width)
            value = _int(body.get(field), 1)
            if value > limits.max_n:
                message = f"{field}={value} exceeds the limit of {limits.max_n}"
                return error_response(400, message, family=family)
        n = max(_int(body.get(f), 1) or 1 for f in FAN_OUT_FIELDS)
        prompts = count_prompts(body, path)
        if prompts > limits.max_prompts:
            return error_response(
                400,
                f"{prompts} prompts in one request exceed limits.max_prompts = "
                f"{limits.max_prompts}",
                family=family,
            )
        if prompts * n > limits.max_sequences:
            return error_response(
                400,
                f"{prompts} prompts x n={n} = {prompts * n} sequences exceed "
                f"limits.max_sequences = {limits.max_sequences}",
                family=family,
            )
        asked = [_int(body.get(f), 0) for f in TOKEN_FIELDS]
        max_tokens = max(asked)
        limit = max_tokens_limit(limits.max_tokens, self.max_model_lens.get(model))
        if max_tokens > limit:
            return error_response(400, max_tokens_message(model, max_tokens, limit), family=family)
        problem = check_processor_kwargs(body, limits)
        if problem is None:
            problem = await self._check_media(path, model, body, client)
        if problem is not None:
            return error_response(*problem, family=family)
        return None

    async def _check_media(
        self, path: str, model: str, body: dict[str, Any], client: str
    ) -> tuple[int, str] | None:
        """The media policy (:mod:`rbln_ray.serve.media_policy`), decoding off the loop."""
        from vllm.exceptions import VLLMClientError

        try:
            parts = list(request_media_parts(path, body))
        except (VLLMClientError, ValueError) as exc:
            return 400, str(exc)
        if not parts:
            return None
        accepts = self.media_models.get(model, ())
        return await self.work.run(client, check_media, model, parts, accepts, self.limits)

    @staticmethod
    async def _json(raw: Request) -> dict[str, Any] | JSONResponse:
        """The request body as a JSON object (FastAPI has parsed it once already)."""
        try:
            body = await raw.json()
        except (RecursionError, ValueError) as exc:
            return not_json(exc)
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        return body

    def _call(self, raw: Request, body: bytes, prefix: str = "", replica: str | None = None):
        credential = presented_key(dict(raw.scope["headers"])) if self.api_key else ""
        return HTTPCall(
            method=raw.method,
            path=raw.scope["path"],
            query=raw.scope.get("query_string", b""),
            headers=forwarded_headers(raw.scope["headers"]),
            body=body,
            client=tuple(raw.scope["client"]) if raw.scope.get("client") else None,
            prefix=prefix,
            replica=replica,
            tenant=tenant_of(credential),
        )

    # ---------------------------------------------------------------- route handlers
    async def forward(self, route: Any, raw: Request, params: dict[str, Any]) -> Response:
        """A request naming its model in the body (``Kind.MODEL``)."""
        if raw.headers.get("content-type", "").startswith("multipart/form-data"):
            return await self.forward_upload(raw)
        path = raw.scope["path"]
        family = family_of(path)
        body = await self._json(raw)
        if isinstance(body, Response):
            return body
        model = self._model(body.get("model"), family, unknown_model_param(route))
        if isinstance(model, Response):
            return model
        refused = await self._admit(path, model, body, client_of(raw))
        if refused is not None:
            return refused
        previous = body.get("previous_response_id")
        found = parse_response_id(previous) if isinstance(previous, str) else None
        replica = found[1] if found and self.tags.get(found[0]) == model else None
        call = self._call(raw, await raw.body(), routing_prefix(body), replica)
        if model in self.prefill_servers and path in PD_PATHS:
            call = await prefill_first(self.prefill_servers[model], call, body, model)
        return await self.relay(model, call)

    async def forward_upload(self, raw: Request) -> Response:
        """A multipart upload (``/v1/audio/*``, vLLM's form parsed and validated already):
        routed by its ``model`` field, its fields admitted as a JSON body's are, its audio
        checked by its header, then relayed byte for byte, or as WAV when only FFmpeg reads
        it (:func:`rbln_ray.serve.audio.prepare_upload`)."""
        from rbln_ray.serve.audio import prepare_upload, upload_bytes, with_file

        form = await raw.form()  # FastAPI's parse, cached on the request
        model = self._model(form.get("model"), "openai")
        if isinstance(model, Response):
            return model
        client = client_of(raw)
        fields = {k: v for k, v in form.multi_items() if isinstance(v, str)}
        refused = await self._admit(raw.scope["path"], model, fields, client)
        if refused is not None:
            return refused
        data = await upload_bytes(form)
        if isinstance(data, tuple):
            return error_response(*data)
        prepared = await self.work.run(client, prepare_upload, data, self.limits)
        if isinstance(prepared, tuple):
            return error_response(*prepared)
        call = self._call(raw, raw.scope[BODY_KEY])
        if prepared is not None:  # re-encoded: the form again, with the WAV as its file
            body, content_type = with_file(form, prepared, "upload.wav")
            headers = tuple((k, content_type.encode() if k == b"content-type" else v)
                            for k, v in call.headers)  # fmt: skip
            call = dataclasses.replace(call, body=body, headers=headers)
        return await self.relay(model, call)

    async def forward_stored(self, route: Any, raw: Request, params: dict[str, Any]) -> Response:
        """Retrieve or cancel a stored response (``Kind.RESPONSE_ID``): to the replica whose
        id it carries (:func:`rbln_ray.serve.http_call.new_response_id`)."""
        response_id = params.get("response_id", "")
        found = parse_response_id(response_id)
        if found and found[0] in self.tags:
            return await self.relay(self.tags[found[0]], self._call(raw, b"", replica=found[1]))
        if len(self.servers) == 1:  # an id of vLLM's own format: the only model
            return await self.relay(next(iter(self.servers)), self._call(raw, b""))
        return error_response(
            404,
            f"Response with id '{response_id}' not found.",
            "invalid_request_error",
            "response_id",
        )

    async def forward_query(self, route: Any, raw: Request, params: dict[str, Any]) -> Response:
        """A GET about a model without a body (``Kind.QUERY_MODEL``, e.g.
        ``/tokenizer_info``): ``?model=`` names it (an rbln-ray extension: ``vllm serve``
        has one model), or the only model."""
        model = raw.query_params.get("model")
        if model is None and len(self.servers) == 1:
            model = next(iter(self.servers))
        found = self._model(model, family_of(raw.scope["path"]))
        if isinstance(found, Response):
            return found
        return await self.relay(found, self._call(raw, b""))

    async def relay(self, model: str, call: HTTPCall) -> Response:
        """Call the model's server and relay its answer (JSON, SSE or bytes).

        A call whose replica or engine died before the first item (the whole body, or the
        first streamed event) is retried once (:mod:`rbln_ray.serve.retry`); after that, a
        failure is a 503, or for a stream under way a final error event.
        """
        from rbln_ray.serve.request_metrics import record_retry
        from rbln_ray.serve.retry import retry_reason

        family = family_of(call.path)
        handle = self.servers[model].options(stream=True)
        for attempt in (1, 2):
            stream = handle.http.remote(call)
            try:
                first = await stream.__anext__()
                break
            except BackPressureError:
                return error_response(
                    429,
                    f"model {model!r} is at capacity; retry later",
                    "TooManyRequestsError",
                    family=family,
                )
            except Exception as exc:  # noqa: BLE001 - classified below, never re-raised
                stream.cancel()  # a no-op for a dead replica; aborts anything still running
                reason = retry_reason(exc)
                if attempt == 1 and reason is not None:
                    record_retry(model, reason)
                    logger.warning(
                        "model %s: %s before the response began (%s); retrying once on "
                        "another replica",
                        model,
                        reason.replace("_", " "),
                        first_line(exc),
                    )
                    continue
                logger.warning("model %s failed a request: %s", model, first_line(exc))
                return error_response(
                    503, f"model {model!r} failed: {type(exc).__name__}", family=family
                )
        headers = response_headers(first.headers)
        if not first.more:
            return Response(first.body, status_code=first.status, headers=headers)
        sse = headers.get("content-type", "").startswith("text/event-stream")

        async def body() -> AsyncIterator[bytes]:
            yield first.body
            try:
                async for chunk in stream:
                    yield chunk
            except Exception as exc:
                logger.warning("model %s failed mid-stream: %s", model, first_line(exc))
                if not sse:
                    raise  # a byte stream has no error event: the connection breaks
                yield stream_error(call.path, f"model failed: {type(exc).__name__}")

        return StreamingResponse(body(), status_code=first.status, headers=headers)

    async def list_models(self) -> Response:
        data: list[dict[str, Any]] = []
        for handle in self.servers.values():
            data.extend((await handle.models.remote())["data"])
        return JSONResponse({"object": "list", "data": data})

    async def model_card(self, model: str) -> Response:
        """``GET /v1/models/{model}`` (OpenAI's retrieve; ``vllm serve`` has only the list)."""
        found = self._model(model, "openai")
        if isinstance(found, Response):
            return found
        cards = (await self.servers[found].models.remote())["data"]
        card = next((c for c in cards if c.get("id") == model), cards[0] if cards else None)
        return JSONResponse(card)

    async def health(self) -> Response:
        """200 when every model deployment is healthy; 503 naming the ones that are not.

        Serve's status is a controller RPC: made off the event loop, at most once per
        ``HEALTH_CACHE_S`` however many probes arrive (the route needs no API key), and
        waited for at most ``HEALTH_TIMEOUT_S``: a probe is answered even while the
        controller is down. An ingress whose event loop or work threads stalled
        (:mod:`rbln_ray.serve.ingress_work`) is a 503 whatever Serve says."""
        problem = self.watchdog.problem() if self.watchdog else None
        if problem:
            return JSONResponse({"status": problem}, 503)
        try:
            app_status = (await self._status()).applications.get(self.app_name)
        except TimeoutError:
            message = f"Serve's controller did not answer within {HEALTH_TIMEOUT_S:g} s"
            return JSONResponse({"status": message}, 503)
        except Exception as exc:  # noqa: BLE001 - the controller unreachable: not healthy
            return JSONResponse({"status": f"status unavailable: {first_line(exc)}"}, 503)
        if app_status is None:
            return JSONResponse({"status": "unknown application"}, status_code=503)
        deployments = {name: d.status.value for name, d in app_status.deployments.items()}
        healthy = all(s == "HEALTHY" for s in deployments.values())
        body = {"status": "ok" if healthy else "degraded", "deployments": deployments}
        return JSONResponse(body, status_code=200 if healthy else 503)


def unserved_endpoint(method: str, path: str, reason: str) -> Callable[[], Awaitable[Response]]:
    message = f"{method} {path} is not served by rbln-ray: {reason}"

    async def unserved() -> Response:
        return error_response(404, message, "NotFoundError")

    return unserved


async def _http_exception(request: Request, exc: StarletteHTTPException) -> Response:
    """vLLM's handlers: its own for FastAPI's ``HTTPException``, FastAPI's for the rest
    (``{"detail": "Not Found"}``, as ``vllm serve``); but a body that does not parse for a
    reason beyond JSON syntax (bad UTF-8, nested too deeply, an integer of thousands of
    digits; FastAPI says only "There was an error parsing the body") gets an OpenAI-style
    400 that says which."""
    from fastapi.exception_handlers import http_exception_handler as fastapi_handler
    from vllm.entrypoints.serve.exception_handling.handlers.http import http_exception_handler

    cause = exc.__cause__
    if isinstance(cause, RecursionError | ValueError):
        return not_json(cause)
    if isinstance(exc, HTTPException):
        return await http_exception_handler(request, exc)
    return await fastapi_handler(request, exc)


def build_ingress_app(ingress: OpenAIIngress) -> FastAPI:
    """The ingress's FastAPI app: vLLM's routes, sorted by :func:`routes.classify`."""
    from vllm import __version__ as vllm_version
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    app = FastAPI(title="rbln-ray", description="vLLM's OpenAI-compatible API on RBLN NPUs")
    app.state.args = types.SimpleNamespace(log_error_stack=False)  # read by vLLM's handlers
    handlers: dict[Kind, Handler] = {
        Kind.MODEL: ingress.forward,
        Kind.RESPONSE_ID: ingress.forward_stored,
        Kind.QUERY_MODEL: ingress.forward_query,
    }
    for (path, method), route in vllm_routes().items():
        kind, reason = classify(path, method, route)
        if kind in handlers:
            app.add_api_route(
                path,
                clone_endpoint(route, handlers[kind]),
                methods=[method],
                dependencies=route.dependencies,
                responses=route.responses,
                name=route.name,
            )
        elif kind is Kind.UNSERVED:
            app.add_api_route(path, unserved_endpoint(method, path, reason or ""),
                              methods=[method], include_in_schema=False)  # fmt: skip

    async def version() -> Response:
        return JSONResponse({"version": vllm_version})

    async def model_card(model: str) -> Response:
        return await ingress.model_card(model)

    app.add_api_route("/health", ingress.health, methods=["GET"])
    app.add_api_route("/ping", ingress.health, methods=["GET", "POST"])
    app.add_api_route("/version", version, methods=["GET"])
    app.add_api_route("/v1/models", ingress.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", model_card, methods=["GET"])
    init_exception_handler(app)  # vLLM's: its request models raise vLLM's own errors too
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_middleware(Admission, ingress=ingress)
    if ingress.cors_allowed_origins:  # outermost: a preflight needs no API key
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=ingress.cors_allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    return app


async def warm_up(app: FastAPI, api_key: str | None) -> None:
    """Run what the first requests would otherwise pay for (seconds of imports and first
    validations; BENCHMARKS §10): a completion and a chat request through the whole app,
    for a model no one serves (so nothing is forwarded)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
        for path, body in (
            ("/v1/completions", {"prompt": "x", "max_tokens": 1}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ):
            answer = await client.post(path, json={"model": WARM_UP_MODEL, **body}, headers=headers)
            if answer.status_code != 404:
                logger.warning("ingress warm-up %s answered %s", path, answer.status_code)
