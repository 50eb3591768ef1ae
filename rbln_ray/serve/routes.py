"""The route table of the ingress, derived from vLLM's own OpenAI-compatible server.

Why derived: ``vllm serve`` answers some sixty (path, method) pairs, added to in every
release (the Responses API, Anthropic's Messages, pooling, tokenizer routes). The ingress
builds vLLM's app once with every feature flag on and no engine (:func:`vllm_routes`; vLLM's
app needs only its parsed arguments to list its routes), then sorts each route into one
:class:`Kind`. A route of a future vLLM is forwarded by default, with its own request model.

What is not served, and why (:data:`CONTROL`, :data:`UNSERVED_REASON`): engine control
(sleep, weight updates, collective RPC, cache resets, pause) acts on one engine, and a model
here is N Serve replicas behind a router; metrics go through Ray's metrics pipeline; runtime
LoRA loading does not apply to compiled artifacts; SageMaker's dispatch route and the
token-in/token-out route take bodies the ingress's admission checks cannot read. Each is
answered with a 404 whose body says why (``vllm serve`` answers them 404 too unless started
in development mode).

``python -m rbln_ray.serve.routes --markdown`` prints the table (README, "Routes").
"""

from __future__ import annotations

import enum
import functools
import os
import sys
import types
import typing
from collections.abc import Iterable, Iterator
from typing import Any
from unittest import mock


class Kind(enum.Enum):
    MODEL = "forwarded to the model named in the body"
    RESPONSE_ID = "forwarded to the replica holding the stored response"
    QUERY_MODEL = "forwarded to the model named by ?model= (or the only model)"
    INGRESS = "answered by the ingress"
    UNSERVED = "refused: 404 with the reason"


CONTROL_MODULES = (
    "vllm.entrypoints.serve.dev.",
    "vllm.entrypoints.serve.elastic_ep.",
    "vllm.entrypoints.serve.profile.",
    "vllm.entrypoints.serve.lora.",
    "vllm.entrypoints.serve.fault_tolerance.",
)
CONTROL = (
    "engine control acts on one engine; rbln-ray runs each model as Serve replicas behind a "
    "router and does not expose engine control over HTTP"
)
LORA = "runtime LoRA loading is not supported: adapters are compiled into the RBLN artifact"
UNSERVED_REASON = {
    "/metrics": (
        "metrics are exported through Ray's metrics pipeline (ray_vllm_* and ray_rbln_* "
        "series, docs/OPERATIONS.md)"
    ),
    "/load": "per-replica load is Serve's to balance; see /health and Ray's metrics",
    "/abort_requests": CONTROL,
    "/adapters": LORA,
    "/adapters/{adapter_name}": LORA,
    "/invocations": (
        "SageMaker's dispatch route; call the OpenAI-compatible route it would dispatch to"
    ),
    "/inference/v1/generate": (
        "token-in/token-out serving for disaggregated deployments is not served; use "
        "/v1/completions with token ids"
    ),
}
INGRESS_PATHS = {"/version", "/health", "/ping", "/v1/models"}
# Paths whose errors are Anthropic-shaped ({"type": "error", "error": {...}}) in vLLM.
ANTHROPIC_PREFIX = "/v1/messages"


class _PoolingConfigStub:
    """What vLLM's ``register_pooling_api_routers`` reads of a model config."""

    def __init__(self, task: str) -> None:
        self.task = task
        self.hf_config = types.SimpleNamespace(num_labels=1)

    def get_pooling_task(self, tasks: Iterable[str]) -> str:
        return self.task


def flatten(routes: Iterable[Any]) -> Iterator[Any]:
    """Every route of an app, routers included within routers (FastAPI 0.137 keeps included
    routers lazily in ``app.routes``; 0.136 has plain routes)."""
    from fastapi.routing import APIRoute

    for route in routes:
        sub = getattr(route, "routes", None)
        if sub and not isinstance(route, APIRoute):
            yield from flatten(sub)
        else:
            yield route


@functools.cache
def vllm_routes() -> dict[tuple[str, str], Any]:
    """Every ``(path, method)`` vLLM's server can answer, with its ``APIRoute``: the app of a
    generating and transcribing model with every optional router on, and the pooling routers
    of an embedding and a classifying model. vLLM attaches some routes to module-level
    routers when an app is built, so a second build in one process repeats them: the first
    one counts."""
    from fastapi import FastAPI
    from fastapi.routing import APIRoute
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.pooling.factories import register_pooling_api_routers
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", "unused", "--enable-tokenizer-info-endpoint", "--enable-scale-out"]
    )
    dev = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    with mock.patch.dict(os.environ, dev):  # the control routes too, to refuse them by name
        # "transcription": the speech-to-text routes (/v1/audio/*), multipart uploads.
        apps = [build_app(args, ("generate", "transcription"), None)]
        for task in ("embed", "classify"):
            app = FastAPI()
            register_pooling_api_routers(app, (task,), _PoolingConfigStub(task))
            apps.append(app)
    table: dict[tuple[str, str], Any] = {}
    for app in apps:
        for route in flatten(app.routes):
            if isinstance(route, APIRoute):
                for method in sorted(route.methods):
                    table.setdefault((route.path, method), route)
    return dict(sorted(table.items()))


def classify(path: str, method: str, route: Any) -> tuple[Kind, str | None]:
    """How the ingress serves one of vLLM's routes, and why not when it does not."""
    if path in INGRESS_PATHS:
        return Kind.INGRESS, None
    if path in UNSERVED_REASON:
        return Kind.UNSERVED, UNSERVED_REASON[path]
    if route.endpoint.__module__.startswith("vllm.entrypoints.serve.lora."):
        return Kind.UNSERVED, LORA
    if route.endpoint.__module__.startswith(CONTROL_MODULES):
        return Kind.UNSERVED, CONTROL
    if "{response_id}" in path:
        return Kind.RESPONSE_ID, None
    if method == "GET":
        return Kind.QUERY_MODEL, None
    return Kind.MODEL, None


def request_models(route: Any) -> list[type]:
    """The pydantic model(s) a route's body is validated with (a union gives several; a
    route that parses its body itself, none)."""
    field = getattr(route, "body_field", None)
    if field is None:
        return []

    def flat(annotation: Any) -> Iterator[Any]:
        args = typing.get_args(annotation)
        if args and typing.get_origin(annotation) is not list:
            for arg in args:
                yield from flat(arg)
        else:
            yield annotation

    annotation = field.field_info.annotation
    return [t for t in flat(annotation) if isinstance(t, type) and hasattr(t, "model_fields")]


def takes_form(route: Any) -> bool:
    """Whether a route's body is a multipart form (the speech-to-text uploads)."""
    from fastapi import params

    field = getattr(route, "body_field", None)
    return field is not None and isinstance(field.field_info, params.Form)


def unknown_model_param(route: Any) -> str | None:
    """The ``param`` of vLLM's 404 for an unknown model on ``route``: its generating routes
    name ``model`` (``OpenAIServing._check_model``), its pooling routes raise
    ``VLLMNotFoundError``, which names none."""
    module = getattr(route.endpoint, "__module__", "") or ""
    return None if module.startswith("vllm.entrypoints.pooling.") else "model"


def table() -> list[tuple[str, str, Kind, str | None]]:
    """``(path, method, kind, reason)`` of every vLLM route."""
    return [(p, m, *classify(p, m, r)) for (p, m), r in vllm_routes().items()]


def text() -> str:
    """The route table as plain text, one route a line (tests/unit/data/vllm_routes.txt)."""
    rows = (f"{m:6} {p:40} {k.name:12} {r or ''}".rstrip() for p, m, k, r in table())
    return "".join(row + "\n" for row in rows)


def markdown() -> str:
    """The route table as a Markdown table (README, "Routes")."""
    lines = ["| method | path | served as |", "|---|---|---|"]
    for path, method, kind, reason in table():
        lines.append(f"| {method} | `{path}` | {reason if reason else kind.value} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if "--markdown" in sys.argv:
        print(markdown())
    else:
        print(text(), end="")
