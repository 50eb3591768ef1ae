"""Ray Serve app: OpenAI-compatible HTTP routes over per-model RBLN engine deployments."""

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
