"""LLaVA-NeXT (LLaVA-1.6) on RBLN: LLaVA's CLIP tower and projector over several tiles of an
image ("any resolution"), so an image is as many tokens as its size and aspect ratio make.

What differs from LLaVA (:mod:`.llava`):

* **Tiles.** The processor resizes the image to the grid pinpoint (``image_grid_pinpoints``)
  that fits it best, cuts it into tower-sized tiles and adds the whole image resized to one
  tile (the base). optimum-rbln runs the compiled tower and projector tile by tile
  (``get_image_features``, trimming the padding tiles a batch of images adds from
  ``image_sizes``) and ``pack_image_features`` lays the tiles' features out as the image's
  grid with the padding of the aspect ratio cut off and a learned ``image_newline`` vector
  after each row, the base tile's features first.
* **Tokens per image** (:func:`num_image_tokens`): base tile + unpadded grid + one newline per
  row; the same count transformers' ``LlavaNextProcessor`` expands ``<image>`` to (its
  formula, on the public ``get_anyres_image_grid_shape``; vLLM 0.30's own LLaVA-NeXT computes
  it alike). The test compares the prompt ids vLLM makes with the HF processor's.
* **vLLM's view.** vLLM 0.30's ``llava_next`` module imports ``llava``, which imports
  ``pixtral`` and with it torchvision, so the processor below and
  :class:`RBLNLlavaNextDeclaration` take its place, as for LLaVA.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import BatchFeature, LlavaNextConfig, LlavaNextProcessor
from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape
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
    tiny_text_config,
    tiny_vision_kwargs,
)

PLACEHOLDER = "<image>"  # what one image is in a prompt (and in the chat template)
SPECIAL_TOKENS = [PLACEHOLDER]


def num_image_tokens(config: LlavaNextConfig, width: int, height: int) -> int:
    """Feature vectors (and so placeholder tokens) of a ``width`` x ``height`` image: the base
    tile's patches (plus CLS with the ``full`` strategy), the best pinpoint's grid of tiles
    with the aspect ratio's padding rows or columns removed, and one newline per grid row
    (transformers' ``LlavaNextProcessor._get_number_of_features``)."""
    vision = config.vision_config
    side = vision.image_size // vision.patch_size  # patches along a tile's edge
    base = side * side + (config.vision_feature_select_strategy == "full")
    rows, cols = get_anyres_image_grid_shape(
        (height, width), config.image_grid_pinpoints, vision.image_size
    )
    grid_h, grid_w = side * rows, side * cols
    if width / height > grid_w / grid_h:  # wider than the grid: padding rows above and below
        grid_h -= 2 * ((grid_h - int(round(height * (grid_w / width), 7))) // 2)
    else:  # padding columns left and right
        grid_w -= 2 * ((grid_w - int(round(width * (grid_h / height), 7))) // 2)
    return base + grid_h * grid_w + grid_h


# ----------------------------------------------------------------------------- vLLM
class LlavaNextProcessingInfo(ImageProcessingInfo):
    """LLaVA-NeXT: an image's tokens depend on its size (:func:`num_image_tokens`)."""

    CONFIG, PROCESSOR = LlavaNextConfig, LlavaNextProcessor

    def tokens(self, width: int, height: int) -> int:
        return num_image_tokens(self.get_hf_config(), width, height)

    def largest_image(self) -> tuple[int, int, int]:
        """``(width, height, tokens)`` of the grid pinpoint with the most tokens."""
        return max(
            ((w, h, self.tokens(w, h)) for h, w in self.get_hf_config().image_grid_pinpoints),
            key=lambda size: size[2],
        )

    def get_mm_max_tokens_per_item(
        self, seq_len: int, mm_counts: Mapping[str, int]
    ) -> Mapping[str, int]:
        return {"image": self.largest_image()[2]}

    def dummy_image_size(self) -> tuple[int, int]:
        width, height, _ = self.largest_image()
        return width, height


class LlavaNextMultiModalProcessor(BaseMultiModalProcessor[LlavaNextProcessingInfo]):
    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        # pixel_values: [tiles (padded to the call's most), C, H, W] per image; image_sizes
        # (height, width) tells optimum how many of them are real
        return {
            "pixel_values": MultiModalFieldConfig.batched("image"),
            "image_sizes": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
        }

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargsItems,
    ) -> Sequence[PromptUpdate]:
        image_token = self.info.get_hf_config().image_token_index
        images = mm_items.get_items("image", ImageProcessorItems)  # pixels only

        def replacement(i: int) -> list[int]:
            size = images.get_image_size(i)
            return [image_token] * self.info.tokens(size.width, size.height)

        return [PromptReplacement(modality="image", target=[image_token], replacement=replacement)]


@MULTIMODAL_REGISTRY.register_processor(
    LlavaNextMultiModalProcessor,
    info=LlavaNextProcessingInfo,
    dummy_inputs=ImageDummyInputs,
)
class RBLNLlavaNextDeclaration(Declaration, SupportsMultiModal):
    """``LlavaNextForConditionalGeneration`` as vLLM's registry and front end see it on
    RBLN."""

    PLACEHOLDERS = {"image": PLACEHOLDER}


# ----------------------------------------------------------------------------- runner
class Embedder(PromptEmbedder):
    """Image features: the compiled tower and projector per tile (``get_image_features``),
    laid out as the image's grid with row newlines (``pack_image_features``)."""

    def _image_features(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        pixels = data["pixel_values"]  # [tiles, C, H, W] of one image
        sizes = data["image_sizes"].view(1, 2)
        config = self.model.config
        strategy = config.vision_feature_select_strategy
        tiles = self.model.get_image_features(
            pixels.unsqueeze(0),
            sizes,
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=strategy,
        )
        features, _ = self.model.pack_image_features(
            tiles, sizes, strategy, image_newline=self.model.image_newline
        )
        return features


# ----------------------------------------------------------------------------- family code
class LlavaNext(VisionCode):
    """LLaVA-NeXT's contract: AutoProcessor loads its processor, optimum's tower defaults."""

    PLACEHOLDER = PLACEHOLDER
    SPECIAL_TOKENS = SPECIAL_TOKENS
    Embedder = Embedder

    def tiny_model(self, spec: Any, tokenizer: Any) -> tuple[Any, Any]:
        """LLaVA-NeXT's recipe at the spec's shape: LLaVA's (CLIP tower, second-to-last layer
        without CLS, GELU MLP projector, Llama LM) over tiles of ``image_size`` pixels, with grid
        pinpoints of 1 x 2, 2 x 1 and 2 x 2 tiles and a learned row newline."""
        import transformers

        side = spec.image_size
        pinpoints = [[side, 2 * side], [2 * side, side], [2 * side, 2 * side]]
        vision = transformers.CLIPVisionConfig(
            **tiny_vision_kwargs(spec),
            projection_dim=spec.vision_hidden_size,
            initializer_range=spec.language.initializer_range,
        )
        text = tiny_text_config(spec, tokenizer)
        config = transformers.LlavaNextConfig(
            vision_config=vision,
            text_config=text,
            image_token_index=tokenizer.convert_tokens_to_ids(PLACEHOLDER),
            vision_feature_select_strategy="default",
            vision_feature_layer=-2,
            image_grid_pinpoints=pinpoints,
            image_seq_length=spec.image_tokens,
            projector_hidden_act="gelu",
            tie_word_embeddings=False,
        )
        image_processor = transformers.LlavaNextImageProcessorPil(
            size={"shortest_edge": side},
            crop_size={"height": side, "width": side},
            image_grid_pinpoints=pinpoints,
        )
        processor = transformers.LlavaNextProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=spec.patch_size,
            vision_feature_select_strategy="default",
            chat_template=tokenizer.chat_template,
            image_token=PLACEHOLDER,
            num_additional_image_tokens=1,  # CLIP's CLS position, dropped by "default"
        )
        model = transformers.LlavaNextForConditionalGeneration(config)
        return model, processor


CODE = LlavaNext()
