"""The per-model server deployment: one vLLM ``AsyncLLM`` engine per replica.

Each replica builds its engine and its HTTP app exactly as ``vllm serve`` does (vLLM's own
argument parser, ``build_app`` and ``init_app_state``), so every route, protocol model, chat
template, tool and reasoning parser, validation and error body is vLLM's. The engine runs on
:class:`~rbln_ray.executor.RBLNRayExecutor`, whose worker actors take the ``RBLN`` bundles of
the replica's placement group: Serve places a replica only where its devices are free, and
the devices die with the replica. With ``distributed_executor_backend: uni`` the replica
holds the devices itself and its engine process runs the worker (one process fewer).

Requests arrive through a ``DeploymentHandle`` (``stream=True``) as
:class:`~rbln_ray.serve.http_call.HTTPCall` objects: :meth:`LLMServer.http` runs each through
vLLM's app in process (:mod:`rbln_ray.serve.asgi_call`) and streams back an
:class:`~rbln_ray.serve.http_call.HTTPStart` and then body chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from rbln_ray.serve.config import ModelDeploymentConfig, RequestLimits
from rbln_ray.serve.disaggregation import PD_PATHS, transfer_params
from rbln_ray.serve.http_call import HTTPCall, HTTPStart
from rbln_ray.serve.kv_handover import handover_for

logger = logging.getLogger(__name__)

DEATH_TIMEOUT_S = 30.0  # bound on waiting for this replica's own kill (see LLMServer._die)
STOP_TIMEOUT_S = 10.0  # bound on shutting a dead engine down before that kill
# Environment a replica's vLLM app must not see: the ingress owns authentication, and engine
# control routes (development mode, runtime LoRA) are not served (rbln_ray.serve.routes).
UNSET_ENV = ("VLLM_API_KEY", "VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
RESPONSES_ROUTES = ("/v1/responses", "/v1/responses/render")


def engine_namespace(
    cfg: ModelDeploymentConfig, model_path: str, limits: RequestLimits | None = None
):
    """``vllm serve``'s parsed arguments for this model (its options parsed by vLLM's own
    parser, :mod:`rbln_ray.serve.vllm_args`), with rbln-ray's engine settings and the app's
    media policy (:func:`rbln_ray.serve.media_policy.replica_media_args`: it wins over
    ``engine_kwargs``)."""
    from rbln_ray.families.registry import vision_for_dir
    from rbln_ray.serve.lora_models import lora_engine_args
    from rbln_ray.serve.media_policy import replica_media_args
    from rbln_ray.serve.vllm_args import serve_namespace
    from rbln_ray.vllm_plugin.options import PREFIX

    kwargs = cfg.vllm_kwargs()
    for key, value in lora_engine_args(cfg, model_path).items():  # its compiled adapters
        kwargs.setdefault(key, value)
    family = vision_for_dir(model_path)
    media = family.inputs if family is not None else ()
    kwargs.update(replica_media_args(limits or RequestLimits(), media))
    args = serve_namespace(model_path, cfg.name, kwargs)
    if "fingerprint_mode" not in kwargs:
        # vLLM's default fingerprint hashes the whole engine config, which includes this
        # replica's own Ray driver details: every replica would answer with another one.
        args.fingerprint_mode = "custom"
        args.fingerprint_value = deployment_fingerprint(cfg, model_path)
    if not cfg.in_process_worker:
        args.distributed_executor_backend = "rbln_ray.executor.RBLNRayExecutor"
    placement = cfg.placement().model_dump()
    args.additional_config = {
        **(args.additional_config or {}),
        PREFIX + "compile": cfg.compile.as_dict(),
        **{PREFIX + name: value for name, value in placement.items()},
    }
    # The ingress owns authentication: calls it forwards carry no key.
    args.api_key = None
    return args


def deployment_fingerprint(cfg: ModelDeploymentConfig, model_path: str) -> str:
    """``system_fingerprint`` of every response of one deployment: the same on every replica,
    new when vLLM, the deployment's config or the compiled model change."""
    import hashlib

    from vllm import __version__ as vllm_version

    digest = hashlib.sha256(cfg.model_dump_json().encode())
    rbln_config = Path(model_path) / "rbln_config.json"
    if rbln_config.is_file():
        digest.update(rbln_config.read_bytes())
    return f"vllm-{vllm_version}-rbln-{digest.hexdigest()[:8]}"


def json_error(status: int, message: str, err_type: str, param: str | None = None) -> bytes:
    """An OpenAI-style error body (vLLM's ``ErrorResponse``)."""
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

    info = ErrorInfo(message=message, type=err_type, param=param, code=status)
    return json.dumps(ErrorResponse(error=info).model_dump()).encode()


def own_failure(start: HTTPStart) -> bool:
    """Whether a failed answer is the request's own ``GenerationError`` (its device step
    raised: finish reason ``error``), which a retry would only repeat on another replica."""
    from vllm.exceptions import GenerationError

    marker = f'"message":"{GenerationError().args[0]}"'.replace(" ", "").encode()
    return marker in start.body.replace(b" ", b"")


def failed(start: HTTPStart) -> bool:
    """An error answer: a 5xx/4xx status, or a stream whose first event is an error."""
    head = start.body.lstrip()[:64]
    return (
        start.status >= 400
        or head.startswith(b'data: {"error"')
        or head.startswith(b"event: error")
    )


class LLMServer:
    """Hosts one engine for one model (a Serve replica).

    Failure model: an engine that died (a worker actor lost, the engine core crashed) never
    recovers, so the replica stops being one: it kills its own actor (:meth:`_die`). Requests
    it held that had not started their response then fail with ``ActorDiedError``, which the
    ingress retries on another replica, and Serve's routers drop the replica at once instead
    of sending it more requests until the next health check.
    """

    async def __init__(
        self, cfg: dict[str, Any], limits: dict[str, Any] | None = None, kv_events: bool = False
    ) -> None:
        import types

        import ray
        from ray import serve
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        from rbln_ray.common.logging_setup import apply_process_defaults, setup_logging
        from rbln_ray.compile.artifact import is_compiled_dir
        from rbln_ray.emulator import ensure_runtime
        from rbln_ray.models.demo import resolve_model
        from rbln_ray.serve import remote_media  # registers its media connector with vLLM
        from rbln_ray.serve.audio import replica_env
        from rbln_ray.serve.replica_bind import bind_replica_grpc_to_loopback
        from rbln_ray.serve.warmup import warm_up
        from rbln_ray.vllm_plugin.device_metrics import relay_engine_metrics
        from rbln_ray.vllm_plugin.host_kv_connector import on_node, tier_for
        from rbln_ray.vllm_plugin.platform import compiled_artifact

        bind_replica_grpc_to_loopback()
        apply_process_defaults()
        setup_logging()
        ensure_runtime()
        self.cfg = ModelDeploymentConfig.model_validate(cfg)
        self._dying: asyncio.Task | None = None
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        # The replica tag of this engine's device metrics: the engine core process inherits
        # it, the Ray executor forwards it to the worker actors (envs.FORWARDED).
        os.environ["RBLN_RAY_REPLICA"] = self.replica_id
        # An in-process worker (the engine process inherits this) opens its emulated devices
        # as this Ray node's, as a worker actor does (rbln_ray.executor.actor): several
        # raylets on one machine each own devices 0..N-1.
        node_id = ray.get_runtime_context().get_node_id()
        os.environ["RBLN_RAY_NODE_ID"] = node_id
        # Remote media (when allowed) only from public addresses, never by a redirect.
        os.environ.update(remote_media.replica_env())
        for name in UNSET_ENV:
            os.environ.pop(name, None)
        if self.cfg.responses_store:  # read by vLLM's OpenAIServingResponses
            os.environ["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
        limits_cfg = RequestLimits.model_validate(limits or {})
        os.environ.update(replica_env(limits_cfg))  # vLLM's audio decode cap: the app's
        # "demo": the trained demo model, compiled as it is everywhere (models.demo)
        model_path, compile_settings = resolve_model(self.cfg.model, self.cfg.compile)
        self.cfg = self.cfg.model_copy(update={"compile": compile_settings})
        args = engine_namespace(self.cfg, model_path, limits_cfg)
        # a host KV tier (kv_transfer_config: RBLNHostKVConnector) is this node's
        args.kv_transfer_config = on_node(args.kv_transfer_config, node_id)
        # a decode pool's replica fetches KV a prefill replica exported on another node
        self._handover = handover_for(args.kv_transfer_config, args.model, node_id)
        self._kv_events = None
        self._service_times = None
        stat_loggers: list[Any] = [RayPrometheusStatLogger]
        if kv_events:  # routing: cache_aware: what is cached (kv_events), how fast (service_times)
            from rbln_ray.serve.kv_events import KVEventListener
            from rbln_ray.serve.service_times import ServiceTimes

            self._kv_events = KVEventListener.start()
            args.kv_events_config = self._kv_events.engine_config()
            if is_compiled_dir(args.model):  # its host tier's blocks count as held there
                self._kv_events.tier = tier_for(args.kv_transfer_config, args.model)
            self._service_times = ServiceTimes()
            stat_loggers.append(self._service_times.stat_logger())
        engine_args = AsyncEngineArgs.from_cli_args(args)
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        if not self.cfg.in_process_worker:
            # The replica's placement group holds the RBLN bundles its worker actors will use.
            vllm_config.parallel_config.placement_group = ray.util.get_current_placement_group()
        self.engine = AsyncLLM.from_vllm_config(
            vllm_config=vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            disable_log_stats=engine_args.disable_log_stats,
            # vLLM's engine metrics through Ray's metrics pipeline (Ray's metrics export on
            # this node), tagged with this replica, instead of this process's own registry.
            stat_loggers=stat_loggers,
        )
        tasks = await self.engine.get_supported_tasks()
        self.tasks = tuple(tasks)
        # vLLM's own app, as `vllm serve` builds it, on this replica's engine.
        self.app = build_app(args, tasks, self.engine.model_config)
        await init_app_state(self.engine, self.app.state, args, tasks)
        # vLLM's engine-error handler tells its HTTP server to exit through this; here the
        # replica takes itself down instead (http()).
        self.app.state.server = types.SimpleNamespace(should_exit=False)
        self.state = self.app.state
        await self.engine.reset_mm_cache()  # as vllm serve does once its engine is up
        if self.cfg.warm_up and "generate" in self.tasks:
            sizes = compiled_artifact(vllm_config).decoder_batch_sizes
            await warm_up(self.state, self.engine, self.cfg.name, sizes)
        if self._service_times is not None:
            self._service_times.reset()  # warm-up requests are not the traffic it reports
        await self._warm_app()
        self._metrics_relay: asyncio.Task | None = None
        if self.cfg.in_process_worker:  # its worker is no Ray actor: this replica exports
            self._metrics_relay = asyncio.create_task(
                relay_engine_metrics(self.engine, self.cfg.name)
            )
        logger.info("model %s ready in replica pid %d", self.cfg.name, os.getpid())

    async def _warm_app(self) -> None:
        """One call through vLLM's app (its middleware stack is built on first use)."""
        body = json.dumps({"model": self.cfg.name, "prompt": "warm-up"}).encode()
        call = HTTPCall("POST", "/tokenize", headers=((b"content-type", b"application/json"),),
                        body=body)  # fmt: skip
        async for _ in self.http(call):
            pass

    def _unserved(self, call: HTTPCall) -> HTTPStart | None:
        """A 404 naming what this model serves when vLLM's app has no route for the call
        (a decoder asked for embeddings, an encoder for a completion): the status
        ``vllm serve`` of this model answers, with a message that says why."""
        from starlette.routing import Match

        from rbln_ray.serve.asgi_call import scope_of
        from rbln_ray.serve.routes import flatten

        scope = scope_of(call)
        for route in flatten(self.app.router.routes):
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return None
        tasks = ", ".join(self.tasks)
        message = (
            f"model {self.cfg.name!r} does not serve {call.method} {call.path} (its tasks: {tasks})"
        )
        headers = ((b"content-type", b"application/json"),)
        return HTTPStart(404, headers, json_error(404, message, "NotFoundError"), False)

    def _stamp_response_id(self, call: HTTPCall) -> HTTPCall:
        """A Responses API request gets an id that routes back here (stored responses live
        in this replica: rbln_ray.serve.http_call.new_response_id), unless it has one."""
        from dataclasses import replace

        from rbln_ray.serve.http_call import new_response_id

        if not (
            self.cfg.responses_store and call.method == "POST" and call.path in RESPONSES_ROUTES
        ):
            return call
        try:
            body = json.loads(call.body)
        except ValueError:
            return call  # vLLM answers it
        if not isinstance(body, dict) or body.get("request_id"):
            return call
        body["request_id"] = new_response_id(self.cfg.name, self.replica_id)
        return replace(call, body=json.dumps(body).encode())

    async def http(self, call: HTTPCall) -> AsyncIterator[HTTPStart | bytes]:
        """Answer one HTTP request with vLLM's app: an :class:`HTTPStart`, then body chunks.

        When the engine is dead and nothing of the answer has been yielded yet, the replica
        dies instead of answering (class docstring), so the ingress can retry elsewhere; a
        stream already under way ends with vLLM's own error event. A request the engine
        itself finished with an error (its device step raised: finish reason ``error``,
        vLLM's ``GenerationError``) gets that 500 even when the engine died of it right
        after: retried, it would take a second replica down.
        """
        from rbln_ray.serve.asgi_call import run

        unserved = self._unserved(call)
        if unserved is not None:
            yield unserved
            return
        if self._handover is not None and call.path in PD_PATHS:
            await self._handover.receive(transfer_params(call.body))
        stream = run(self.app, self._stamp_response_id(call))
        try:
            try:
                first = await stream.__anext__()
            except Exception as exc:
                if self._engine_dead():
                    await self._die(exc)
                raise
            if self._engine_dead() and failed(first) and not own_failure(first):
                await self._die(RuntimeError(first.body[:300].decode(errors="replace")))
            yield first
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()

    def _engine_dead(self) -> bool:
        return bool(self.engine.errored or self.app.state.server.should_exit)

    async def _die(self, cause: BaseException) -> None:
        """Take this replica down because its engine is dead; never returns normally.

        The first caller kills the replica's actor (after shutting the engine down, which
        frees its devices); every caller then waits for the kill to land. Should it not land
        within ``DEATH_TIMEOUT_S``, the request fails with ``ReplicaUnavailableError``, which
        the ingress retries too.
        """
        from rbln_ray.serve.retry import ReplicaUnavailableError

        if self._dying is None:
            logger.error(
                "model %s: engine died (%s); taking replica pid %d down so its requests "
                "go to another replica",
                self.cfg.name,
                cause,
                os.getpid(),
            )
            self._dying = asyncio.create_task(self._kill_self())
        # The process dies during this wait; the callers of this request see ActorDiedError.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), timeout=DEATH_TIMEOUT_S)
        raise ReplicaUnavailableError(f"model {self.cfg.name}: engine died ({cause})")

    async def _kill_self(self) -> None:
        import ray

        try:  # stop the engine core and its workers first (bounded): frees the devices
            await asyncio.wait_for(asyncio.to_thread(self.engine.shutdown), STOP_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the kill below ends the replica regardless
            logger.debug("engine shutdown after its death failed", exc_info=True)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    async def models(self) -> dict[str, Any]:
        """The model's ``/v1/models`` list (vLLM's ``ModelList``)."""
        return (await self.state.openai_serving_models.show_available_models()).model_dump()

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing stats (cache-aware routing only): what this replica's prefix cache
        holds (:mod:`rbln_ray.serve.kv_events`) and its service times
        (:mod:`rbln_ray.serve.service_times`)."""
        stats: dict[str, Any] = {}
        for source in (getattr(self, "_kv_events", None), getattr(self, "_service_times", None)):
            if source is not None:
                stats.update(source.report())
        return stats

    async def check_health(self) -> None:
        """Serve's replica health check: a dead engine marks the replica unhealthy."""
        await self.engine.check_health()

    async def engine_stats(self) -> dict[str, Any]:
        """Worker placement and step counters of this replica's engine (tests, benchmarks)."""
        infos = await self.engine.collective_rpc("device_info")
        stats = await self.engine.collective_rpc("step_stats")
        import ray

        actor = ray.get_runtime_context().get_actor_name()
        return {"pid": os.getpid(), "actor_name": actor, "workers": infos, "steps": stats}

    def __del__(self) -> None:
        relay = getattr(self, "_metrics_relay", None)
        if relay is not None:
            relay.cancel()
        listener = getattr(self, "_kv_events", None)
        if listener is not None:
            listener.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
