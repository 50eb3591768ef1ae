"""EXAONE-4.5 on RBLN: Qwen2.5-VL's windowed vision tower (:mod:`.qwen2_5_vl`) before an
EXAONE-4 language model with sliding-window layers and plain (1-D) positions.

What differs from the Qwen families, and why:

* **Positions.** transformers' ``Exaone4_5_ForConditionalGeneration`` positions every token by
  its index, images included (no M-RoPE), and optimum-rbln 0.12's graphs take no position
  input: the embedder adds nothing to the decoder's calls, and vLLM's declaration is no
  ``SupportsMRoPE`` (vLLM 0.30's own ``exaone4_5``, which subclasses its Qwen2.5-VL and
  cannot be imported here, declares M-RoPE, which transformers does not do).
* **Sliding-window layers.** The language model alternates sliding-window and full-attention
  layers; optimum compiles it with ``cache_impl: "hybrid"``, whose sliding layers keep a
  per-request window in a cache slot (``local_block_tables``), which the scheduler assigns as
  for the hybrid text families. A slot holds only its request's last window, so no cached
  prefix can be adopted: prefix caching is off (the platform turns it off for every
  sliding-window artifact, and the record says so); chunked prefill works.
* **Tokens.** An image is ``<vision>`` + its ``<|image_pad|>`` tokens + ``</vision>`` in the
  chat template; transformers' ``Exaone4_5_Processor`` (without its video processor, as for
  the Qwen families) expands the pad token only.
* **Tower.** Qwen2.5-VL's window attention (with grouped key/value heads): compiled for the
  same list of window-padded lengths, and an image past them refused the same way. Videos
  (``<vision><|video_pad|></vision>``) go through the same tower, one call per temporal patch,
  their frames prepared by rbln-ray's numpy video processor (:mod:`.qwen2_vl`); with 1-D
  positions their frame rate changes nothing but the frames.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Exaone4_5_Config, Exaone4_5_Processor
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.multimodal import MULTIMODAL_REGISTRY

from rbln_ray.families import qwen2_5_vl, qwen2_vl
from rbln_ray.families.qwen2_vl import IMAGE_PAD, VIDEO_PAD, WithoutTorchvision
from rbln_ray.families.tiny import DEFAULT_WINDOW
from rbln_ray.families.vision_base import Declaration, PromptEmbedder, not_on_rbln

VISION_START, VISION_END = "<vision>", "</vision>"
PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
VIDEO_PLACEHOLDER = VISION_START + VIDEO_PAD + VISION_END
SPECIAL_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
SPEC_DEFAULTS = qwen2_5_vl.SPEC_DEFAULTS
vision_rbln_config = qwen2_5_vl.vision_rbln_config


class Exaone4_5PilProcessor(WithoutTorchvision, Exaone4_5_Processor):
    """``Exaone4_5_Processor`` without torchvision: PIL images, numpy videos (each frame
    within the image budget, as Qwen2.5-VL's)."""


def load_processor(model_dir: str | Path, **kwargs: Any) -> Exaone4_5PilProcessor:
    return Exaone4_5PilProcessor.from_pretrained(str(model_dir), **kwargs)


def after_compile(hf_dir: str | Path, out: Path) -> None:
    """Save the image-only processor with the artifact (optimum saves only what
    ``AutoProcessor`` loads, which needs torchvision here)."""
    load_processor(hf_dir).save_pretrained(out)


# ----------------------------------------------------------------------------- runner
class Embedder(PromptEmbedder):
    """Image features from the compiled tower (``model.visual``); the decoder is the model
    itself and takes nothing beyond a text decoder's inputs."""

    @property
    def language_model(self) -> Any:
        return self.model

    def _image_features(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model.visual(data["pixel_values"], grid_thw=data["image_grid_thw"].view(1, 3))

    def _video_features(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        # the same tower, one call per temporal patch
        grid = data["video_grid_thw"].view(1, 3)
        return self.model.visual(data["pixel_values_videos"], grid_thw=grid)


# ----------------------------------------------------------------------------- vLLM
class Exaone4_5ProcessingInfo(qwen2_5_vl.Qwen2_5_VLProcessingInfo):
    """Qwen2.5-VL's images and tower lengths, EXAONE-4.5's config and processor."""

    CONFIG = Exaone4_5_Config
    PROCESSOR = Exaone4_5PilProcessor


@MULTIMODAL_REGISTRY.register_processor(
    qwen2_vl.Qwen2VLMultiModalProcessor,
    info=Exaone4_5ProcessingInfo,
    dummy_inputs=qwen2_vl.Qwen2VLDummyInputs,
)
class RBLNExaone4_5Declaration(Declaration, SupportsMultiModal):
    """``Exaone4_5_ForConditionalGeneration`` as vLLM's registry and front end see it on RBLN
    (1-D positions: no ``SupportsMRoPE``)."""

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality.startswith("image"):
            return PLACEHOLDER
        if modality.startswith("video"):
            return VIDEO_PLACEHOLDER
        raise ValueError("only image and video inputs are supported")

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        not_on_rbln()


# ----------------------------------------------------------------------------- tiny model
def tiny_model(spec: Any, tokenizer: Any) -> tuple[Any, Any]:
    """EXAONE-4.5's recipe at the spec's shape: Qwen2.5-VL's windowed tower (grouped
    key/value heads) and an EXAONE-4 language model (post-norm layers with q/k norms) whose
    layers alternate a sliding window (rbln_ray.families.tiny.DEFAULT_WINDOW tokens, shorter
    than the test prompts) and full attention."""
    import transformers

    language = spec.language
    text = dict(
        model_type="exaone4",
        vocab_size=len(tokenizer),
        hidden_size=language.hidden_size,
        intermediate_size=language.intermediate_size,
        num_hidden_layers=language.num_layers,
        num_attention_heads=language.num_heads,
        num_key_value_heads=language.num_kv_heads,
        head_dim=language.hidden_size // language.num_heads,
        max_position_embeddings=language.max_position_embeddings,
        initializer_range=language.initializer_range,
        sliding_window=language.sliding_window or DEFAULT_WINDOW,
        sliding_window_pattern=2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    vision = dict(
        depth=spec.vision_layers,
        hidden_size=spec.vision_hidden_size,
        intermediate_size=2 * spec.vision_hidden_size,
        num_heads=spec.vision_heads,
        num_key_value_heads=1,
        out_hidden_size=language.hidden_size,
        patch_size=spec.patch_size,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=qwen2_5_vl.TINY_WINDOW,
        fullatt_block_indexes=[spec.vision_layers - 1],
        initializer_range=language.initializer_range,
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = transformers.Exaone4_5_Config(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        tie_word_embeddings=False,
    )
    processor = Exaone4_5PilProcessor(
        image_processor=qwen2_vl.tiny_image_processor(spec),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )
    return transformers.Exaone4_5_ForConditionalGeneration(config), processor
