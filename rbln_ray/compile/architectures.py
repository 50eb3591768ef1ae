"""Which Hugging Face architectures rbln-ray compiles and serves.

Why checked before anything loads: optimum-rbln would otherwise fail deep inside a compile
(or, worse, compile a model whose serving path rbln-ray has never verified).
"""

from __future__ import annotations

import json
from pathlib import Path

# Architectures whose optimum-rbln decoder path rbln-ray has verified token-exact.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)


class UnsupportedModelError(ValueError):
    """The model's architecture is not one rbln-ray serves."""


def check_architecture(hf_config_path: Path) -> str:
    """Return the model's architecture or raise naming the supported ones."""
    archs = json.loads(hf_config_path.read_text()).get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise UnsupportedModelError(
        f"{hf_config_path.parent}: architecture {archs or 'unknown'} is not supported by rbln-ray; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
