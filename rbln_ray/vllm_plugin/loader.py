"""Model loading: compiled directory → optimum-rbln model on the pinned RBLN devices.

Compiling an HF directory first (on first use) is :mod:`rbln_ray.compile.compiled_cache`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from rbln_ray.compile.artifact import CompiledArtifact
from rbln_ray.compile.encoders import EncoderArtifact
from rbln_ray.compile.lora import loadable_dir
from rbln_ray.compile.speech import SpeechArtifact
from rbln_ray.families.registry import POOLING_DECODERS, VISION

logger = logging.getLogger(__name__)


def load_compiled_model(
    artifact: CompiledArtifact | EncoderArtifact | SpeechArtifact, device_ids: Sequence[int]
) -> Any:
    """Load the optimum-rbln model with runtimes on ``device_ids`` (visible-device indices): a
    decoder through ``RBLNAutoModelForCausalLM``, an encoder, a speech model or a
    vision-language model through its family's class (which loads its vision tower and
    language model too)."""
    from rbln_ray.emulator import require_runtime

    require_runtime("load a compiled model")
    import optimum.rbln

    from rbln_ray.upstream.optimum_models import rbln_class

    extra: dict[str, Any] = {}
    if isinstance(artifact, EncoderArtifact | SpeechArtifact):
        cls = rbln_class(artifact.family.optimum_class)
    elif artifact.is_multimodal:
        family = VISION[artifact.vision_family]
        cls = getattr(optimum.rbln, family.optimum_class)
        config = family.code().hf_config(artifact.path)
        if config is not None:  # e.g. Qwen3-ASR: vLLM's own class for its model_type
            extra["config"] = config
    elif artifact.pooling:  # a decoder compiled for embeddings (e.g. RBLNQwen3Model)
        cls = rbln_class(POOLING_DECODERS[artifact.pooling].optimum_class)
    else:
        cls = optimum.rbln.RBLNAutoModelForCausalLM
    device: int | list[int] = device_ids[0] if len(device_ids) == 1 else list(device_ids)
    logger.info("loading %s on RBLN device(s) %s", artifact.path, device)
    path = loadable_dir(artifact.path) if getattr(artifact, "lora", None) else artifact.path
    return cls.from_pretrained(str(path), export=False, rbln_device=device, **extra)
