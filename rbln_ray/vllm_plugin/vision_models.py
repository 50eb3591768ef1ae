"""vLLM's view of the vision-language architectures rbln-ray serves: their multimodal
processors and the model declarations vLLM's registry inspects.

Why rbln-ray declares them itself: on RBLN a vision-language model runs through optimum-rbln
(:mod:`rbln_ray.vllm_plugin.image_inputs`), so vLLM only needs, for each architecture, what
its front end uses: the multimodal processor (the HF processor's pixels, one placeholder token
per image feature vector, dummy inputs for vLLM's encoder budget) and a class that declares
multimodal support. vLLM 0.30's own ``llava`` and ``qwen2_vl`` modules cannot even be
imported beside transformers 5.15 without torchvision (``llava`` imports ``pixtral``, whose
transformers image processor needs torchvision; ``qwen2_vl`` imports transformers' torchvision
Qwen2-VL image processor; the project venv has none, see README), so the declarations below
are registered in their place through vLLM's public ``ModelRegistry.register_model``
(:func:`rbln_ray.vllm_plugin.register_models`, a ``vllm.general_plugins`` entry point). The
RBLN worker never runs them: it loads optimum-rbln's model instead.

Qwen2-VL differs from LLaVA in three ways vLLM sees: an image is as many tokens as its
resized size gives (one per 2 x 2 patches), so the placeholder count comes from each image's
``image_grid_thw``; the pixels of an image are its flattened patches (``flat_from_sizes``);
and the model declares M-RoPE (``SupportsMRoPE``: :mod:`.mrope`), whose positions need every
image's grid even when the prefix cache covers the image, so ``image_grid_thw`` stays on the
CPU (``keep_on_cpu``; vLLM then keeps it when it drops covered pixels). An image with more
patches than the compiled vision tower takes is refused here, before it reaches the engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

import torch
from torch import nn
from transformers import BatchFeature, LlavaConfig, LlavaProcessor, Qwen2VLConfig
from vllm.config.multimodal import BaseDummyOptions
from vllm.inputs import MultiModalDataDict
from vllm.model_executor.models.interfaces import SupportsMRoPE, SupportsMultiModal
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import (
    MultiModalFeatureSpec,
    MultiModalFieldConfig,
    MultiModalKwargsItems,
)
from vllm.multimodal.parse import ImageProcessorItems, MultiModalDataItems
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
)

from rbln_ray.compile.qwen2_vl_processor import Qwen2VLImageProcessorOnly
from rbln_ray.compile.vision import vision_max_patches
from rbln_ray.vllm_plugin.mrope import image_grids, mrope_positions


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


class _Declaration(nn.Module):
    """What vLLM's model interface asks of a declaration, none of which runs on RBLN."""

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


@MULTIMODAL_REGISTRY.register_processor(
    LlavaMultiModalProcessor, info=LlavaProcessingInfo, dummy_inputs=LlavaDummyInputs
)
class RBLNLlavaDeclaration(_Declaration, SupportsMultiModal):
    """``LlavaForConditionalGeneration`` as vLLM's registry and front end see it on RBLN."""

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality.startswith("image"):
            return "<image>"
        raise ValueError("only image inputs are supported")

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        _not_on_rbln()


# ----------------------------------------------------------------------------- Qwen2-VL
class Qwen2VLProcessingInfo(BaseProcessingInfo):
    """Qwen2-VL: images resized to multiples of ``patch_size x merge_size`` within the
    processor's pixel budget; one token per ``merge_size^2`` patches."""

    def get_hf_config(self) -> Qwen2VLConfig:
        return self.ctx.get_hf_config(Qwen2VLConfig)

    def get_hf_processor(self, **kwargs: object) -> Qwen2VLImageProcessorOnly:
        return self.ctx.get_hf_processor(Qwen2VLImageProcessorOnly, **kwargs)

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None}

    def merge_size(self) -> int:
        return self.get_hf_config().vision_config.spatial_merge_size

    def max_patches(self) -> int:
        """Patches the compiled vision tower takes per image (its ``max_seq_len``)."""
        return _compiled_max_patches(self.ctx.model_config.model)

    def largest_image(self) -> tuple[int, int, int]:
        """``(width, height, tokens)`` of the image with the most tokens served: as many as
        the processor's pixel budget makes and the compiled tower takes (a larger image is
        refused), factored into the squarest grid of merged patches (vLLM's own Qwen2-VL does
        the same; a square image of the budget would round down)."""
        processor = self.get_hf_processor().image_processor
        merge = processor.merge_size
        unit = processor.patch_size * merge
        most = min(processor.size["longest_edge"] // (unit * unit), self.max_patches() // merge**2)
        rows = next(d for d in range(math.isqrt(most), 0, -1) if most % d == 0)
        return unit * (most // rows), unit * rows, most

    def get_mm_max_tokens_per_item(
        self, seq_len: int, mm_counts: Mapping[str, int]
    ) -> Mapping[str, int]:
        return {"image": self.largest_image()[2]}


@cache
def _compiled_max_patches(model: str) -> int:
    patches = vision_max_patches(model)
    if patches is None:
        raise ValueError(f"{model} has no vision tower with a patch budget")
    return patches


class Qwen2VLDummyInputs(BaseDummyInputsBuilder[Qwen2VLProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return self.info.get_hf_processor().image_token * mm_counts.get("image", 0)

    def get_dummy_mm_data(
        self,
        seq_len: int,
        mm_counts: Mapping[str, int],
        mm_options: Mapping[str, BaseDummyOptions],
    ) -> MultiModalDataDict:
        width, height, _ = self.info.largest_image()
        images = self._get_dummy_images(
            width=width,
            height=height,
            num_images=mm_counts.get("image", 0),
            overrides=mm_options.get("image"),
        )
        return {"image": images}


class Qwen2VLMultiModalProcessor(BaseMultiModalProcessor[Qwen2VLProcessingInfo]):
    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        grids = hf_inputs.get("image_grid_thw", torch.empty((0, 3)))
        return {
            "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", grids.prod(-1)),
            "image_grid_thw": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
        }

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargsItems,
    ) -> Sequence[PromptUpdate]:
        image_token = self.info.get_hf_config().image_token_id
        merge = self.info.merge_size()
        mm_items.get_items("image", ImageProcessorItems)  # pixels only, no precomputed embeds

        def replacement(i: int) -> list[int]:
            t, h, w = (int(x) for x in out_mm_kwargs["image"][i]["image_grid_thw"].data)
            patches, most = t * h * w, self.info.max_patches()
            if patches > most:
                # optimum's vision tower would raise inside the engine; refuse the request here
                raise ValueError(
                    f"image {i} is {patches} patches ({h} x {w} of {t} frame(s) after "
                    f"resizing), more than the {most} patches per image the compiled vision "
                    "tower takes; send a smaller image or lower max_pixels"
                )
            return [image_token] * (patches // (merge * merge))

        return [PromptReplacement(modality="image", target=[image_token], replacement=replacement)]


@MULTIMODAL_REGISTRY.register_processor(
    Qwen2VLMultiModalProcessor, info=Qwen2VLProcessingInfo, dummy_inputs=Qwen2VLDummyInputs
)
class RBLNQwen2VLDeclaration(_Declaration, SupportsMultiModal, SupportsMRoPE):
    """``Qwen2VLForConditionalGeneration`` as vLLM's registry and front end see it on RBLN.

    Constructible (it holds the HF config only) so that its M-RoPE contract,
    :meth:`get_mrope_input_positions`, is vLLM's own interface; the RBLN runner computes the
    same positions with the same function (:mod:`rbln_ray.vllm_plugin.qwen2_vl_inputs`).
    """

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config: Qwen2VLConfig = vllm_config.model_config.hf_config

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality.startswith("image"):
            return "<|vision_start|><|image_pad|><|vision_end|>"
        raise ValueError("only image inputs are supported")

    def get_mrope_input_positions(
        self, input_tokens: list[int], mm_features: list[MultiModalFeatureSpec]
    ) -> tuple[torch.Tensor, int]:
        merge = self.config.vision_config.spatial_merge_size
        return mrope_positions(len(input_tokens), image_grids(mm_features), merge)
