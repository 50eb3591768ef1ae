"""vLLM's view of quantized RBLN artifacts: the ``rbln`` quantization method, and the KV cache
dtype.

Why a vLLM quantization method: a quantized artifact keeps its checkpoint's
``quantization_config`` in ``config.json`` (optimum-rbln copies it), and vLLM's
``ModelConfig`` validates that before rbln-ray's platform hook runs: an ``rbln`` method is
unknown to it, and a ``compressed-tensors`` one would pull in vLLM's own quantized layers,
which the RBLN path never builds (the compiled graphs hold the quantized weights). rbln-ray
therefore registers, through vLLM's public ``register_quantization_config``, a method named
``rbln`` that claims the checkpoints :mod:`rbln_ray.compile.quantization` compiles and does
nothing else (no layers, no weight loading). gpt-oss's MXFP4 checkpoints keep vLLM's own
method (optimum compiles their experts with ``custom_moe_glu_mxfp4``).

Requested quantization that would not happen is refused, never ignored: vLLM's online
quantization (``quantization="fp8"`` on an unquantized model) does not run on RBLN, and
``kv_cache_dtype="fp8"`` needs an artifact whose KV caches are fp8 (compiled with the
checkpoint's KV scales; an HF directory is compiled so).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from rbln_ray.compile.artifact import CompiledArtifact
from rbln_ray.compile.quantization import METHODS, OTHER_PATHS
from rbln_ray.compile.settings import CompileSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

# the vLLM quantization method of quantized RBLN artifacts (registered by quant_config.py)
METHOD = "rbln"


class RBLNQuantizationError(ValueError):
    """Quantization was asked for that the RBLN path would not perform (message says why)."""


def check_request(vllm_config: VllmConfig) -> None:
    """Refuse, before anything compiles, quantization vLLM was asked for that RBLN would not
    perform."""
    model_config = vllm_config.model_config
    method = model_config.quantization
    own = (getattr(model_config.hf_config, "quantization_config", None) or {}).get("quant_method")
    # vLLM names GPT-OSS's MXFP4 experts gpt_oss_mxfp4 even for a checkpoint without a
    # quantization_config: the family's compile serves them (custom_moe_glu_mxfp4)
    other = own in OTHER_PATHS or any(path in str(method) for path in OTHER_PATHS)
    if method not in (None, METHOD) and not other:
        raise RBLNQuantizationError(
            f"quantization={method!r}: vLLM's own quantization does not run on RBLN (the "
            "compiled graphs compute the model); serve a pre-quantized checkpoint "
            f"({', '.join(METHODS)}), which rbln-ray compiles with optimum-rbln's quantization"
        )
    dtype = vllm_config.cache_config.cache_dtype
    if dtype not in ("auto", "fp8", "fp8_e4m3"):
        raise RBLNQuantizationError(
            f"kv_cache_dtype={dtype!r}: RBLN KV caches are the model dtype or fp8 (e4m3)"
        )


def compile_settings(vllm_config: VllmConfig, settings: CompileSettings) -> CompileSettings:
    """An HF directory asked to serve with fp8 KV is compiled with fp8 KV caches."""
    if vllm_config.cache_config.cache_dtype.startswith("fp8") and not settings.kv_cache_dtype:
        return settings.model_copy(update={"kv_cache_dtype": "fp8"})
    return settings


def sync(vllm_config: VllmConfig, art: Any) -> None:
    """vLLM's KV cache dtype from the artifact: fp8 when its KV caches are fp8, and an fp8
    request on an artifact whose KV caches are not is an error naming both."""
    cache = vllm_config.cache_config
    kv_fp8 = isinstance(art, CompiledArtifact) and art.quantization is not None
    kv_fp8 = kv_fp8 and art.quantization.kv_caches == "fp8"
    if cache.cache_dtype.startswith("fp8") and not kv_fp8:
        raise RBLNQuantizationError(
            f"kv_cache_dtype={cache.cache_dtype!r} conflicts with {art.path}, whose KV caches "
            "are not fp8; compile a checkpoint with fp8 KV scales (rbln-ray compile "
            "--kv-cache-dtype fp8) or leave kv_cache_dtype at auto"
        )
    if kv_fp8 and cache.cache_dtype != "fp8_e4m3":
        if cache.cache_dtype == "auto":
            logger.info("kv_cache_dtype auto -> fp8_e4m3 (%s has fp8 KV caches)", art.path.name)
        cache.cache_dtype = "fp8_e4m3"
