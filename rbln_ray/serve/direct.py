"""``routing: direct``: the model's replicas are the app's HTTP ingress.

Why: in the routed app a request crosses two replicas, the ingress (checks, routing, the SSE
relay) and a model replica, and the handle call between them is the largest part of what
Serve adds to a request's first token (BENCHMARKS 18, stage by stage). Here each model
replica runs the ingress's app itself (:class:`~rbln_ray.serve.ingress.OpenAIIngress`: the
API key, limits, media policy, vLLM's validation, the same error bodies) and answers from
its own engine, so Serve's proxy (or HAProxy) sends a request straight to the replica that
serves it.

What it gives up, and why that is the choice to make rather than a default:

* request-aware routing: the proxy balances the replicas (HAProxy: least connections,
  Serve's proxy: its power of two choices), blind to prompts and caches;
* the ingress's retry: a replica whose engine dies takes the requests it holds with it;
* an OpenAI error body on overload: beyond the replica's queue Serve's proxy answers 429
  itself (the deployment's ``BackpressureConfig``), with its own plain-text body;
* several models, prefill/decode pools and stored responses across replicas, which need
  the ingress to send a request somewhere chosen: :class:`~rbln_ray.serve.config.AppConfig`
  refuses them with the reason.

So it suits one model per app where latency counts and prompts share little, or one replica
per app; the routed app stays the default.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from rbln_ray.serve.config import RequestLimits
from rbln_ray.serve.http_call import HTTPCall, HTTPStart
from rbln_ray.serve.ingress import OpenAIIngress
from rbln_ray.serve.server import LLMServer


class LocalStream:
    """One call's answer from this replica's own server, as the ingress reads a Serve
    handle's streamed response (``__anext__``, iteration, ``cancel``)."""

    def __init__(self, answer: AsyncGenerator[HTTPStart | bytes, None]) -> None:
        self._answer = answer

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> HTTPStart | bytes:
        return await self._answer.__anext__()

    def cancel(self) -> None:
        """Close the answer: the server tells vLLM's app the client went away."""
        asyncio.ensure_future(self._answer.aclose())


class _Method:
    def __init__(self, call: Any) -> None:
        self.remote = call


class LocalServer:
    """This replica's :class:`LLMServer` behind the part of a Serve handle's API the ingress
    uses (``options(stream=True).http.remote(call)``, ``models.remote()``): the ingress's
    code runs unchanged, with no hop between it and the engine."""

    def __init__(self, server: LLMServer) -> None:
        self.server = server
        self.http = _Method(lambda call: LocalStream(server.http(call)))
        self.models = _Method(server.models)

    def options(self, **_: Any) -> LocalServer:
        return self


async def start_server(cfg: dict[str, Any], limits: dict[str, Any]) -> LLMServer:
    """An :class:`LLMServer` built inside this replica (its constructor is async, as Serve
    runs it): the deployment holds it instead of being one, because Serve's ingress wrapper
    claims the attribute ``app`` that the server keeps vLLM's app in."""
    server = LLMServer.__new__(LLMServer)
    await server.__init__(cfg, limits)  # type: ignore[misc]
    return server


class DirectServer:
    """A model replica that is the app's ingress (module docstring): :class:`LLMServer`'s
    engine and vLLM app, behind :class:`OpenAIIngress`'s app on this replica's own HTTP."""

    async def __init__(
        self,
        cfg: dict[str, Any],
        api_key: str | None,
        limits: dict[str, Any],
        max_model_lens: dict[str, int | None],
        media_models: dict[str, list[str]],
        cors_allowed_origins: list[str],
        lora_bases: dict[str, str],
    ) -> None:
        """``cfg`` for the engine; the rest as :class:`OpenAIIngress` takes them
        (:func:`rbln_ray.serve.builder.ingress_checks`)."""
        from ray import serve

        self.server = await start_server(cfg, limits)
        self.ingress = OpenAIIngress.__new__(OpenAIIngress)
        self.ingress.configure(
            {self.server.cfg.name: LocalServer(self.server)},
            api_key,
            RequestLimits.model_validate(limits),
            max_model_lens,
            media_models,
            serve.get_replica_context().app_name,
            cors_allowed_origins,
            lora_bases,
        )

    async def __serve_build_asgi_app__(self) -> Any:
        """Serve's late-bound ingress app: the ingress's, built in this replica."""
        return await self.ingress.__serve_build_asgi_app__()

    async def check_health(self) -> None:
        """Unhealthy when the engine died or the ingress's loop or work threads stalled."""
        await self.server.check_health()
        await self.ingress.check_health()

    # What callers of a model deployment's handle use: the Python client, tests, benchmarks.
    async def http(self, call: HTTPCall) -> AsyncIterator[HTTPStart | bytes]:
        async for item in self.server.http(call):
            yield item

    async def models(self) -> dict[str, Any]:
        return await self.server.models()

    async def engine_stats(self) -> dict[str, Any]:
        return await self.server.engine_stats()
