"""LoRA adapters as served models of the Serve app (issue 33).

An adapter is compiled into its base model's artifact (:mod:`rbln_ray.compile.lora`), so a
deployment serves the adapters of its model: those of ``compile.lora_modules`` (an HF
directory compiled with them), or those compiled into the artifact it is given. Each replica
starts its engine as ``vllm serve --enable-lora --lora-modules NAME=DIR ...`` would
(:func:`lora_engine_args`), so vLLM's own OpenAI layer lists every adapter in ``/v1/models``
(its ``parent`` the base model) and runs a request whose ``model`` names one with it. The
ingress routes an adapter's name to its base model's deployment (:func:`adapter_bases`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rbln_ray.compile.artifact import CompiledArtifact, is_compiled_dir, load_artifact
from rbln_ray.compile.lora import ADAPTERS_DIR
from rbln_ray.serve.config import DEMO_MODEL, ModelDeploymentConfig


def served_adapters(cfg: ModelDeploymentConfig, model_path: str) -> dict[str, str]:
    """Adapter name -> directory of every adapter ``cfg`` serves (empty: none, or LoRA
    switched off with ``engine_kwargs.enable_lora: false``)."""
    if cfg.engine_kwargs.get("enable_lora") is False:
        return {}
    if cfg.compile.lora_modules:
        return dict(cfg.compile.lora_modules)
    if model_path == DEMO_MODEL or not is_compiled_dir(model_path):
        return {}
    art = load_artifact(model_path)
    if not isinstance(art, CompiledArtifact) or art.lora is None:
        return {}
    # the artifact's own copies: they hold the compiled contents wherever it was moved
    return {name: str(Path(model_path).resolve() / ADAPTERS_DIR / name) for name in art.lora.names}


def lora_engine_args(cfg: ModelDeploymentConfig, model_path: str) -> dict[str, Any]:
    """``vllm serve`` options (``engine_kwargs`` form, :mod:`rbln_ray.serve.vllm_args`) that
    serve the deployment's adapters: none without any."""
    adapters = served_adapters(cfg, model_path)
    if not adapters:
        return {}
    return {
        "enable_lora": True,
        "lora_modules": [
            {"name": name, "path": path, "base_model_name": cfg.name}
            for name, path in adapters.items()
        ],
    }


def adapter_bases(models: list[ModelDeploymentConfig]) -> dict[str, str]:
    """Adapter name -> the served model that serves it; a name served twice is an error."""
    bases: dict[str, str] = {}
    names = {m.name for m in models}
    for m in models:
        for adapter in served_adapters(m, m.model):
            if adapter in names or adapter in bases:
                other = bases.get(adapter, adapter)
                raise ValueError(
                    f"LoRA adapter {adapter!r} of model {m.name!r} has the name of another "
                    f"served model or adapter ({other!r}): request routing needs distinct names"
                )
            bases[adapter] = m.name
    return bases
