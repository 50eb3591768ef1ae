"""Qwen3-VL on RBLN: the shared Qwen-VL path (:mod:`.qwen_vl_base`) with deepstack features
and interleaved M-RoPE.

What differs from Qwen2-VL (:mod:`.qwen2_vl`), and why:

* **Deepstack.** The vision tower also returns, per image token, the merged features of some
  of its inner layers (``deepstack_visual_indexes``); the language model adds the i-th of
  them to its hidden states after its i-th layer, at the image's positions. optimum-rbln 0.12
  compiles the prefill with two more inputs for that, ``visual_pos_mask [1, chunk]`` and
  ``deepstack_embeds [layers, chunk, hidden]`` (zeros when a chunk has no image); the decode
  graphs take none. The embedder keeps them with the prompt's embeddings (the tower's side
  features, :class:`~rbln_ray.families.vision_base.PromptEmbedder`) and slices them per
  prefill chunk like the embeddings, so chunked prefill and prefix caching work as for
  Qwen2-VL: a resumed prefill needs them only at and after its start, and an image wholly
  before it is not encoded again.
* **Interleaved M-RoPE.** The temporal, height and width positions take interleaved rotary
  frequencies rather than sections; optimum's own position embeddings (the model's rotary
  table) encode that, so the runner passes the same ``[3, batch, length]`` positions, from
  ``Qwen3VLModel.get_rope_index`` (which positions a video frame by frame).
* **Processor and patches.** ``Qwen3VLProcessor`` (also Qwen3-VL-MoE's) needs a video
  processor like Qwen2-VL's and also sets the vision start and end tokens from the tokenizer;
  the image processor is Qwen2-VL's with 16-pixel patches (32-pixel merged tokens).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen3VLConfig, Qwen3VLProcessor
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel
from vllm.multimodal import MULTIMODAL_REGISTRY

from rbln_ray.families.qwen_vl_base import MRopeEmbedder, QwenVLCode, interleaved_mrope_text
from rbln_ray.families.qwen_vl_processor import VISION_END, VISION_START, WithoutTorchvision
from rbln_ray.families.qwen_vl_vllm import (
    MRopeDeclaration,
    QwenVLDummyInputs,
    QwenVLMultiModalProcessor,
    QwenVLProcessingInfo,
)

# Qwen3-VL's patches are 16 pixels, merged 2 x 2 into one token of 32 x 32 pixels; the tiny
# model's budget is 64 tokens (256 patches) an image, its minimum 2 x 2 tokens.
PATCH = 16
TINY_MAX_PIXELS = (2 * PATCH) ** 2 * 64
MIN_PIXELS = (4 * PATCH) ** 2


class Qwen3VLPilProcessor(WithoutTorchvision, Qwen3VLProcessor):
    """``Qwen3VLProcessor`` without torchvision: PIL images, numpy videos (sized within the
    budget over all their frames, as transformers' ``Qwen3VLVideoProcessor``)."""

    VIDEOS = "video"

    TOKENS = {
        **WithoutTorchvision.TOKENS,
        "vision_start_token": VISION_START,
        "vision_end_token": VISION_END,
    }


# ----------------------------------------------------------------------------- runner
class Embedder(MRopeEmbedder):
    """The tower's deepstack features as prefill inputs; positions by
    ``Qwen3VLModel.get_rope_index``."""

    ROPE_MODEL = Qwen3VLModel

    def _tower(self, pixels: torch.Tensor, grid: torch.Tensor) -> Any:
        embeds, deepstack = self.model.visual(pixels, grid_thw=grid.view(1, 3))
        return (embeds, torch.stack(deepstack)) if deepstack else embeds

    def prefill_inputs(self, state: Any, start: int, end: int) -> dict[str, torch.Tensor]:
        inputs = super().prefill_inputs(state, start, end)
        side = self.side_features(state.req_id)
        if side is not None:  # a prompt with images: their deepstack features, this chunk's
            mask, deepstack = side
            inputs["visual_pos_mask"] = mask[None, start:end]
            inputs["deepstack_embeds"] = deepstack[:, start:end]
        return inputs


# ----------------------------------------------------------------------------- vLLM
class Qwen3VLProcessingInfo(QwenVLProcessingInfo):
    CONFIG = Qwen3VLConfig
    PROCESSOR = Qwen3VLPilProcessor


@MULTIMODAL_REGISTRY.register_processor(
    QwenVLMultiModalProcessor, info=Qwen3VLProcessingInfo, dummy_inputs=QwenVLDummyInputs
)
class RBLNQwen3VLDeclaration(MRopeDeclaration):
    """``Qwen3VLForConditionalGeneration`` as vLLM's registry and front end see it on RBLN."""

    EMBEDDER = Embedder


# ----------------------------------------------------------------------------- family code
class Qwen3VL(QwenVLCode):
    """Qwen3-VL's contract; Qwen3-VL-MoE and Qwen3.5 subclass it (the same tower, processor
    and tiny vision recipe)."""

    PROCESSOR = Qwen3VLPilProcessor
    Embedder = Embedder
    SPEC_DEFAULTS = {"max_pixels": TINY_MAX_PIXELS}

    @staticmethod
    def tiny_vision(spec: Any) -> dict[str, Any]:
        """A tiny Qwen3-VL tower: 16-pixel patches, learned position embeddings on an 8 x 8
        grid (interpolated to the image's), deepstack features from every layer the language
        model has room for (one per decoder layer at most)."""
        return dict(
            depth=spec.vision_layers,
            hidden_size=spec.vision_hidden_size,
            intermediate_size=2 * spec.vision_hidden_size,
            num_heads=spec.vision_heads,
            out_hidden_size=spec.language.hidden_size,  # the merger's output: the LM's embeddings
            patch_size=PATCH,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=64,  # a square: the tower interpolates an 8 x 8 grid
            deepstack_visual_indexes=list(range(min(spec.vision_layers, spec.language.num_layers))),
            initializer_range=spec.language.initializer_range,
        )

    def tiny_processor(self, spec: Any, tokenizer: Any, image_processor: Any = None) -> Any:
        """The processor over the PIL Qwen2-VL image processor with Qwen3-VL's 16-pixel patches
        (the spec's ``patch_size`` is LLaVA's and Qwen2-VL's)."""
        image_processor = image_processor or self.tiny_image_processor(spec, PATCH, MIN_PIXELS)
        return super().tiny_processor(spec, tokenizer, image_processor)

    def tiny_model(self, spec: Any, tokenizer: Any) -> tuple[Any, Any]:
        """Qwen3-VL's recipe at the spec's shape: a ViT over 16-pixel patches with learned and
        rotary positions and deepstack features, 2 x 2 patches merged per token, a Qwen3
        language model (q/k norms) with interleaved M-RoPE."""
        import transformers

        config = transformers.Qwen3VLConfig(
            text_config=interleaved_mrope_text(spec, tokenizer),
            vision_config=self.tiny_vision(spec),
            tie_word_embeddings=False,
            **self.token_ids(tokenizer),
        )
        model = transformers.Qwen3VLForConditionalGeneration(config)
        return model, self.tiny_processor(spec, tokenizer)


CODE = Qwen3VL()
