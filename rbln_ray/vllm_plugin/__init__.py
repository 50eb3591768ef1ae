"""vLLM integration: the RBLN platform plugin, worker, model runner, loader and scheduler."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

PLATFORM_CLS = "rbln_ray.vllm_plugin.platform.RBLNPlatform"


def register() -> str | None:
    """``vllm.platform_plugins`` entry point (vLLM calls it in every process it starts).

    Returns the RBLN platform's qualname when RBLN devices are in play (a real ``rebel``
    runtime, or ``RBLN_RAY_DEVICE=emulated``), else ``None`` so plain vLLM in the same
    environment is unaffected. Activating here also makes ``rebel`` importable in vLLM's
    spawned engine process before anything imports optimum-rbln.
    """
    from rbln_ray.common.logging_setup import setup_logging
    from rbln_ray.emulator import ensure_runtime

    setup_logging()
    runtime = ensure_runtime()
    if runtime == "none":
        return None
    if runtime == "rbln":
        import rebel

        if rebel.device_count() == 0:  # rebel-compiler installed, but no ATOM card here
            return None
    return PLATFORM_CLS


def register_models() -> None:
    """``vllm.general_plugins`` entry point: on RBLN, vLLM's registry gets rbln-ray's
    declarations of the vision-language architectures whose vLLM modules cannot be imported
    here (:func:`declarations`); elsewhere (plain vLLM in the same environment) nothing
    changes."""
    from rbln_ray.emulator import ensure_runtime

    if ensure_runtime() == "none":
        return
    from vllm import ModelRegistry

    from rbln_ray.vllm_plugin.host_kv_connector import register as register_host_tier

    for arch, qualname in declarations().items():
        ModelRegistry.register_model(arch, qualname)
    register_host_tier()  # kv_connector: RBLNHostKVConnector


def declarations() -> dict[str, str]:
    """architecture -> ``module:class`` of rbln-ray's declarations (the class vLLM's registry
    inspects in place of vLLM's own, :mod:`rbln_ray.families.vision_base`), imported by vLLM
    only when used: a vision-language family's own, and for a declared text-only decoder the
    plain one (a text-generation model, neither multimodal nor hybrid)."""
    from rbln_ray.families.registry import DECODERS, VISION

    found = {
        f.architecture: f"rbln_ray.families.{f.module}:{f.declaration}"
        for f in VISION.values()
        if f.declaration
    }
    plain = "rbln_ray.families.vision_base:Declaration"
    found.update({f.architecture: plain for f in DECODERS.values() if f.declared})
    return found
