"""Build the Serve application from an :class:`~rbln_ray.serve.config.AppConfig`.

``build_app`` is the import path for ``serve run`` / ``serve deploy`` / KubeRay
(``import_path: rbln_ray.serve:build_app`` with the config under ``args``).
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from rbln_ray.compile.artifact import CompiledArtifact, is_compiled_dir, load_artifact
from rbln_ray.compile.encoders import EncoderArtifact
from rbln_ray.compile.settings import CompileSettings
from rbln_ray.models.demo import demo_compile
from rbln_ray.serve.capacity import ReplicaShape, wait_placeable
from rbln_ray.serve.config import (
    DEMO_MODEL,
    AppConfig,
    IngressConfig,
    ModelDeploymentConfig,
    RequestLimits,
    load_config,
)
from rbln_ray.serve.direct import DirectServer
from rbln_ray.serve.disaggregation import PrefillPool, pools, prefill_deployment_name
from rbln_ray.serve.ingress import OpenAIIngress
from rbln_ray.serve.lora_models import adapter_bases
from rbln_ray.serve.naming import server_deployment_name
from rbln_ray.serve.server import LLMServer

logger = logging.getLogger(__name__)

INGRESS_NAME = "OpenAIIngress"


def served_artifact(cfg: ModelDeploymentConfig) -> CompiledArtifact | EncoderArtifact | None:
    """The compiled artifact a replica serves (a decoder's or an encoder's); None when it
    compiles at start (demo, HF dir), with :func:`start_compile`."""
    if cfg.model == DEMO_MODEL or not is_compiled_dir(cfg.model):
        return None
    return load_artifact(cfg.model)


def start_compile(cfg: ModelDeploymentConfig) -> CompileSettings:
    """The settings a model compiled at start is compiled with: ``cfg.compile`` (the demo's
    recipe under them for the demo model, rbln_ray.models.demo)."""
    return demo_compile(cfg.compile) if cfg.model == DEMO_MODEL else cfg.compile


def worker_layout(cfg: ModelDeploymentConfig) -> tuple[int, int]:
    """(workers, RBLN devices per worker) of one engine, from the compiled artifact if any.

    Workers are pipeline stages; each holds the artifact's shard group (``num_devices``).
    """
    art = served_artifact(cfg)
    if art is not None:
        if cfg.pipeline_stages not in (1, art.num_stages):
            raise ValueError(
                f"model {cfg.name}: pipeline_stages={cfg.pipeline_stages} but {cfg.model} was "
                f"compiled with {art.num_stages} stage(s)"
            )
        return art.num_stages, cfg.devices_per_worker or art.num_devices
    if cfg.pipeline_stages > 1:
        raise ValueError(
            f"model {cfg.name}: pipeline_stages={cfg.pipeline_stages} needs a staged artifact; "
            "compile one with `rbln-ray compile HF_DIR OUT --pipeline-stages S` and serve OUT"
        )
    return 1, cfg.devices_per_worker or start_compile(cfg).num_devices


def compiled_batch_size(cfg: ModelDeploymentConfig) -> int:
    """Decode slots of one engine: the artifact's batch, or the batch it will be compiled with."""
    art = served_artifact(cfg)
    return art.batch_size if art is not None else start_compile(cfg).batch_size


def compiled_sequences(cfg: ModelDeploymentConfig) -> int:
    """Sequences one engine runs at once: what the artifact's KV cache and decode graphs hold
    (all micro-batches of a staged one), or the batch it will be compiled with."""
    art = served_artifact(cfg)
    return art.max_num_seqs if art is not None else start_compile(cfg).batch_size


def engine_config(cfg: ModelDeploymentConfig) -> ModelDeploymentConfig:
    """The model's config as its replicas get it: ``max_num_seqs`` defaults to the compiled
    sequences. vLLM's server default on a CPU-derived platform (RBLN's) is 128 sequences
    (``EngineArgs.get_batch_defaults``), which would leave the rows of a larger compiled
    batch idle and queue the requests that should fill them."""
    kwargs = {"max_num_seqs": compiled_sequences(cfg), **cfg.engine_kwargs}
    return cfg.model_copy(update={"engine_kwargs": kwargs})


def compiled_max_seq_len(cfg: ModelDeploymentConfig) -> int | None:
    """The model's context length (compiled ``max_seq_len``); None when only the compile at
    start will know it (an HF dir without ``compile.max_seq_len``)."""
    art = served_artifact(cfg)
    if art is not None:
        return art.max_seq_len
    return start_compile(cfg).max_seq_len


def accepted_media(cfg: ModelDeploymentConfig) -> tuple[str, ...]:
    """The media a request may give the model (images, videos, audio): its vision-language
    family's inputs (compiled, or an HF dir compiled at start); none for a text model."""
    from rbln_ray.families.registry import VISION, vision_for_dir

    if cfg.model == DEMO_MODEL:
        return ()
    art = served_artifact(cfg)
    if isinstance(art, CompiledArtifact):
        return VISION[art.vision_family].inputs if art.is_multimodal else ()
    family = vision_for_dir(cfg.model) if art is None else None
    return family.inputs if family is not None else ()


def replica_max_ongoing(cfg: ModelDeploymentConfig) -> int:
    """Requests Serve hands one replica at a time: by default 2 x its decode slots.

    A full batch plus one batch ready to prefill keeps the device busy; the rest wait in
    Serve's queue and go to whichever replica frees a slot first. A deep per-replica queue
    would commit requests early to one replica's vLLM queue and leave others idle at the end
    of a burst (BENCHMARKS §10).
    """
    return cfg.max_ongoing_requests or 2 * compiled_batch_size(cfg)


def server_bundles(cfg: ModelDeploymentConfig) -> list[dict[str, float]]:
    """Replica placement group: the replica itself, then one RBLN bundle per worker; one
    bundle with the devices for a replica that drives them itself (``in_process_worker``)."""
    workers, devices = worker_layout(cfg)
    if cfg.in_process_worker:
        if workers != 1:
            raise ValueError(
                f"model {cfg.name}: {cfg.model} has {workers} pipeline stages, whose workers "
                "run as Ray actors; drop engine_kwargs.distributed_executor_backend"
            )
        return [{"CPU": 1, "RBLN": devices}]
    return [{"CPU": 1}] + [{"RBLN": devices, "CPU": 1} for _ in range(workers)]


def replica_actor_options(bundles: list[dict[str, float]]) -> dict[str, Any]:
    """The replica actor takes the devices of its own bundle (the first), if it has any, so
    that Ray sets ``RBLN_DEVICES`` for it and the engine process it starts; its CPU is the
    bundle's reservation, not a claim of the actor's."""
    devices = {name: n for name, n in bundles[0].items() if name != "CPU"}
    return {"num_cpus": 0, **({"resources": devices} if devices else {})}


def server_options(cfg: ModelDeploymentConfig, name: str) -> dict[str, Any]:
    """Serve options of a deployment whose replicas run ``cfg``'s engine."""
    bundles = server_bundles(cfg)
    return {
        "name": name,
        "placement_group_bundles": bundles,
        "placement_group_strategy": cfg.placement_strategy,
        "max_ongoing_requests": replica_max_ongoing(cfg),
        "max_queued_requests": cfg.max_queued_requests,
        "health_check_period_s": cfg.health_check_period_s,
        "health_check_timeout_s": cfg.health_check_timeout_s,
        "graceful_shutdown_timeout_s": cfg.graceful_shutdown_timeout_s,
        "ray_actor_options": replica_actor_options(bundles),
        **replica_options(cfg),
    }


def ingress_checks(config: AppConfig) -> dict[str, Any]:
    """What the ingress checks requests against, wherever it runs (its own deployment, or
    each model replica with ``routing: direct``): the API key, the limits, each model's
    context length and the media it accepts, CORS origins, and LoRA adapters' base models
    (served by their base's deployment)."""
    return {
        "api_key": config.resolved_api_key(),
        "limits": config.limits.model_dump(),
        "max_model_lens": {m.name: compiled_max_seq_len(m) for m in config.models},
        "media_models": {
            m.name: list(found) for m in config.models if (found := accepted_media(m))
        },
        "cors_allowed_origins": config.cors_allowed_origins,
        "lora_bases": adapter_bases(config.models),
    }


def build_direct(config: AppConfig) -> Application:
    """``routing: direct``: the one model's replicas are the app's ingress
    (:mod:`rbln_ray.serve.direct`)."""
    cfg = config.models[0]
    options = server_options(cfg, server_deployment_name(cfg.name))
    # Beyond max_queued_requests Serve's proxy refuses the request itself: with the status
    # the routed app's ingress gives (a model at capacity), not Serve's default 503.
    options["backpressure_config"] = BackpressureConfig(status_code=429)
    deployment = serve.deployment(serve.ingress()(DirectServer)).options(**options)
    return deployment.bind(engine_config(cfg).model_dump(), **ingress_checks(config))


def build_server(
    cfg: ModelDeploymentConfig,
    routing: str = "load_aware",
    limits: RequestLimits | None = None,
    name: str | None = None,
) -> Application:
    """The ``LLMServer`` deployment of ``cfg`` (named ``name``, default the model's)."""
    options = server_options(cfg, name or server_deployment_name(cfg.name))
    if routing == "prefix_affinity":  # it also pins calls about stored responses
        options["request_router_config"] = RequestRouterConfig(
            request_router_class="rbln_ray.serve.routing.PrefixAffinityRouter"
        )
    elif routing == "cache_aware":
        from rbln_ray.serve.cache_routing import router_config

        options["request_router_config"] = router_config(cfg, compiled_batch_size(cfg))
    elif cfg.responses_store:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class="rbln_ray.serve.routing.ResponseAffinityRouter"
        )
    limits_dump = (limits or RequestLimits()).model_dump()
    kv_events = {"kv_events": True} if routing == "cache_aware" else {}  # replicas report caches
    return (
        serve.deployment(LLMServer)
        .options(**options)
        .bind(engine_config(cfg).model_dump(), limits_dump, **kv_events)
    )


def replica_options(cfg: IngressConfig | ModelDeploymentConfig) -> dict[str, Any]:
    """A deployment's replica count for Serve: fixed, or its ``autoscaling_config``."""
    if cfg.autoscaling_config is not None:
        return {"autoscaling_config": cfg.autoscaling_config}
    return {"num_replicas": cfg.num_replicas}


def ingress_options(cfg: IngressConfig) -> dict[str, Any]:
    """Serve options of the ingress deployment (:class:`IngressConfig` says why each)."""
    return {
        "name": INGRESS_NAME,
        **replica_options(cfg),
        "max_ongoing_requests": cfg.max_ongoing_requests,
        "max_queued_requests": cfg.max_queued_requests,
        "graceful_shutdown_timeout_s": cfg.graceful_shutdown_timeout_s,
        "ray_actor_options": {"num_cpus": 0},
    }


def build_app(args: dict[str, Any] | AppConfig | str) -> Application:
    """Serve application builder: ``serve run rbln_ray.serve:build_app config=...``."""
    if isinstance(args, dict) and set(args) == {"config"}:  # serve run ... config=FILE
        args = args["config"]
    config = load_config(args)
    from rbln_ray.serve.vllm_args import serve_namespace

    pd_pools = {m.name: pools(m) for m in config.models if m.pd}  # (prefill, decode)
    for m in config.models:  # vLLM's own checks of each model's options, before any replica
        for deployment in pd_pools.get(m.name, (m,)):
            serve_namespace(deployment.model, deployment.name, deployment.vllm_kwargs())
    if ray.is_initialized():  # inside the cluster (serve deploy/run): fail fast if infeasible
        wait_placeable(
            [
                ReplicaShape(m.name, tuple(server_bundles(m)), m.placement_strategy,
                             m.placement_timeout_s)
                for m in config.models
            ]
        )  # fmt: skip
    if config.routing == "direct":
        return build_direct(config)
    servers, prefill_servers = {}, {}
    for m in config.models:
        if m.pd is None:
            servers[m.name] = build_server(m, config.routing, config.limits)
            continue
        prefill, decode = pd_pools[m.name]
        servers[m.name] = build_server(decode, config.routing, config.limits)
        name = prefill_deployment_name(m.name)
        handle = build_server(prefill, config.routing, config.limits, name)
        prefill_servers[m.name] = PrefillPool(handle, m.pd.prefill_timeout_s)
    # Late-bound: each ingress replica builds its app (vLLM's routes) in
    # OpenAIIngress.__serve_build_asgi_app__.
    ingress = serve.deployment(serve.ingress()(OpenAIIngress)).options(
        **ingress_options(config.ingress)
    )
    return ingress.bind(
        servers,
        **ingress_checks(config),
        stall_s=config.ingress.unhealthy_after_stall_s,
        prefill_servers=prefill_servers,
    )
