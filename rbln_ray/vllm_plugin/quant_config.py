"""The ``rbln`` vLLM quantization method (see :mod:`rbln_ray.vllm_plugin.quantization`): it
claims the checkpoints rbln-ray compiles quantized, and builds nothing (the compiled graphs
hold the quantized layers). A module of its own because it subclasses vLLM's
``QuantizationConfig``, which cannot be imported while vLLM resolves its platform (the
platform registers it later, :func:`register`)."""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from rbln_ray.compile.quantization import METHODS
from rbln_ray.vllm_plugin.quantization import METHOD


def register() -> None:
    """Register the ``rbln`` method with vLLM (idempotent; vLLM calls the platform's
    ``pre_register_and_update`` before it builds a ``ModelConfig``)."""
    from vllm.model_executor.layers.quantization import (
        QUANTIZATION_METHODS,
        register_quantization_config,
    )

    if METHOD not in QUANTIZATION_METHODS:
        register_quantization_config(METHOD)(RBLNQuantConfig)


class RBLNQuantConfig(QuantizationConfig):
    """A checkpoint rbln-ray compiles quantized (its ``quantization_config`` as given)."""

    def __init__(self, raw: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.raw = dict(raw or {})

    def get_name(self) -> str:
        return METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> RBLNQuantConfig:
        return cls(config)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> None:
        return None  # the compiled graphs hold the quantized layers; vLLM builds none

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
    ) -> str | None:
        """Claim the checkpoints rbln-ray compiles quantized (vLLM probes custom methods
        before its own)."""
        if hf_quant_cfg.get("quant_method") in METHODS and user_quant in (None, METHOD):
            return METHOD
        return None
