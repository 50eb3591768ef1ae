"""The serving configuration: one validated document for ``serve run``, ``serve deploy``,
``rbln-ray serve --config`` and KubeRay's ``serveConfigV2``.

Example (YAML)::

    host: 127.0.0.1          # used by `rbln-ray serve`; `serve run/deploy` take http_options
    port: 8000
    api_key: null            # or a string; `api_key_env` names an env var instead
    routing: load_aware      # or prefix_affinity, cache_aware, direct (one model)
    ingress: {num_replicas: 1, max_ongoing_requests: 4096, graceful_shutdown_timeout_s: 600}
    # or ingress: {autoscaling_config: {min_replicas: 1, max_replicas: 8,
    #                                   target_ongoing_requests: 512}}
    models:
      - name: demo
        model: demo          # "demo", a compiled optimum-rbln dir, or an HF dir
        compile: {batch_size: 4, max_seq_len: 1024}   # only for HF dirs
        num_replicas: 2      # or autoscaling_config: {min_replicas: 1, max_replicas: 4}
        placement_strategy: PACK
        engine_kwargs: {}    # any `vllm serve` option, by its Python name
        # vllm serve's chat options (README, "Tool calling and reasoning"):
        # chat_template: /path/tmpl.jinja, tool_call_parser: hermes,
        # enable_auto_tool_choice: true, reasoning_parser: deepseek_r1
        # responses_store: true    # Responses API store, retrieve, cancel
      - name: embed          # an encoder (BERT): /v1/embeddings and /v1/score
        model: /models/bert-compiled
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rbln_ray.compile.settings import CompileSettings
from rbln_ray.models.demo import DEMO_MODEL
from rbln_ray.vllm_plugin.options import PlacementSettings


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RequestLimits(_Strict):
    """Per-request caps the ingress enforces before a request reaches an engine.

    Prompt length and ``max_tokens`` are also bounded by each model's compiled
    ``max_seq_len`` (vLLM rejects what does not fit with a 400).
    """

    max_request_bytes: int = Field(default=1 << 20, ge=1024)
    # A client that sends its body slowly holds a proxy buffer; past this it gets a 408 (in
    # Serve's proxy, before any handler or API-key check: rbln_ray.serve.proxy_guard).
    body_read_timeout_s: float = Field(default=30.0, gt=0)
    # Bodies being read at once in one proxy, and from one client address; and one client's
    # requests in one proxy at once (behind a load balancer, its address is every client's).
    max_pending_bodies: int = Field(default=1024, ge=1)
    max_pending_bodies_per_client: int = Field(default=64, ge=1)
    max_requests_per_client: int = Field(default=1024, ge=1)
    max_n: int = Field(default=8, ge=1)
    max_tokens: int = Field(default=4096, ge=1)
    # One request may carry several prompts (a completion's list, an embedding's inputs, a
    # rerank's documents) and ask for n sequences each: admission counts sequences, so one
    # small body cannot become thousands of engine requests behind Serve's back-pressure
    # (which counts HTTP calls).
    max_prompts: int = Field(default=64, ge=1)
    max_sequences: int = Field(default=64, ge=1)  # prompts x n
    # Images in chat messages (vision-language models): only inline ``data:`` URLs unless
    # fetching is allowed (a replica fetching any URL a client names is a server-side request
    # forgery risk), then only from ``allowed_media_domains`` when it names any; at most
    # ``max_images`` a request (also vLLM's ``limit_mm_per_prompt``) and ``max_image_pixels``
    # each (a small PNG can decode to gigabytes).
    allow_remote_images: bool = False
    allowed_media_domains: list[str] = Field(default_factory=list)
    max_images: int = Field(default=8, ge=1)
    max_image_pixels: int = Field(default=4096 * 4096, ge=1)
    # What a request may pass to the HF processor (``mm_processor_kwargs``, e.g. Qwen2-VL's
    # ``min_pixels``, which would upscale an image before any check) and to media loading
    # (``media_io_kwargs``): nothing unless named here.
    allowed_mm_processor_kwargs: list[str] = Field(default_factory=list)
    allowed_media_io_kwargs: list[str] = Field(default_factory=list)
    # Audio uploads (/v1/audio/*): at most this long by their header, refused at the ingress,
    # and vLLM's own decode limit in the replicas (VLLM_MAX_AUDIO_DECODE_DURATION_S, whose
    # default this is). An upload also counts against max_request_bytes (16 kHz 16-bit mono
    # WAV: 32 KB a second).
    max_audio_seconds: int = Field(default=600, ge=1)


def replica_count(
    num_replicas: int | None, autoscaling: dict[str, Any] | None, what: str
) -> int | None:
    """A deployment's fixed replica count (None when it autoscales): Serve takes a count or
    an ``autoscaling_config``, not both; neither is one replica. The autoscaling config is
    checked by Serve's own model here, so a wrong key fails at load, naming the deployment."""
    if num_replicas is not None and autoscaling is not None:
        raise ValueError(f"{what}: set either num_replicas or autoscaling_config, not both")
    if autoscaling is None:
        return num_replicas or 1
    from ray.serve.config import AutoscalingConfig

    unknown = sorted(set(autoscaling) - set(AutoscalingConfig.model_fields))
    if unknown:  # Serve ignores them: a misspelt key would silently not apply
        known = ", ".join(sorted(AutoscalingConfig.model_fields))
        raise ValueError(
            f"{what}: autoscaling_config has no {', '.join(unknown)} (Serve's: {known})"
        )
    try:
        AutoscalingConfig(**autoscaling)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what}: autoscaling_config: {exc}") from exc
    return None


class IngressConfig(_Strict):
    """The HTTP ingress deployment (validation, routing by ``model``, SSE relay).

    The ingress only awaits I/O, so one replica carries thousands of open streams. Serve's
    default ``max_ongoing_requests`` (5) would cap the *whole app* at 5 requests in flight per
    ingress replica and starve the model replicas behind it (BENCHMARKS §10). Back-pressure
    belongs to the model deployments (``max_ongoing_requests`` + ``max_queued_requests`` →
    429), so this cap is set high.

    ``graceful_shutdown_timeout_s``: how long a replaced ingress replica (a redeploy changes
    the app's args, so Serve replaces every replica) keeps relaying the requests it holds
    before Serve kills it; each is a whole generation, possibly still waiting for a model
    replica that is starting, and a killed ingress answers all of them 500. Serve's default
    (20 s) is shorter than one busy generation, so this is long: the ingress holds no device,
    and its successor starts beside it.

    ``autoscaling_config`` (instead of ``num_replicas``): Serve's own, as for a model. An
    ingress replica's load is the streams it relays, so its target is in the hundreds
    (``target_ongoing_requests``; ``rbln-ray plan --simulate`` says how many replicas a fleet
    needs). Several ingress replicas route consistently: each router counts what every
    replica reports it holds (:mod:`rbln_ray.serve.cache_routing`).
    """

    num_replicas: int | None = Field(default=None, ge=1)
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int = Field(default=4096, ge=1)
    # Requests waiting for an ingress replica beyond this are refused (Serve's proxy: 503)
    # instead of queueing without bound in front of the app.
    max_queued_requests: int = Field(default=4096, ge=1)
    graceful_shutdown_timeout_s: float = Field(default=600, gt=0)
    # An ingress replica whose event loop or work threads run nothing for this long is
    # unhealthy (/health 503, Serve's health check fails) and Serve replaces it
    # (rbln_ray.serve.ingress_work).
    unhealthy_after_stall_s: float = Field(default=20.0, gt=0)

    @model_validator(mode="after")
    def _replicas(self) -> IngressConfig:
        self.num_replicas = replica_count(self.num_replicas, self.autoscaling_config, "ingress")
        return self


class DisaggregationConfig(_Strict):
    """Prefill/decode disaggregation of one model (:mod:`rbln_ray.serve.disaggregation`):
    ``prefill_replicas`` replicas compute prompts and hand their KV over through the node's
    host KV tier to ``decode_replicas`` replicas, which stream the answers."""

    prefill_replicas: int = Field(ge=1)
    decode_replicas: int = Field(ge=1)
    # How long the ingress waits for a prompt's prefill (a dead or restarting prefill pool
    # holds requests in Serve's queue) before the decode pool computes the prompt itself.
    prefill_timeout_s: float = Field(default=30.0, gt=0)


# ModelDeploymentConfig fields that are `vllm serve` options of the same name.
SERVE_FIELDS = ("chat_template", "tool_call_parser", "enable_auto_tool_choice", "reasoning_parser")
# `vllm serve --distributed-executor-backend` values a replica runs: the RBLN Ray executor
# (the default, "ray"), or vLLM's in-process worker ("uni"; "mp" means the same on RBLN,
# whose devices sit behind one process either way).
RAY_BACKEND = "ray"
IN_PROCESS_BACKENDS = ("uni", "mp")


class ModelDeploymentConfig(PlacementSettings):
    """One served model: where it comes from, how it is compiled when it is an HF directory,
    and how many devices/replicas it gets (``placement_strategy`` / ``placement_timeout_s``:
    :class:`~rbln_ray.vllm_plugin.options.PlacementSettings`, shared with the engine
    options)."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._:/-]+$")
    model: str = Field(description='"demo", a compiled optimum-rbln dir, or an HF model dir')
    compile: CompileSettings = Field(default_factory=CompileSettings)
    num_replicas: int | None = Field(default=None, ge=1)
    autoscaling_config: dict[str, Any] | None = None
    # Prefill and decode on separate replicas (instead of num_replicas / autoscaling_config).
    pd: DisaggregationConfig | None = None
    pipeline_stages: int = Field(default=1, ge=1)
    devices_per_worker: int | None = Field(default=None, ge=1)
    # Default: 2 x the compiled batch (see builder.replica_max_ongoing).
    max_ongoing_requests: int | None = Field(default=None, ge=1)
    # Requests waiting for a replica beyond this get 429 instead of queueing without bound.
    max_queued_requests: int = Field(default=256, ge=1)
    # Any `vllm serve` option by its Python name (`enable_prefix_caching: false`,
    # `structured_outputs_config: {backend: xgrammar}`), parsed by vLLM's own parser
    # (rbln_ray.serve.vllm_args).
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    # `vllm serve`'s chat options, first-class (merged into engine_kwargs; README "Tool
    # calling"): a Jinja template (a file path, or the template itself), a tool-call parser
    # (`hermes`, `llama3_json`, ...; `enable_auto_tool_choice` lets the model decide when to
    # call one) and a reasoning parser (`deepseek_r1`, `qwen3`, ...).
    chat_template: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    # Keep Responses API responses in the replica that made them (vLLM's
    # VLLM_ENABLE_RESPONSES_API_STORE): `store`, `background`, retrieve, cancel and
    # `previous_response_id`; requests about a stored response are routed to its replica.
    # vLLM never evicts stored responses: off by default, as in vLLM.
    responses_store: bool = False
    # Each replica serves a few tiny requests of its own before it reports healthy, so that
    # no user request pays for first device calls (rbln_ray.serve.warmup).
    warm_up: bool = True
    # Serve's health checks of a replica (how often; how long one may take before the replica
    # is restarted) and how long a stopping replica may finish the requests it holds before
    # Serve kills it (and its engine and devices with it).
    health_check_period_s: float = Field(default=5, gt=0)
    health_check_timeout_s: float = Field(default=30, gt=0)
    graceful_shutdown_timeout_s: float = Field(default=30, gt=0)

    @model_validator(mode="after")
    def _replicas(self) -> ModelDeploymentConfig:
        what = f"model {self.name}"
        if self.pd is not None:
            self._check_disaggregation()
            return self
        self.num_replicas = replica_count(self.num_replicas, self.autoscaling_config, what)
        return self

    @model_validator(mode="after")
    def _executor(self) -> ModelDeploymentConfig:
        """``engine_kwargs.distributed_executor_backend``: a value a replica can run, and an
        in-process worker only where one worker serves the whole engine."""
        backend = self.engine_kwargs.get("distributed_executor_backend")
        if backend in (None, RAY_BACKEND):
            return self
        what = f"model {self.name}: engine_kwargs.distributed_executor_backend={backend!r}"
        if backend not in IN_PROCESS_BACKENDS:
            raise ValueError(
                f"{what} is not served: use 'ray' (the RBLN Ray executor, the default) or "
                "'uni' (the worker inside the replica's engine process)"
            )
        if self.pipeline_stages != 1 or self.pd is not None:
            raise ValueError(
                f"{what}: pipeline stages and prefill/decode pools run their workers as Ray "
                "actors; drop it (or use 'ray')"
            )
        return self

    @property
    def in_process_worker(self) -> bool:
        """Whether the replica drives its devices itself (``distributed_executor_backend``
        ``uni``): it holds the ``RBLN`` devices, and its engine process runs the worker, so a
        replica is two processes instead of three. Its worker is no Ray actor: the replica
        relays its RBLN device counters (``ray_rbln_*``)."""
        return self.engine_kwargs.get("distributed_executor_backend") in IN_PROCESS_BACKENDS

    def _check_disaggregation(self) -> None:
        """A ``pd`` model's settings that cannot work, refused at load with the reason."""
        from rbln_ray.vllm_plugin.host_kv_connector import CONNECTOR

        what = f"model {self.name}"
        if self.num_replicas is not None or self.autoscaling_config is not None:
            raise ValueError(
                f"{what}: pd sets its replica counts (prefill_replicas, decode_replicas); "
                "drop num_replicas / autoscaling_config"
            )
        if self.pipeline_stages != 1:
            raise ValueError(f"{what}: pd hands KV over through the host KV tier, which serves "
                             "single-stage engines; drop pipeline_stages")  # fmt: skip
        kv = self.engine_kwargs.get("kv_transfer_config") or {}
        connector = kv.get("kv_connector", CONNECTOR)
        if connector != CONNECTOR:
            raise ValueError(f"{what}: pd hands KV over through {CONNECTOR}, not {connector!r} "
                             "(engine_kwargs.kv_transfer_config)")  # fmt: skip

    @model_validator(mode="after")
    def _one_value_per_option(self) -> ModelDeploymentConfig:
        self.vllm_kwargs()  # raises on a field given twice with two values
        return self

    def vllm_kwargs(self) -> dict[str, Any]:
        """The model's ``vllm serve`` options: ``engine_kwargs`` plus the chat fields above,
        and rbln-ray's defaults (``/tokenizer_info`` on: a routed app has no other way to
        tell a client which tokenizer a model uses)."""
        merged = dict(self.engine_kwargs)
        for name in SERVE_FIELDS:
            value = getattr(self, name)
            if value in (None, False):
                continue
            if name in merged and merged[name] != value:
                raise ValueError(
                    f"model {self.name}: {name} is {value!r} but engine_kwargs.{name} is "
                    f"{merged[name]!r}; give it once"
                )
            merged[name] = value
        merged.setdefault("enable_tokenizer_info_endpoint", True)
        return merged

    @field_validator("model")
    @classmethod
    def _model_exists(cls, value: str) -> str:
        if value != DEMO_MODEL and not Path(value).is_dir():
            raise ValueError(f"model directory {value!r} does not exist")
        return value

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_settings(cls, value: Any) -> CompileSettings:
        return CompileSettings.from_dict(value)  # raises naming unknown or invalid settings


class AppConfig(_Strict):
    """The whole rbln-ray Serve application."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    # The bearer token /v1 routes require: given inline, or (so it shows in no config file,
    # process list or Serve's status) named by an environment variable or a file (0600).
    api_key: str | None = None
    api_key_env: str | None = None
    api_key_file: str | None = None
    # cache_aware: rbln_ray.serve.cache_routing (sessions, replicas' reported caches, load);
    # direct: Serve's proxy sends each request straight to a model replica, which runs the
    # ingress's checks itself (rbln_ray.serve.direct: one model, one hop fewer)
    routing: Literal["load_aware", "prefix_affinity", "cache_aware", "direct"] = "load_aware"
    # Browser origins allowed to call the app (CORS; `vllm serve`'s --allowed-origins, which
    # defaults to every origin). Empty: no CORS headers, browsers refuse cross-origin calls.
    cors_allowed_origins: list[str] = Field(default_factory=list)
    limits: RequestLimits = Field(default_factory=lambda: RequestLimits())
    ingress: IngressConfig = Field(default_factory=lambda: IngressConfig())
    models: list[ModelDeploymentConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> AppConfig:
        names = [m.name for m in self.models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"model names must be unique; repeated: {duplicates}")
        return self

    @model_validator(mode="after")
    def _direct_routing(self) -> AppConfig:
        """``routing: direct`` serves one model from replicas that are the app's ingress:
        what needs a separate ingress deployment is refused with the reason."""
        if self.routing != "direct":
            return self
        if len(self.models) != 1:
            names = [m.name for m in self.models]
            raise ValueError(
                f"routing: direct serves one model per app (the proxy sends each request "
                f"straight to its replicas), not {names}: deploy one app per model"
            )
        model = self.models[0]
        if model.pd is not None:
            raise ValueError(
                f"routing: direct: model {model.name} has pd, whose prefill hop is the "
                "ingress's; use another routing"
            )
        if model.responses_store and (model.num_replicas or 0) != 1:
            raise ValueError(
                f"routing: direct: model {model.name} stores responses in the replica that "
                "made them, and the proxy cannot send a later call about one back there; "
                "use num_replicas: 1 or another routing"
            )
        if "ingress" in self.model_fields_set:
            raise ValueError(
                "routing: direct has no ingress deployment (the model's replicas are the "
                "ingress): drop ingress:"
            )
        return self

    @model_validator(mode="after")
    def _one_api_key_source(self) -> AppConfig:
        given = [n for n in ("api_key", "api_key_env", "api_key_file") if getattr(self, n)]
        if len(given) > 1:
            raise ValueError(f"set one of api_key, api_key_env, api_key_file, not {given}")
        return self

    def resolved_api_key(self) -> str | None:
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ValueError(f"api_key_env={self.api_key_env!r} is not set")
            return key
        if self.api_key_file:
            path = Path(self.api_key_file).expanduser()
            if not path.is_file():
                raise ValueError(f"api_key_file={self.api_key_file!r} does not exist")
            if path.stat().st_mode & 0o077:
                raise ValueError(
                    f"api_key_file={self.api_key_file!r} is readable by other users: chmod 600"
                )
            key = path.read_text().strip()
            if not key:
                raise ValueError(f"api_key_file={self.api_key_file!r} is empty")
            return key
        return self.api_key


def load_config(source: str | Path | dict[str, Any] | AppConfig) -> AppConfig:
    """Validate a config given as a YAML path, a dict (Serve ``args``), or an ``AppConfig``."""
    if isinstance(source, AppConfig):
        return source
    if isinstance(source, dict):
        return AppConfig.model_validate(source)
    data = yaml.safe_load(Path(source).read_text())
    if isinstance(data, dict) and "applications" in data:  # a Serve config file
        data = data["applications"][0].get("args", {})
    return AppConfig.model_validate(data)


def embedded_default() -> AppConfig:
    """``rbln-ray serve`` with no arguments: the demo model, two replicas, localhost:8000."""
    return AppConfig(
        models=[ModelDeploymentConfig(name=DEMO_MODEL, model=DEMO_MODEL, num_replicas=2)]
    )
