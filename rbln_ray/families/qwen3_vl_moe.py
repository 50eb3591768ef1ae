"""Qwen3-VL-MoE on RBLN: Qwen3-VL (:mod:`.qwen3_vl`) with a mixture-of-experts language model.

optimum-rbln 0.12 compiles its sparse layers with the ``custom_moe_glu`` kernel (experts
split from transformers' fused ``gate_up_proj``), as for the text-only Qwen3-MoE family; the
tower, the deepstack inputs, the processor (transformers' ``Qwen3VLProcessor``) and vLLM's
view are Qwen3-VL's, with the MoE model's config class and ``get_rope_index``.
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen3VLMoeConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeModel
from vllm.multimodal import MULTIMODAL_REGISTRY

from rbln_ray.families import qwen3_vl
from rbln_ray.families.qwen_vl_base import interleaved_mrope_text
from rbln_ray.families.qwen_vl_vllm import QwenVLDummyInputs, QwenVLMultiModalProcessor


class Embedder(qwen3_vl.Embedder):
    ROPE_MODEL = Qwen3VLMoeModel


class Qwen3VLMoeProcessingInfo(qwen3_vl.Qwen3VLProcessingInfo):
    CONFIG = Qwen3VLMoeConfig


@MULTIMODAL_REGISTRY.register_processor(
    QwenVLMultiModalProcessor, info=Qwen3VLMoeProcessingInfo, dummy_inputs=QwenVLDummyInputs
)
class RBLNQwen3VLMoeDeclaration(qwen3_vl.RBLNQwen3VLDeclaration):
    """``Qwen3VLMoeForConditionalGeneration`` as vLLM's registry and front end see it on
    RBLN."""

    EMBEDDER = Embedder


class Qwen3VLMoe(qwen3_vl.Qwen3VL):
    Embedder = Embedder

    def tiny_model(self, spec: Any, tokenizer: Any) -> tuple[Any, Any]:
        """Qwen3-VL's recipe with every decoder layer sparse: the spec's experts, a quarter
        of its intermediate size each (as the text-only Qwen3-MoE tiny model)."""
        import transformers

        language = spec.language
        text = dict(
            interleaved_mrope_text(spec, tokenizer),
            num_experts=language.num_experts,
            num_experts_per_tok=language.experts_per_token,
            moe_intermediate_size=language.intermediate_size // 4,
            decoder_sparse_step=1,
            tie_word_embeddings=False,
        )
        config = transformers.Qwen3VLMoeConfig(
            text_config=text,
            vision_config=self.tiny_vision(spec),
            tie_word_embeddings=False,
            **self.token_ids(tokenizer),
        )
        model = transformers.Qwen3VLMoeForConditionalGeneration(config)
        return model, self.tiny_processor(spec, tokenizer)


CODE = Qwen3VLMoe()
