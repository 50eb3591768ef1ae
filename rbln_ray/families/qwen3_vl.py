"""Qwen3-VL on RBLN: Qwen2-VL's path (:mod:`.qwen2_vl`) with deepstack features and
interleaved M-RoPE.

What differs from Qwen2-VL, and why:

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

from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3VLConfig, Qwen3VLProcessor
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel
from vllm.multimodal import MULTIMODAL_REGISTRY

from rbln_ray.families import qwen2_vl
from rbln_ray.families.qwen2_vl import (
    VISION_END,
    VISION_START,
    Qwen2VLDummyInputs,
    Qwen2VLMultiModalProcessor,
    Qwen2VLProcessingInfo,
    RBLNQwen2VLDeclaration,
    WithoutTorchvision,
)

PLACEHOLDER, SPECIAL_TOKENS = qwen2_vl.PLACEHOLDER, qwen2_vl.SPECIAL_TOKENS
VIDEO_PLACEHOLDER = qwen2_vl.VIDEO_PLACEHOLDER
# Qwen3-VL's patches are 16 pixels, merged 2 x 2 into one token of 32 x 32 pixels; the tiny
# model's budget is 64 tokens (256 patches) an image, its minimum 2 x 2 tokens.
PATCH = 16
TINY_MAX_PIXELS = (2 * PATCH) ** 2 * 64
MIN_PIXELS = (4 * PATCH) ** 2
SPEC_DEFAULTS = {"max_pixels": TINY_MAX_PIXELS}
# The compiled tower's length: the image processor's budget in patches (no windows)
vision_rbln_config = qwen2_vl.vision_rbln_config


class Qwen3VLPilProcessor(WithoutTorchvision, Qwen3VLProcessor):
    """``Qwen3VLProcessor`` without torchvision: PIL images, numpy videos (sized within the
    budget over all their frames, as transformers' ``Qwen3VLVideoProcessor``)."""

    VIDEOS = "video"

    TOKENS = {
        **WithoutTorchvision.TOKENS,
        "vision_start_token": VISION_START,
        "vision_end_token": VISION_END,
    }


def load_processor(model_dir: str | Path, **kwargs: Any) -> Qwen3VLPilProcessor:
    return Qwen3VLPilProcessor.from_pretrained(str(model_dir), **kwargs)


def after_compile(hf_dir: str | Path, out: Path) -> None:
    """Save the image-only processor with the artifact (optimum saves only what
    ``AutoProcessor`` loads, which needs torchvision here)."""
    load_processor(hf_dir).save_pretrained(out)


# ----------------------------------------------------------------------------- runner
class Embedder(qwen2_vl.Embedder):
    """Qwen2-VL's embedder with the tower's deepstack features as prefill inputs."""

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
class Qwen3VLProcessingInfo(Qwen2VLProcessingInfo):
    CONFIG = Qwen3VLConfig
    PROCESSOR = Qwen3VLPilProcessor


@MULTIMODAL_REGISTRY.register_processor(
    Qwen2VLMultiModalProcessor, info=Qwen3VLProcessingInfo, dummy_inputs=Qwen2VLDummyInputs
)
class RBLNQwen3VLDeclaration(RBLNQwen2VLDeclaration):
    """``Qwen3VLForConditionalGeneration`` as vLLM's registry and front end see it on RBLN
    (vLLM 0.30's own ``qwen3_vl`` imports torchvision through ``qwen2_vl``)."""

    EMBEDDER = Embedder


# ----------------------------------------------------------------------------- tiny model
def tiny_text(spec: Any, tokenizer: Any) -> dict[str, Any]:
    """A tiny Qwen3 language model's config with interleaved M-RoPE (Qwen3-VL's sections
    [24, 20, 20] of 64 rotary pairs, scaled to the head)."""
    language = spec.language
    head_dim = language.hidden_size // language.num_heads
    pairs = head_dim // 2
    temporal = pairs - 2 * (pairs * 20 // 64)
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=language.hidden_size,
        intermediate_size=language.intermediate_size,
        num_hidden_layers=language.num_layers,
        num_attention_heads=language.num_heads,
        num_key_value_heads=language.num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=language.max_position_embeddings,
        initializer_range=language.initializer_range,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [temporal, (pairs - temporal) // 2, (pairs - temporal) // 2],
            "mrope_interleaved": True,
        },
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def tiny_vision(spec: Any) -> dict[str, Any]:
    """A tiny Qwen3-VL tower: 16-pixel patches, learned position embeddings on an 8 x 8 grid
    (interpolated to the image's), deepstack features from every layer the language model
    has room for (one per decoder layer at most)."""
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


def tiny_processor(spec: Any, tokenizer: Any, cls: type = Qwen3VLPilProcessor) -> Any:
    """The image-only processor over transformers' PIL Qwen2-VL image processor with
    Qwen3-VL's 16-pixel patches (the spec's ``patch_size`` is LLaVA's and Qwen2-VL's)."""
    import transformers

    image_processor = transformers.Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS,
        max_pixels=spec.max_pixels,
        patch_size=PATCH,
        merge_size=2,
        temporal_patch_size=2,
    )
    return cls(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )


def tiny_model(spec: Any, tokenizer: Any) -> tuple[Any, Any]:
    """Qwen3-VL's recipe at the spec's shape: a ViT over 16-pixel patches with learned and
    rotary positions and deepstack features, 2 x 2 patches merged per token, a Qwen3 language
    model (q/k norms) with interleaved M-RoPE."""
    import transformers

    config = transformers.Qwen3VLConfig(
        text_config=tiny_text(spec, tokenizer),
        vision_config=tiny_vision(spec),
        tie_word_embeddings=False,
        **qwen2_vl.token_ids(tokenizer),
    )
    model = transformers.Qwen3VLForConditionalGeneration(config)
    return model, tiny_processor(spec, tokenizer)
