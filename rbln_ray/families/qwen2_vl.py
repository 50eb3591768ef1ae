"""Qwen2-VL on RBLN: a ViT with 2-D rotary positions whose merger maps 2 x 2 patches of 14
pixels to one token, and a Qwen2 language model with M-RoPE (temporal, height and width
sections of its rotary dimensions); images of any size, and videos.

Everything but its transformers classes and its tiny model's recipe is the shared Qwen-VL
path (:mod:`.qwen_vl_base`: tower, M-RoPE position embeddings, family contract;
:mod:`.qwen_vl_vllm`: vLLM's processor and declaration; :mod:`.qwen_vl_processor`: the
processor without torchvision).
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen2VLConfig, Qwen2VLProcessor
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel
from vllm.multimodal import MULTIMODAL_REGISTRY

from rbln_ray.families.qwen_vl_base import MRopeEmbedder, QwenVLCode, sectioned_mrope_text
from rbln_ray.families.qwen_vl_processor import WithoutTorchvision
from rbln_ray.families.qwen_vl_vllm import (
    MRopeDeclaration,
    QwenVLDummyInputs,
    QwenVLMultiModalProcessor,
    QwenVLProcessingInfo,
)


class Qwen2VLPilProcessor(WithoutTorchvision, Qwen2VLProcessor):
    """``Qwen2VLProcessor`` without torchvision: PIL images, numpy videos."""


class Embedder(MRopeEmbedder):
    """Positions by ``Qwen2VLModel.get_rope_index``."""

    ROPE_MODEL = Qwen2VLModel


class Qwen2VLProcessingInfo(QwenVLProcessingInfo):
    CONFIG = Qwen2VLConfig
    PROCESSOR = Qwen2VLPilProcessor


@MULTIMODAL_REGISTRY.register_processor(
    QwenVLMultiModalProcessor, info=Qwen2VLProcessingInfo, dummy_inputs=QwenVLDummyInputs
)
class RBLNQwen2VLDeclaration(MRopeDeclaration):
    """``Qwen2VLForConditionalGeneration`` as vLLM's registry and front end see it on RBLN."""

    EMBEDDER = Embedder


class Qwen2VL(QwenVLCode):
    PROCESSOR = Qwen2VLPilProcessor
    Embedder = Embedder

    def tiny_model(self, spec: Any, tokenizer: Any) -> tuple[Any, Any]:
        """Qwen2-VL's recipe at the spec's shape: a ViT over 14-pixel patches (two frames per
        temporal patch) with 2-D rotary positions, 2 x 2 patches merged into one token by an
        MLP, a Qwen2 language model with M-RoPE."""
        import transformers

        language = spec.language
        vision = dict(
            depth=spec.vision_layers,
            embed_dim=spec.vision_hidden_size,
            hidden_size=language.hidden_size,  # the merger's output: the LM's embeddings
            mlp_ratio=2,
            num_heads=spec.vision_heads,
            patch_size=spec.patch_size,
            # not a field of transformers' config, but in every Qwen2-VL checkpoint's, and
            # optimum-rbln 0.12's vision tower reads it
            spatial_patch_size=spec.patch_size,
            spatial_merge_size=2,
            temporal_patch_size=2,
            initializer_range=language.initializer_range,
        )
        config = transformers.Qwen2VLConfig(
            text_config=sectioned_mrope_text(spec, tokenizer),
            vision_config=vision,
            tie_word_embeddings=False,
            **self.token_ids(tokenizer),
        )
        model = transformers.Qwen2VLForConditionalGeneration(config)
        return model, self.tiny_processor(spec, tokenizer)


CODE = Qwen2VL()
