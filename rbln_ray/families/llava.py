"""LLaVA-1.5 on RBLN: a CLIP vision tower whose second-to-last layer's patch features (CLS
dropped) go through a 2-layer MLP projector into a Llama language model, one fixed number of
tokens per image whatever its size (the processor resizes and crops).

Why rbln-ray declares it to vLLM itself: vLLM 0.30's ``llava`` module imports ``pixtral``,
whose transformers image processor needs torchvision (the project venv has none), so the
processor below and :class:`RBLNLlavaDeclaration` take its place (:mod:`.vision_base`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import BatchFeature, LlavaConfig, LlavaProcessor
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems
from vllm.multimodal.parse import ImageProcessorItems, MultiModalDataItems
from vllm.multimodal.processing import (
    BaseMultiModalProcessor,
    PromptReplacement,
    PromptUpdate,
)

from rbln_ray.families.contract import VisionCode
from rbln_ray.families.image_frontend import ImageDummyInputs, ImageProcessingInfo
from rbln_ray.families.vision_base import (
    Declaration,
    PromptEmbedder,
    one_image,
    tiny_text_config,
    tiny_vision_kwargs,
)

PLACEHOLDER = "<image>"  # what one image is in a prompt (and in the chat template)
SPECIAL_TOKENS = [PLACEHOLDER]


class LlavaProcessingInfo(ImageProcessingInfo):
    """LLaVA-1.5: a CLIP tower; one feature vector per image patch (plus CLS with the
    ``full`` feature strategy), whatever the input size (the processor resizes and crops)."""

    CONFIG, PROCESSOR = LlavaConfig, LlavaProcessor

    def tokens_per_image(self) -> int:
        config = self.get_hf_config()
        patches = (config.vision_config.image_size // config.vision_config.patch_size) ** 2
        return patches + (config.vision_feature_select_strategy == "full")


class LlavaMultiModalProcessor(BaseMultiModalProcessor[LlavaProcessingInfo]):
    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        return {"pixel_values": MultiModalFieldConfig.batched("image")}

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargsItems,
    ) -> Sequence[PromptUpdate]:
        image_token = self.info.get_hf_config().image_token_index
        mm_items.get_items("image", ImageProcessorItems)  # pixels only, no precomputed embeds
        replacement = [image_token] * self.info.tokens_per_image()
        return [PromptReplacement(modality="image", target=[image_token], replacement=replacement)]


class Embedder(PromptEmbedder):
    """Image features from ``get_image_features`` (the compiled CLIP tower and projector)."""

    def _image_features(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        pixels = one_image(data["pixel_values"])
        config = self.model.config
        return self.model.get_image_features(
            pixel_values=pixels,
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
        )


@MULTIMODAL_REGISTRY.register_processor(
    LlavaMultiModalProcessor, info=LlavaProcessingInfo, dummy_inputs=ImageDummyInputs
)
class RBLNLlavaDeclaration(Declaration, SupportsMultiModal):
    """``LlavaForConditionalGeneration`` as vLLM's registry and front end see it on RBLN."""

    PLACEHOLDERS = {"image": PLACEHOLDER}


# ----------------------------------------------------------------------------- family code
class Llava(VisionCode):
    """LLaVA-1.5's contract: AutoProcessor loads its processor, optimum's tower defaults."""

    PLACEHOLDER = PLACEHOLDER
    SPECIAL_TOKENS = SPECIAL_TOKENS
    Embedder = Embedder

    def tiny_model(self, spec: Any, tokenizer: Any) -> tuple[Any, Any]:
        """LLaVA-1.5's recipe at the spec's shape: CLIP tower, features of the second-to-last
        layer without the CLS position, a GELU MLP projector, a Llama language model."""
        import transformers

        image_token_id = tokenizer.convert_tokens_to_ids(PLACEHOLDER)
        vision = transformers.CLIPVisionConfig(
            **tiny_vision_kwargs(spec),
            projection_dim=spec.vision_hidden_size,
            initializer_range=spec.language.initializer_range,
        )
        text = tiny_text_config(spec, tokenizer)
        config = transformers.LlavaConfig(
            vision_config=vision,
            text_config=text,
            image_token_index=image_token_id,
            vision_feature_select_strategy="default",
            vision_feature_layer=-2,
            image_seq_length=spec.image_tokens,
            projector_hidden_act="gelu",
            tie_word_embeddings=False,
        )
        image_processor = transformers.CLIPImageProcessorPil(
            size={"shortest_edge": spec.image_size},
            crop_size={"height": spec.image_size, "width": spec.image_size},
        )
        processor = transformers.LlavaProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=spec.patch_size,
            vision_feature_select_strategy="default",
            chat_template=tokenizer.chat_template,
            image_token=PLACEHOLDER,
            num_additional_image_tokens=1,  # CLIP's CLS position, dropped by "default"
        )
        return transformers.LlavaForConditionalGeneration(config), processor


CODE = Llava()
