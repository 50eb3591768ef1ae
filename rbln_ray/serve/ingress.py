"""The HTTP ingress: OpenAI-compatible routes in front of one server deployment per model.

Requests are validated here with vLLM's own protocol models (so a malformed body is a 400
with an OpenAI-style error body before it costs a replica anything), routed by their
``model`` field, and relayed to the model's server through a streaming ``DeploymentHandle``.
A client that disconnects cancels the handle call, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import TypeAdapter, ValidationError
from ray.serve.exceptions import BackPressureError
from vllm.exceptions import VLLMClientError

from rbln_ray.serve.media_policy import check_media, check_processor_kwargs, media_parts

logger = logging.getLogger(__name__)

HEALTH_CACHE_S = 1.0  # how long one Serve status answers /health probes

app = FastAPI(title="rbln-ray", description="OpenAI-compatible serving on Rebellions RBLN NPUs")


def error_response(status: int, message: str, err_type: str | None = None) -> JSONResponse:
    """An OpenAI-style error body, built by vLLM's own ``create_error_response``."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    kind = err_type or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    body = create_error_response(message, kind, HTTPStatus(status)).model_dump()
    return JSONResponse(body, status_code=status)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


async def read_body(request: Request, cap: int) -> bytes | None:
    """The request body, read chunk by chunk; None as soon as it exceeds ``cap`` bytes.

    Why not ``request.body()``: that buffers the whole body before anyone can look at its
    size, and a chunked upload has no ``Content-Length`` to check first.
    """
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


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


def warm_request_path() -> None:
    """Import and run once what the first request would otherwise pay for: vLLM's protocol
    models and their validation, and vLLM's error responses (seconds of imports; BENCHMARKS
    §10)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    CompletionRequest.model_validate({"model": "warm-up", "prompt": "x", "max_tokens": 1})
    ChatCompletionRequest.model_validate(
        {"model": "warm-up", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    )
    error_response(400, "warm-up").render({"warm": "up"})


@functools.cache
def _adapter(model_cls: Any) -> TypeAdapter:
    """One pydantic adapter per request type (building one costs more than a validation)."""
    return TypeAdapter(model_cls)


# Fields that may hold several prompts (completions, embeddings, scores, rerank).
PROMPT_FIELDS = ("prompt", "input", "text_1", "text_2", "data_1", "data_2", "queries",
                 "documents", "items")  # fmt: skip


def count_prompts(parsed: Any) -> int:
    """How many prompts one request asks the engine to run (a list of strings, of token
    lists or of documents counts each; one string or one token list counts one)."""
    most = 1
    for name in PROMPT_FIELDS:
        value = getattr(parsed, name, None)
        if isinstance(value, list) and value and not isinstance(value[0], int):
            most = max(most, len(value))
    return most


def validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ())) or "body"
        parts.append(f"{where}: {err.get('msg')}")
    return "; ".join(parts)


class OpenAIIngress:
    """FastAPI ingress; ``servers`` maps served model names to their deployment handles.

    ``max_model_lens`` maps each model to its compiled ``max_seq_len`` (when known), so a
    ``max_tokens`` beyond it or beyond the configured cap gets one message (:meth:`_parse`);
    ``image_models`` names the vision-language models (the only ones a chat message may give
    images to, :mod:`rbln_ray.serve.media_policy`), ``speech_models`` the speech-to-text ones
    (the only ones ``/v1/audio/*`` reaches, :mod:`rbln_ray.serve.audio`).
    """

    async def __init__(
        self,
        servers: dict[str, Any],
        api_key: str | None,
        limits: dict[str, Any] | None = None,
        max_model_lens: dict[str, int | None] | None = None,
        image_models: list[str] | None = None,
        speech_models: list[str] | None = None,
    ) -> None:
        from ray import serve

        from rbln_ray.serve.config import RequestLimits
        from rbln_ray.serve.replica_bind import bind_replica_grpc_to_loopback

        bind_replica_grpc_to_loopback()
        self.limits = RequestLimits.model_validate(limits or {})
        self.servers = servers
        self.max_model_lens = dict(max_model_lens or {})
        self.image_models = set(image_models or ())
        self.speech_models = list(speech_models or ())  # /v1/audio/* (rbln_ray.serve.audio)
        self.api_key = api_key
        self.app_name = serve.get_replica_context().app_name
        self._status_task: asyncio.Future | None = None
        self._status_at = 0.0
        warm_request_path()

    # ---------------------------------------------------------------- helpers
    async def _status(self) -> Any:
        """Serve's status, fetched in a thread, shared by the probes of one cache period."""
        from ray import serve

        now = time.monotonic()
        if self._status_task is None or now - self._status_at > HEALTH_CACHE_S:
            self._status_at = now
            self._status_task = asyncio.ensure_future(asyncio.to_thread(serve.status))
        return await asyncio.shield(self._status_task)

    def _unauthorized(self, request: Request) -> JSONResponse | None:
        if not self.api_key:
            return None
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            return error_response(401, "missing or invalid API key", "AuthenticationError")
        return None

    async def _parse(self, request: Request, model_cls: Any) -> Any:
        """The body validated as ``model_cls`` (a vLLM protocol model, or a union of them
        such as ``EmbeddingRequest``), or the 4xx response that says why it is not one."""
        cap = self.limits.max_request_bytes
        if int(request.headers.get("content-length") or 0) > cap:
            return error_response(413, f"request body exceeds {cap} bytes")
        deadline = self.limits.body_read_timeout_s
        try:
            raw = await asyncio.wait_for(read_body(request, cap), deadline)
        except TimeoutError:
            return error_response(
                408,
                f"the request body did not arrive within {deadline:g} s "
                "(limits.body_read_timeout_s)",
            )
        if raw is None:
            return error_response(413, f"request body exceeds {cap} bytes")
        try:
            body = json.loads(raw)
        except RecursionError:
            return error_response(400, "request body is not valid JSON: nested too deeply")
        except ValueError as exc:  # malformed JSON, bad UTF-8, an integer of 4,300+ digits
            return error_response(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        try:
            parsed = _adapter(model_cls).validate_python(body)
        except ValidationError as exc:
            return error_response(400, validation_message(exc))
        except (VLLMClientError, ValueError) as exc:  # vLLM's own request checks
            return error_response(400, str(exc))
        known = ", ".join(sorted(self.servers))
        if not parsed.model:
            return error_response(400, f"model: field required (served models: {known})")
        if parsed.model not in self.servers:
            return error_response(
                404,
                f"model {parsed.model!r} does not exist; served models: {known}",
                "NotFoundError",
            )
        limits = self.limits
        n = getattr(parsed, "n", None) or 1
        if n > limits.max_n:
            return error_response(400, f"n={n} exceeds the limit of {limits.max_n}")
        prompts = count_prompts(parsed)
        if prompts > limits.max_prompts:
            return error_response(
                400,
                f"{prompts} prompts in one request exceed limits.max_prompts = "
                f"{limits.max_prompts}",
            )
        if prompts * n > limits.max_sequences:
            return error_response(
                400,
                f"{prompts} prompts x n={n} = {prompts * n} sequences exceed "
                f"limits.max_sequences = {limits.max_sequences}",
            )
        asked = [getattr(parsed, f, None) for f in ("max_tokens", "max_completion_tokens")]
        max_tokens = max((t for t in asked if t is not None), default=None)
        limit = max_tokens_limit(limits.max_tokens, self.max_model_lens.get(parsed.model))
        if max_tokens is not None and max_tokens > limit:
            return error_response(400, max_tokens_message(parsed.model, max_tokens, limit))
        problem = check_processor_kwargs(parsed, limits)
        if problem is None and getattr(parsed, "messages", None):
            problem = await self._check_media(parsed)
        if problem is not None:
            return error_response(*problem)
        return parsed

    async def _check_media(self, parsed: Any) -> tuple[int, str] | None:
        """The media policy (:mod:`rbln_ray.serve.media_policy`), decoding off the loop."""
        try:
            parts = list(media_parts(parsed.messages))
        except (VLLMClientError, ValueError) as exc:
            return 400, str(exc)
        if not parts:
            return None
        accepts = ("image",) if parsed.model in self.image_models else ()
        return await asyncio.to_thread(check_media, parsed.model, parts, accepts, self.limits)

    async def _relay(self, parsed: Any, method: str) -> Response:
        """Call the model's server and turn its stream into a JSON or SSE response.

        A call whose replica or engine died before the first item (the whole body, or the
        first streamed token) is retried once (:mod:`rbln_ray.serve.retry`); after that, a
        failure is a 503, or for a stream under way a final SSE error event.
        """
        from rbln_ray.serve.request_metrics import record_retry
        from rbln_ray.serve.retry import retry_reason

        handle = self.servers[parsed.model].options(stream=True)
        for attempt in (1, 2):
            stream = getattr(handle, method).remote(parsed)
            try:
                first = await stream.__anext__()
                break
            except BackPressureError:
                return error_response(
                    429,
                    f"model {parsed.model!r} is at capacity; retry later",
                    "TooManyRequestsError",
                )
            except Exception as exc:  # noqa: BLE001 - classified below, never re-raised
                stream.cancel()  # a no-op for a dead replica; aborts anything still running
                reason = retry_reason(exc)
                if attempt == 1 and reason is not None:
                    record_retry(parsed.model, reason)
                    logger.warning(
                        "model %s: %s before the response began (%s); retrying once on "
                        "another replica",
                        parsed.model,
                        reason.replace("_", " "),
                        first_line(exc),
                    )
                    continue
                logger.warning("model %s failed a request: %s", parsed.model, first_line(exc))
                return error_response(503, f"model {parsed.model!r} failed: {type(exc).__name__}")
        if isinstance(first, dict):
            status = first.get("error", {}).get("code", 200) if "error" in first else 200
            return JSONResponse(first, status_code=status)

        async def sse() -> AsyncIterator[str]:
            yield first
            try:
                async for chunk in stream:
                    yield chunk
            except Exception as exc:  # noqa: BLE001 - end the stream with an error event
                logger.warning("model %s failed mid-stream: %s", parsed.model, first_line(exc))
                error = {
                    "message": f"model failed: {type(exc).__name__}",
                    "type": "ServerError",
                    "param": None,
                    "code": 503,
                }
                yield f"data: {json.dumps({'error': error})}\n\n"
                yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    async def _call(self, request: Request, model_cls: Any, method: str) -> Response:
        """Authorise, parse as ``model_cls``, relay to the model server's ``method``."""
        denied = self._unauthorized(request)
        if denied:
            return denied
        parsed = await self._parse(request, model_cls)
        if isinstance(parsed, Response):
            return parsed
        encoding = getattr(parsed, "encoding_format", None)  # embedding requests have one
        if encoding not in (None, "float", "base64"):
            # vLLM's bytes encodings stream raw tensors, which the replica does not relay.
            return error_response(400, f"encoding_format={encoding!r}: use 'float' or 'base64'")
        return await self._relay(parsed, method)

    # ---------------------------------------------------------------- routes
    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        return await self._call(request, CompletionRequest, "completions")

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return await self._call(request, ChatCompletionRequest, "chat")

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        from vllm.entrypoints.pooling.embed.protocol import EmbeddingRequest

        return await self._call(request, EmbeddingRequest, "embeddings")

    @app.post("/v1/score")
    @app.post("/score")
    async def score(self, request: Request) -> Response:
        from vllm.entrypoints.pooling.scoring.protocol import ScoreRequest

        return await self._call(request, ScoreRequest, "score")

    @app.post("/v1/rerank")
    @app.post("/rerank")
    async def rerank(self, request: Request) -> Response:
        from vllm.entrypoints.pooling.scoring.protocol import RerankRequest

        return await self._call(request, RerankRequest, "score")

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(self, request: Request) -> Response:
        return await self._speech(request, "transcription")

    @app.post("/v1/audio/translations")
    async def translations(self, request: Request) -> Response:
        return await self._speech(request, "translation")

    async def _speech(self, request: Request, task: str) -> Response:
        """A multipart speech-to-text upload: checked (:mod:`rbln_ray.serve.audio`), then
        relayed to the model server's ``transcriptions`` / ``translations``."""
        from rbln_ray.serve.audio import parse_upload

        denied = self._unauthorized(request)
        if denied:
            return denied
        models = list(self.servers)
        upload = await parse_upload(request, task, self.limits, models, self.speech_models)
        if isinstance(upload, tuple):
            return error_response(*upload)
        return await self._relay(upload, f"{task}s")

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        denied = self._unauthorized(request)
        if denied:
            return denied
        data: list[dict[str, Any]] = []
        for handle in self.servers.values():
            data.extend((await handle.models.remote())["data"])
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health(self) -> Response:
        """200 when every model deployment is healthy; 503 naming the ones that are not.

        Serve's status is a controller RPC: made off the event loop, and at most once per
        ``HEALTH_CACHE_S`` however many probes arrive (the route needs no API key)."""
        try:
            app_status = (await self._status()).applications.get(self.app_name)
        except Exception as exc:  # noqa: BLE001 - the controller unreachable: not healthy
            return JSONResponse({"status": f"status unavailable: {first_line(exc)}"}, 503)
        if app_status is None:
            return JSONResponse({"status": "unknown application"}, status_code=503)
        deployments = {name: d.status.value for name, d in app_status.deployments.items()}
        healthy = all(s == "HEALTHY" for s in deployments.values())
        body = {"status": "ok" if healthy else "degraded", "deployments": deployments}
        return JSONResponse(body, status_code=200 if healthy else 503)
