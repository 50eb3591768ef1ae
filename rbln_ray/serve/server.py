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
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from rbln_ray.serve.config import DEMO_MODEL, ModelDeploymentConfig

logger = logging.getLogger(__name__)


def resolve_model_path(model: str) -> str:
    """``"demo"`` → the trained demo model (trained on first use); anything else as given."""
    if model == DEMO_MODEL:
        from rbln_ray.models import demo_model_dir

        return str(demo_model_dir())
    return model


def engine_namespace(cfg: ModelDeploymentConfig, model_path: str):
    """``vllm serve``'s parsed arguments for this model, with rbln-ray's engine settings."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from rbln_ray.vllm_plugin.options import COMPILE_KEY, STRATEGY_KEY, TIMEOUT_KEY

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", model_path, "--served-model-name", cfg.name]
    )
    for key, value in cfg.engine_kwargs.items():
        if not hasattr(args, key):
            raise ValueError(f"engine_kwargs: unknown vLLM option {key!r} for model {cfg.name}")
        setattr(args, key, value)
    args.distributed_executor_backend = "rbln_ray.executor.RBLNRayExecutor"
    args.additional_config = {
        **(args.additional_config or {}),
        COMPILE_KEY: cfg.compile,
        STRATEGY_KEY: cfg.placement_strategy,
        TIMEOUT_KEY: cfg.placement_timeout_s,
    }
    return args


class LLMServer:
    """Hosts one engine for one model (a Serve replica)."""

    async def __init__(self, cfg: dict[str, Any], metrics_hub: Any = None) -> None:
        import ray
        from starlette.datastructures import State
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        from rbln_ray.common.logging_setup import setup_logging
        from rbln_ray.emulator import ensure_runtime

        setup_logging()
        ensure_runtime()
        self.cfg = ModelDeploymentConfig.model_validate(cfg)
        args = engine_namespace(self.cfg, resolve_model_path(self.cfg.model))
        engine_args = AsyncEngineArgs.from_cli_args(args)
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        # The replica's placement group holds the RBLN bundles its worker actors will use.
        vllm_config.parallel_config.placement_group = ray.util.get_current_placement_group()
        self.engine = AsyncLLM.from_vllm_config(
            vllm_config=vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            disable_log_stats=engine_args.disable_log_stats,
        )
        self.state = State()
        tasks = await self.engine.get_supported_tasks()
        await init_app_state(self.engine, self.state, args, tasks)
        self._metrics_task = (
            asyncio.create_task(self._push_metrics(metrics_hub)) if metrics_hub else None
        )
        logger.info("model %s ready in replica pid %d", self.cfg.name, os.getpid())

    async def metrics_text(self) -> str:
        """This replica's vLLM metrics (Prometheus text) plus its RBLN workers' counters."""
        import prometheus_client

        from rbln_ray.serve.metrics import device_metrics_text

        engine = await self.engine_stats()
        vllm_text = prometheus_client.generate_latest().decode()
        return vllm_text + device_metrics_text(self.cfg.name, engine["steps"], engine["workers"])

    async def _push_metrics(self, hub: Any) -> None:
        """Feed the app's MetricsHub (see :mod:`rbln_ray.serve.metrics`) until shutdown."""
        from ray import serve

        from rbln_ray.serve.metrics import PUSH_PERIOD_S

        replica = serve.get_replica_context().replica_id.unique_id
        while True:
            try:
                await hub.push.remote(f"{self.cfg.name}/{replica}", await self.metrics_text())
            except Exception:  # noqa: BLE001 - metrics must never take the replica down
                logger.debug("metrics push failed", exc_info=True)
            await asyncio.sleep(PUSH_PERIOD_S)

    async def _serve(self, create: Any, request: Any) -> AsyncIterator[Any]:
        """Run a vLLM serving call and relay its result (see module docstring).

        Request errors vLLM raises instead of returning (e.g. a negative ``max_tokens``) become
        the same 4xx ``ErrorResponse`` vLLM's HTTP server would send; engine failures propagate.
        """
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )
        from vllm.exceptions import VLLMClientError

        try:
            result = await create(request)
        except (VLLMClientError, ValueError, TypeError, OverflowError) as exc:
            yield create_error_response(exc).model_dump()
            return
        if hasattr(result, "model_dump"):  # a full response or an ErrorResponse
            yield result.model_dump()
            return
        async for chunk in result:
            yield chunk

    async def completions(self, request: Any) -> AsyncIterator[Any]:
        create = self.state.openai_serving_completion.create_completion
        async for item in self._serve(create, request):
            yield item

    async def chat(self, request: Any) -> AsyncIterator[Any]:
        create = self.state.openai_serving_chat.create_chat_completion
        async for item in self._serve(create, request):
            yield item

    async def models(self) -> dict[str, Any]:
        return (await self.state.openai_serving_models.show_available_models()).model_dump()

    async def check_health(self) -> None:
        """Serve's replica health check: a dead engine marks the replica unhealthy."""
        await self.engine.check_health()

    async def engine_stats(self) -> dict[str, Any]:
        """Worker placement and step counters of this replica's engine (tests, /metrics)."""
        infos = await self.engine.collective_rpc("device_info")
        stats = await self.engine.collective_rpc("step_stats")
        import ray

        actor = ray.get_runtime_context().get_actor_name()
        return {"pid": os.getpid(), "actor_name": actor, "workers": infos, "steps": stats}

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
