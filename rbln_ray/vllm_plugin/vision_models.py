"""vLLM's view of the vision-language architectures rbln-ray serves: their multimodal
processors and the model declarations vLLM's registry inspects.

Why rbln-ray declares them itself: on RBLN a vision-language model runs through optimum-rbln
(:mod:`rbln_ray.vllm_plugin.image_inputs`), so vLLM only needs, for each architecture, what
its front end uses: the multimodal processor (the HF processor's pixels, one placeholder token
per image feature vector, dummy inputs for vLLM's encoder budget) and a class that declares
multimodal support. vLLM 0.30's own ``llava`` module cannot even be imported beside
transformers 5.15 without torchvision (it imports ``pixtral``, whose transformers image
processor needs torchvision; the project venv has none, see README), so the declarations
below are registered in its place through vLLM's public ``ModelRegistry.register_model``
(:func:`rbln_ray.vllm_plugin.register_models`, a ``vllm.general_plugins`` entry point). The
classes are never instantiated: the RBLN worker loads optimum-rbln's model instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers import BatchFeature, LlavaConfig, LlavaProcessor
from vllm.config.multimodal import BaseDummyOptions
from vllm.inputs import MultiModalDataDict
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems
from vllm.multimodal.parse import ImageProcessorItems, MultiModalDataItems
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
)


class LlavaProcessingInfo(BaseProcessingInfo):
    """LLaVA-1.5: a CLIP tower; one feature vector per image patch (plus CLS with the
    ``full`` feature strategy), whatever the input size (the processor resizes and crops)."""

    def get_hf_config(self) -> LlavaConfig:
        return self.ctx.get_hf_config(LlavaConfig)

    def get_hf_processor(self, **kwargs: object) -> LlavaProcessor:
        return self.ctx.get_hf_processor(LlavaProcessor, **kwargs)

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None}

    def image_size(self) -> int:
        return self.get_hf_config().vision_config.image_size

    def tokens_per_image(self) -> int:
        config = self.get_hf_config()
        patches = (config.vision_config.image_size // config.vision_config.patch_size) ** 2
        return patches + (config.vision_feature_select_strategy == "full")


class LlavaDummyInputs(BaseDummyInputsBuilder[LlavaProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return self.info.get_hf_processor().image_token * mm_counts.get("image", 0)

    def get_dummy_mm_data(
        self,
        seq_len: int,
        mm_counts: Mapping[str, int],
        mm_options: Mapping[str, BaseDummyOptions],
    ) -> MultiModalDataDict:
        size = self.info.image_size()
        images = self._get_dummy_images(
            width=size,
            height=size,
            num_images=mm_counts.get("image", 0),
            overrides=mm_options.get("image"),
        )
        return {"image": images}


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


def _not_on_rbln(*_: Any, **__: Any) -> Any:
    raise RuntimeError(
        "rbln-ray's vision-language declarations are never run: the RBLN worker serves the "
        "model through optimum-rbln"
    )


@MULTIMODAL_REGISTRY.register_processor(
    LlavaMultiModalProcessor, info=LlavaProcessingInfo, dummy_inputs=LlavaDummyInputs
)
class RBLNLlavaDeclaration(nn.Module, SupportsMultiModal):
    """``LlavaForConditionalGeneration`` as vLLM's registry and front end see it on RBLN."""

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality.startswith("image"):
            return "<image>"
        raise ValueError("only image inputs are supported")

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        _not_on_rbln()

    def embed_input_ids(self, input_ids: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        return _not_on_rbln()

    def embed_multimodal(self, **kwargs: object) -> Any:
        return _not_on_rbln()

    def get_language_model(self) -> nn.Module:
        return _not_on_rbln()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, **kw: Any) -> Any:
        return _not_on_rbln()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _not_on_rbln()
