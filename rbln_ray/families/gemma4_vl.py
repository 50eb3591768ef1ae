"""Gemma 4 with images on RBLN (``gemma4_vl``; ``gemma4`` is the text-only decoder family): a
Gemma 4 vision tower (patches with 2-D positions, pooled ``pooling_kernel_size``² to one soft
token), a projector, and the Gemma 4 language model (sliding-window and full layers, per-layer
inputs, embeddings on the host).

What differs from Gemma3 (:mod:`.gemma3_vl`), and why:

* **Causal prefill.** optimum-rbln 0.12 prefills a Gemma 4 image prompt through its
  ``image_prefill`` graphs, which attend bidirectionally within an image on *every* layer, and
  computes the per-layer inputs from the raw ids (the image token at image positions).
  transformers 5.15 attends causally on every layer when ``use_bidirectional_attention`` is
  unset (and bidirectionally on the sliding layers only with ``"vision"``), and computes the
  per-layer inputs with the pad token at image positions. ``optimum generate`` therefore gives
  other tokens than transformers (``test_optimums_own_image_prefill_differs_from_transformers``).
  rbln-ray prefills every prompt through the causal ``prefill`` graph instead and passes the
  per-layer inputs itself (:meth:`Embedder.prefill_inputs`): token-exact for checkpoints without
  ``use_bidirectional_attention``. One with ``"vision"`` or ``"all"`` cannot be served exactly by
  any graph optimum 0.12 compiles (the causal one is wrong on the sliding layers, the
  bidirectional one on the full layers): it is refused at compile and at engine start
  (:func:`refusals`), as are the text family's refusals (KV sharing, experts).
* **Whole-prompt prefill.** As the text family's: no chunked prefill, no prefix caching.
* **Variable image length.** The image processor resizes each image (aspect ratio kept) to at
  most ``max_soft_tokens`` × ``pooling_kernel_size``² patches and pads the rest; an image is
  as many soft tokens as it has whole pooling windows. The vision tower is compiled for the
  processor's ``max_soft_tokens`` (:meth:`Gemma4VL.vision_rbln_config`).
* **vLLM's view.** vLLM 0.30's ``gemma4_mm`` and transformers' ``Gemma4Processor`` import
  transformers' torchvision image processor at module level, so :class:`Gemma4PilProcessor`
  (images only, over transformers' ``Gemma4ImageProcessorPil``), the processor below and
  :class:`RBLNGemma4Declaration` take their place. Audio and video are not served.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch
from transformers import BatchFeature, Gemma4Config
from transformers.processing_utils import ProcessorMixin
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems
from vllm.multimodal.parse import ImageProcessorItems, MultiModalDataItems
from vllm.multimodal.processing import (
    BaseMultiModalProcessor,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
)

from rbln_ray.common.artifact_files import HF_CONFIG, RBLN_CONFIG
from rbln_ray.families.contract import VisionCode
from rbln_ray.families.image_frontend import ImageDummyInputs, ImageProcessingInfo
from rbln_ray.families.registry import DECODERS
from rbln_ray.families.vision_base import (
    Declaration,
    PromptEmbedder,
    image_processor_settings,
    tiny_text_config,
)

# Gemma 4's image tokens: the chat template renders one image as IMAGE_TOKEN, which the
# processor expands to BOI + one IMAGE_TOKEN per soft token + EOI.
BOI, IMAGE_TOKEN, EOI = "<|image>", "<|image|>", "<image|>"
PLACEHOLDER = IMAGE_TOKEN
NAMED_TOKENS = {"boi_token": BOI, "image_token": IMAGE_TOKEN, "eoi_token": EOI}
DEFAULT_MAX_SOFT_TOKENS = 280  # transformers' Gemma4ImageProcessorPil's
# The tiny model's image budget: the smallest the image processor allows.
TINY_MAX_SOFT_TOKENS = 70
BIDIRECTIONAL_REASON = (
    "optimum-rbln 0.12 compiles no Gemma 4 prefill that attends as transformers does with it "
    "('vision': bidirectionally within an image on the sliding layers only; 'all': every "
    "token bidirectionally): its image_prefill graphs attend bidirectionally within an image "
    "on every layer, its prefill graph causally"
)


def refusals(text_config: Mapping[str, Any]) -> list[str]:
    """Why a Gemma 4 vision-language model with this text config is not served (nothing:
    it is): the text family's refusals, and any bidirectional attention (module docstring)."""
    found = DECODERS["gemma4"].refusals(text_config)
    setting = text_config.get("use_bidirectional_attention")
    if setting:
        found.append(f"use_bidirectional_attention={setting!r} is refused: {BIDIRECTIONAL_REASON}")
    return found


def refuse(where: str | Path, text_config: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming every reason a model is not served."""
    found = refusals(text_config)
    if found:
        raise ValueError(f"{where}: Gemma 4 with images: {'; '.join(found)}")


@cache
def compiled_budgets(model_dir: str) -> tuple[int, ...]:
    """The image budgets (``max_soft_tokens``) a model's vision tower takes: its compiled ones,
    or (an HF directory, compiled on first use) what :meth:`Gemma4VL.vision_rbln_config`
    compiles it for. Read once per model directory: vLLM's processor asks per request."""
    compiled = Path(model_dir) / RBLN_CONFIG
    if compiled.is_file():
        budgets = json.loads(compiled.read_text())["vision_tower"]["max_soft_tokens"]
        return tuple(budgets) if isinstance(budgets, list) else (budgets,)
    return (CODE.vision_rbln_config(model_dir)["vision_tower"]["max_soft_tokens"],)


def soft_tokens(position_ids: torch.Tensor, pooling_kernel_size: int) -> int:
    """Soft tokens of one processed image (``image_position_ids`` ``[patches, 2]``, padding
    patches at ``-1``): its whole pooling windows, what the tower's pooler keeps."""
    real = int((~(position_ids == -1).all(dim=-1)).sum())
    return real // pooling_kernel_size**2


# ----------------------------------------------------------------------------- processor
class Gemma4PilProcessor(ProcessorMixin):
    """transformers' ``Gemma4Processor`` for images, without torchvision: the same prompt
    expansion (``replace_image_token``: BOI, one image token per soft token, EOI) over
    transformers' PIL image processor. Saved as ``Gemma4Processor`` (``to_dict``), so any
    transformers install reads what it saves."""

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        chat_template: Any = None,
        image_seq_length: int = DEFAULT_MAX_SOFT_TOKENS,
        **kwargs: Any,
    ) -> None:
        self.image_seq_length = image_seq_length
        self.boi_token = getattr(tokenizer, "boi_token", BOI)
        self.eoi_token = getattr(tokenizer, "eoi_token", EOI)
        self.image_token = getattr(tokenizer, "image_token", IMAGE_TOKEN)
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs: Any) -> str:
        count = int(image_inputs["num_soft_tokens_per_image"][image_idx])
        return f"{self.boi_token}{self.image_token * count}{self.eoi_token}"

    @property
    def unused_input_names(self) -> list[str]:
        return ["num_soft_tokens_per_image"]

    def to_dict(self) -> dict[str, Any]:
        config = super().to_dict()
        config["processor_class"] = "Gemma4Processor"
        return config


# ----------------------------------------------------------------------------- vLLM
class Gemma4ProcessingInfo(ImageProcessingInfo):
    """Gemma 4: each image as many soft tokens as the processor's resize gives it, at most
    ``max_soft_tokens``, framed by BOI and EOI."""

    CONFIG, PROCESSOR = Gemma4Config, Gemma4PilProcessor

    def get_mm_max_tokens_per_item(
        self, seq_len: int, mm_counts: Mapping[str, int]
    ) -> Mapping[str, int]:
        return {"image": self.get_hf_processor().image_processor.max_soft_tokens + 2}

    def image_placeholder(self) -> str:
        return PLACEHOLDER

    def dummy_image_size(self) -> tuple[int, int]:
        processor = self.get_hf_processor().image_processor
        side = processor.patch_size * processor.pooling_kernel_size  # grows to the budget
        return side, side


class Gemma4MultiModalProcessor(BaseMultiModalProcessor[Gemma4ProcessingInfo]):
    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        """Also refuses, before the engine sees it, an image processed for a budget the
        compiled tower does not take (a request's ``max_soft_tokens``): optimum's tower runs
        only the patch counts it was compiled for."""
        pixels = hf_inputs.get("pixel_values")
        if pixels is not None and len(pixels):
            kernel = self.info.get_hf_processor().image_processor.pooling_kernel_size
            budget = len(pixels[0]) // kernel**2
            compiled = compiled_budgets(self.info.ctx.model_config.model)
            if budget not in compiled:
                raise ValueError(
                    f"images processed for max_soft_tokens={budget}, but the compiled Gemma 4 "
                    f"vision tower takes max_soft_tokens {list(compiled)} only"
                )
        return {
            "pixel_values": MultiModalFieldConfig.batched("image"),
            "image_position_ids": MultiModalFieldConfig.batched("image"),
        }

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargsItems,
    ) -> Sequence[PromptUpdate]:
        config = self.info.get_hf_config()
        processor = self.info.get_hf_processor(**hf_processor_mm_kwargs)
        mm_items.get_items("image", ImageProcessorItems)  # pixels only, no precomputed embeds
        kernel = processor.image_processor.pooling_kernel_size

        def replacement(i: int) -> PromptUpdateDetails:
            positions = out_mm_kwargs["image"][i]["image_position_ids"].data
            count = soft_tokens(positions, kernel)
            ids = [config.boi_token_id, *[config.image_token_id] * count, config.eoi_token_id]
            return PromptUpdateDetails.select_token_id(ids, config.image_token_id)

        return [
            PromptReplacement(
                modality="image", target=[config.image_token_id], replacement=replacement
            )
        ]


@MULTIMODAL_REGISTRY.register_processor(
    Gemma4MultiModalProcessor, info=Gemma4ProcessingInfo, dummy_inputs=ImageDummyInputs
)
class RBLNGemma4Declaration(Declaration, SupportsMultiModal):
    """``Gemma4ForConditionalGeneration`` as vLLM's registry and front end see it on RBLN."""

    PLACEHOLDERS = {"image": PLACEHOLDER}


# ----------------------------------------------------------------------------- runner
class Embedder(PromptEmbedder):
    """Image features from ``get_image_features`` (the compiled tower and projector), and the
    per-layer inputs of a prompt with images, the pad token at its image positions (module
    docstring); refuses at engine start what :func:`refusals` names."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        refuse("Gemma4ForConditionalGeneration", model.config.text_config.to_dict())

    def _image_features(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        pixels, positions = data["pixel_values"], data["image_position_ids"]
        return self.model.get_image_features(
            pixels.unsqueeze(0) if pixels.dim() == 2 else pixels,
            positions.unsqueeze(0) if positions.dim() == 2 else positions,
        )

    def prefill_inputs(self, state: Any, start: int, end: int) -> dict[str, torch.Tensor]:
        if not self.has_images(state.mm_features):
            return {}  # text only: the runtime computes them from the token ids
        config = self.model.config
        ids = torch.tensor(state.prompt_token_ids[:end], dtype=torch.long)
        ids[ids == config.image_token_id] = config.text_config.pad_token_id
        per_layer = self.language_model.prefill_decoder.compute_per_layer_inputs(ids[None])
        return {"per_layer_inputs": per_layer[:, start:end]}


# ----------------------------------------------------------------------------- family code
class Gemma4VL(VisionCode):
    """Gemma 4's contract with images: its named tokens, its own processor, the tower
    compiled for the processor's image budget, and what it refuses."""

    PLACEHOLDER = PLACEHOLDER
    SPECIAL_TOKENS = [BOI, IMAGE_TOKEN, EOI]
    NAMED_TOKENS = NAMED_TOKENS
    PROCESSOR = Gemma4PilProcessor
    Embedder = Embedder

    def language_rbln_config(self, hf_dir: str | Path, language: dict[str, Any]) -> dict[str, Any]:
        """The attention mask the text family compiles with (optimum's Gemma 4 decoder requires
        it); refuses what :func:`refusals` names before optimum compiles it."""
        config = json.loads((Path(hf_dir) / HF_CONFIG).read_text())
        refuse(hf_dir, config.get("text_config") or {})
        return {"use_attention_mask": DECODERS["gemma4"].compile_extra["use_attention_mask"]}

    def vision_rbln_config(self, hf_dir: str | Path) -> dict[str, Any]:
        """The tower compiled for the image processor's ``max_soft_tokens`` (every image the
        processor makes pads to it)."""
        settings = image_processor_settings(hf_dir)
        budget = int(settings.get("max_soft_tokens", DEFAULT_MAX_SOFT_TOKENS))
        return {"vision_tower": {"max_soft_tokens": budget}}

    def tiny_model(self, spec: Any, tokenizer: Any) -> tuple[Any, Any]:
        """Gemma 4's recipe at the spec's shape: a Gemma 4 tower over ``patch_size`` patches
        pooled 3 × 3, an image budget of :data:`TINY_MAX_SOFT_TOKENS`, the text family's
        tiny language model; untied LM head (tied, the last token's embedding dominates the
        tiny model's logits and images hardly change its output)."""
        import transformers

        ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in NAMED_TOKENS.items()}
        init = spec.language.initializer_range
        vision = dict(
            model_type="gemma4_vision",
            hidden_size=spec.vision_hidden_size,
            intermediate_size=2 * spec.vision_hidden_size,
            num_hidden_layers=spec.vision_layers,
            num_attention_heads=spec.vision_heads,
            num_key_value_heads=spec.vision_heads,
            head_dim=spec.vision_hidden_size // spec.vision_heads,
            patch_size=spec.patch_size,
            position_embedding_size=256,
            default_output_length=TINY_MAX_SOFT_TOKENS,
            initializer_range=init,
        )
        config = transformers.Gemma4Config(
            text_config=tiny_text_config(spec, tokenizer).to_dict(),
            vision_config=vision,
            boi_token_id=ids["boi_token"],
            eoi_token_id=ids["eoi_token"],
            image_token_id=ids["image_token"],
            initializer_range=init,
            tie_word_embeddings=False,
        )
        model = transformers.Gemma4ForConditionalGeneration(config)
        # transformers initialises the patch position table to zeros: every patch would sit
        # at the same place
        with torch.no_grad():
            model.model.vision_tower.patch_embedder.position_embedding_table.normal_(std=init)
        image_processor = transformers.Gemma4ImageProcessorPil(
            patch_size=spec.patch_size, max_soft_tokens=TINY_MAX_SOFT_TOKENS
        )
        processor = Gemma4PilProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
            image_seq_length=TINY_MAX_SOFT_TOKENS,
        )
        return model, processor


CODE = Gemma4VL()
