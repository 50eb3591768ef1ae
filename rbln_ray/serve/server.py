"""The per-model server deployment: one vLLM ``AsyncLLM`` engine per replica.

Each replica builds its engine exactly as ``vllm serve`` does (vLLM's own argument parser and
``init_app_state``), so the OpenAI protocol models, chat templates, sampling validation and
streaming are vLLM's. The engine runs on :class:`~rbln_ray.executor.RBLNRayExecutor`, whose
worker actors take the ``RBLN`` bundles of the replica's placement group: Serve places a
replica only where its devices are free, and the devices die with the replica.

Methods are called through a ``DeploymentHandle`` with ``stream=True`` and yield either one
dict (a full response, or ``{"error": ...}``) or the SSE lines of a streaming response.
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

from rbln_ray.serve.config import DEMO_MODEL, ModelDeploymentConfig, RequestLimits

logger = logging.getLogger(__name__)

DEATH_TIMEOUT_S = 30.0  # bound on waiting for this replica's own kill (see LLMServer._die)
STOP_TIMEOUT_S = 10.0  # bound on shutting a dead engine down before that kill


def resolve_model_path(model: str) -> str:
    """``"demo"`` → the trained demo model (trained on first use); anything else as given."""
    if model == DEMO_MODEL:
        from rbln_ray.models import demo_model_dir

        return str(demo_model_dir())
    return model


def engine_namespace(
    cfg: ModelDeploymentConfig, model_path: str, limits: RequestLimits | None = None
):
    """``vllm serve``'s parsed arguments for this model, with rbln-ray's engine settings and
    the app's media policy (:func:`rbln_ray.serve.media_policy.replica_media_args`: it wins
    over ``engine_kwargs``)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from rbln_ray.families.registry import vision_for_dir
    from rbln_ray.serve.media_policy import replica_media_args
    from rbln_ray.vllm_plugin.options import PREFIX

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", model_path, "--served-model-name", cfg.name]
    )
    for key, value in cfg.engine_kwargs.items():
        if not hasattr(args, key):
            raise ValueError(f"engine_kwargs: unknown vLLM option {key!r} for model {cfg.name}")
        setattr(args, key, value)
    accepts_images = vision_for_dir(model_path) is not None
    for key, value in replica_media_args(limits or RequestLimits(), accepts_images).items():
        setattr(args, key, value)
    if "fingerprint_mode" not in cfg.engine_kwargs:
        # vLLM's default fingerprint hashes the whole engine config, which includes this
        # replica's own Ray driver details: every replica would answer with another one.
        args.fingerprint_mode = "custom"
        args.fingerprint_value = deployment_fingerprint(cfg, model_path)
    args.distributed_executor_backend = "rbln_ray.executor.RBLNRayExecutor"
    placement = cfg.placement().model_dump()
    args.additional_config = {
        **(args.additional_config or {}),
        PREFIX + "compile": cfg.compile.as_dict(),
        **{PREFIX + name: value for name, value in placement.items()},
    }
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


def _json_body(serving: Any) -> Any:
    """vLLM's pooling servers (embeddings, scores) answer with a Starlette ``JSONResponse``;
    the replica relays its JSON body (an error's carries its status in ``error.code``)."""

    async def create(request: Any) -> dict[str, Any]:
        response = await serving(request)
        if not hasattr(response, "body"):
            raise TypeError(f"{type(response).__name__} is not a JSON response")
        return json.loads(response.body)

    return create


class LLMServer:
    """Hosts one engine for one model (a Serve replica).

    Failure model: an engine that died (a worker actor lost, the engine core crashed) never
    recovers, so the replica stops being one: it kills its own actor (:meth:`_die`). Requests
    it held that had not started their response then fail with ``ActorDiedError``, which the
    ingress retries on another replica, and Serve's routers drop the replica at once instead
    of sending it more requests until the next health check.
    """

    async def __init__(self, cfg: dict[str, Any], limits: dict[str, Any] | None = None) -> None:
        import ray
        from ray import serve
        from starlette.datastructures import State
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        from rbln_ray.common.logging_setup import apply_process_defaults, setup_logging
        from rbln_ray.emulator import ensure_runtime
        from rbln_ray.serve.audio import replica_env
        from rbln_ray.serve.replica_bind import bind_replica_grpc_to_loopback
        from rbln_ray.serve.warmup import warm_up
        from rbln_ray.vllm_plugin.platform import compiled_artifact

        bind_replica_grpc_to_loopback()
        apply_process_defaults()
        setup_logging()
        ensure_runtime()
        self.cfg = ModelDeploymentConfig.model_validate(cfg)
        self._dying: asyncio.Task | None = None
        # The replica tag of this engine's device metrics: the engine core process inherits
        # it, the Ray executor forwards it to the worker actors (envs.FORWARDED).
        os.environ["RBLN_RAY_REPLICA"] = serve.get_replica_context().replica_id.unique_id
        # A media URL is fetched only from an allowed domain; a redirect could leave it.
        os.environ.setdefault("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "0")
        limits_cfg = RequestLimits.model_validate(limits or {})
        os.environ.update(replica_env(limits_cfg))  # vLLM's audio decode cap: the app's
        args = engine_namespace(self.cfg, resolve_model_path(self.cfg.model), limits_cfg)
        engine_args = AsyncEngineArgs.from_cli_args(args)
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        # The replica's placement group holds the RBLN bundles its worker actors will use.
        vllm_config.parallel_config.placement_group = ray.util.get_current_placement_group()
        self.engine = AsyncLLM.from_vllm_config(
            vllm_config=vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            disable_log_stats=engine_args.disable_log_stats,
            # vLLM's engine metrics through Ray's metrics pipeline (Ray's metrics export on
            # this node), tagged with this replica, instead of this process's own registry.
            stat_loggers=[RayPrometheusStatLogger],
        )
        self.state = State()
        tasks = await self.engine.get_supported_tasks()
        self.tasks = tuple(tasks)
        await init_app_state(self.engine, self.state, args, tasks)
        if self.cfg.warm_up and "generate" in self.tasks:
            sizes = compiled_artifact(vllm_config).decoder_batch_sizes
            await warm_up(self.state, self.engine, self.cfg.name, sizes)
        logger.info("model %s ready in replica pid %d", self.cfg.name, os.getpid())

    async def _serve(self, create: Any, request: Any) -> AsyncIterator[Any]:
        """Run a vLLM serving call and relay its result (see module docstring).

        Request errors vLLM raises instead of returning (e.g. a negative ``max_tokens``) become
        the same 4xx ``ErrorResponse`` vLLM's HTTP server would send. When the engine is dead
        and nothing of this response has been yielded yet, the replica dies instead of
        answering (class docstring), so the ingress can retry elsewhere; a stream already under
        way ends with vLLM's own error event. A request the engine itself finished with an
        error (its device step raised: finish reason ``error``, vLLM's ``GenerationError``)
        gets that 500 even when the engine died of it right after: retried, it would take a
        second replica down.
        """
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )
        from vllm.exceptions import GenerationError, VLLMClientError

        try:
            result = await create(request)
        except GenerationError as exc:
            yield create_error_response(exc).model_dump()
            return
        except (VLLMClientError, ValueError, TypeError, OverflowError) as exc:
            if not self.engine.errored:
                yield create_error_response(exc).model_dump()
                return
            await self._die(exc)
        except Exception as exc:
            if self.engine.errored:
                await self._die(exc)
            raise
        if hasattr(result, "model_dump") or isinstance(result, dict):
            # a full response or an ErrorResponse (a pooling server's JSON body: a dict)
            body = result if isinstance(result, dict) else result.model_dump()
            if "error" in body and self.engine.errored:
                await self._die(RuntimeError(body["error"].get("message")))
            yield body
            return
        started = False
        own_failure = f'"message":"{GenerationError().args[0]}"'  # this request's own error
        async for chunk in result:
            dead = self.engine.errored and chunk.startswith('data: {"error"')
            if not started and dead and own_failure not in chunk.replace(" ", ""):
                await self._die(RuntimeError(chunk.strip()))
            started = True
            yield chunk

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

    async def completions(self, request: Any) -> AsyncIterator[Any]:
        async for item in self._route("openai_serving_completion", "create_completion", request):
            yield item

    async def chat(self, request: Any) -> AsyncIterator[Any]:
        async for item in self._route("openai_serving_chat", "create_chat_completion", request):
            yield item

    async def embeddings(self, request: Any) -> AsyncIterator[Any]:
        async for item in self._route("serving_embedding", None, request):
            yield item

    async def score(self, request: Any) -> AsyncIterator[Any]:
        """``/v1/score`` and ``/v1/rerank``: vLLM's ``ServingScores`` takes both."""
        async for item in self._route("serving_scores", None, request):
            yield item

    async def transcriptions(self, upload: Any) -> AsyncIterator[Any]:
        """``/v1/audio/transcriptions`` (an ``rbln_ray.serve.audio.AudioUpload``)."""
        from rbln_ray.serve.audio import serve_upload

        async for item in serve_upload(self, upload):
            yield item

    async def translations(self, upload: Any) -> AsyncIterator[Any]:
        """``/v1/audio/translations``."""
        async for item in self.transcriptions(upload):  # the upload names its task
            yield item

    async def _route(self, handler: str, method: str | None, request: Any) -> AsyncIterator[Any]:
        """Run vLLM's serving object ``handler`` (its ``method``, or the pooling servers'
        ``__call__``), or a 400 naming what this model serves when it has no such object (a
        text model asked for embeddings, an encoder asked for a completion)."""
        serving = getattr(self.state, handler, None)
        if serving is None:
            from vllm.entrypoints.serve.exception_handling.error_response import (
                create_error_response,
            )

            tasks = ", ".join(self.tasks)
            message = f"model {self.cfg.name!r} does not serve this endpoint (its tasks: {tasks})"
            yield create_error_response(message).model_dump()
            return
        create = getattr(serving, method) if method else _json_body(serving)
        async for item in self._serve(create, request):
            yield item

    async def models(self) -> dict[str, Any]:
        return (await self.state.openai_serving_models.show_available_models()).model_dump()

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
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
