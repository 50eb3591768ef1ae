"""Over-limit requests for every route of vLLM's table the ingress forwards by model: one per
body shape (each model of a route's union) and limited field, generated from the route table
so a route vLLM adds cannot skip a limit. The ingress unit test sends them against small
limits; the chaos soak's adversaries send them against the defaults."""

from __future__ import annotations

import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# Values for a shape's required fields, so the over-limit field is the only thing wrong
# (the first value a shape's model accepts).
MESSAGE = {"role": "user", "content": "x"}
REQUIRED: dict[str, tuple[Any, ...]] = {
    "messages": ([MESSAGE], [[MESSAGE]]), "input": ("x",), "prompt": ("x",),
    "query": ("x",), "documents": (["x"],), "queries": (["x"],), "items": (["x"],),
    "text_1": ("x",), "text_2": ("x",), "data_1": (["x"],), "data_2": (["x"],),
    "data": ("x",), "tokens": ([1],), "model": ("m",), "max_tokens": (4,),
    "texts": (["x"],),
}  # fmt: skip
# Fields some shapes need although no field alone is required.
SOMETIMES_NEEDED = ("prompt", "texts")


@dataclass(frozen=True)
class LimitCase:
    """One request that breaks one limit."""

    path: str
    shape: str  # the request model's name
    field: str
    body: dict[str, Any]
    form: bool  # a multipart upload (add the file)
    needle: str  # words the refusal names the limit with


def required_body(model: type, required: list[str]) -> dict[str, Any]:
    """A body of ``model`` with each required field set to the first value it accepts."""
    from pydantic import ValidationError

    body: dict[str, Any] = {}
    for field in required:
        for value in REQUIRED[field]:
            try:
                model.model_validate({**body, field: value})  # type: ignore[attr-defined]
            except ValidationError as exc:
                if any(e["loc"][:1] == (field,) for e in exc.errors()):
                    continue
            except Exception as exc:  # noqa: BLE001 - vLLM's own (VLLMValidationError)
                if getattr(exc, "parameter", None) == field:
                    continue
            body[field] = value
            break
    return body


def over_limit(path: str, field: str, limits: Any) -> tuple[Any, str] | None:
    """An over-limit value of ``field`` under ``limits`` (a RequestLimits) and the words of
    its refusal; None for a field no limit applies to on this route."""
    from rbln_ray.serve.ingress import (
        CHAT_ROUTES,
        CONVERSATION_ROUTES,
        FAN_OUT_FIELDS,
        PROMPT_FIELDS,
        TOKEN_FIELDS,
    )

    if field in FAN_OUT_FIELDS:
        value = limits.max_n + 1
        return value, f"{field}={value} exceeds the limit of {limits.max_n}"
    if field in TOKEN_FIELDS:
        value = limits.max_tokens + 10
        return value, f"max_tokens={value} exceeds the limit of"
    if field in PROMPT_FIELDS and not path.startswith((*CONVERSATION_ROUTES, *CHAT_ROUTES)):
        return ["a"] * (limits.max_prompts + 1), "max_prompts"
    return None


def fits(info: Any, field: str) -> bool:
    """Whether a field's type admits the over-limit value (a prompt field that takes one
    string cannot carry several prompts: vLLM's own 400 refuses a list there)."""
    from rbln_ray.serve.ingress import PROMPT_FIELDS

    if field not in PROMPT_FIELDS:
        return True

    def origins(annotation: Any) -> Iterator[Any]:
        yield typing.get_origin(annotation) or annotation
        for arg in typing.get_args(annotation):
            yield from origins(arg)

    return list in set(origins(info.annotation))


def limit_cases(limits: Any, model_name: str) -> Iterator[LimitCase]:
    """Every (route, shape, limited field) of vLLM's table, as an over-limit request for
    ``model_name``. Raises naming a shape whose required field this cannot fill."""
    from rbln_ray.serve.ingress import LIMITED_FIELDS
    from rbln_ray.serve.routes import Kind, classify, request_models, takes_form, vllm_routes

    for (path, method), route in vllm_routes().items():
        if classify(path, method, route)[0] is not Kind.MODEL:
            continue
        for model in request_models(route):
            fields = model.model_fields  # type: ignore[attr-defined]
            limited = [
                f for f, info in fields.items()
                if f in LIMITED_FIELDS and over_limit(path, f, limits) and fits(info, f)
            ]  # fmt: skip
            if not limited:
                continue
            required = [f for f, info in fields.items() if info.is_required() and f != "file"]
            required += [f for f in SOMETIMES_NEEDED if f in fields and f not in required]
            missing = [f for f in required if f not in REQUIRED]
            if missing:
                raise ValueError(f"{path} {model.__name__}: cannot fill {missing}")
            for field in limited:
                value, needle = over_limit(path, field, limits)  # type: ignore[misc]
                needed = [f for f in required if f != field]
                body = required_body(model, needed) | {"model": model_name, field: value}
                yield LimitCase(path, model.__name__, field, body, takes_form(route), needle)
