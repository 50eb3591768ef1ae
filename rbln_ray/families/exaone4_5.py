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
  their frames prepared by rbln-ray's numpy video processor (:mod:`.qwen_vl_processor`); with 1-D
  positions their frame rate changes nothing but the frames.
"""

from __future__ import annotations

from typing import Any

from transformers import Exaone4_5_Config, Exaone4_5_Processor
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.multimodal import MULTIMODAL_REGISTRY

from rbln_ray.families import qwen2_5_vl
from rbln_ray.families.qwen_vl_base import QwenVLCode, TowerEmbedder
from rbln_ray.families.qwen_vl_processor import IMAGE_PAD, VIDEO_PAD, WithoutTorchvision
from rbln_ray.families.qwen_vl_vllm import QwenVLDummyInputs, QwenVLMultiModalProcessor
from rbln_ray.families.tiny import DEFAULT_WINDOW
from rbln_ray.families.vision_base import Declaration, tiny_text_kwargs

VISION_START, VISION_END = "<vision>", "</vision>"
PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
VIDEO_PLACEHOLDER = VISION_START + VIDEO_PAD + VISION_END


class Exaone4_5PilProcessor(WithoutTorchvision, Exaone4_5_Processor):
    """``Exaone4_5_Processor`` without torchvision: PIL images, numpy videos (each frame
    within the image budget, as Qwen2.5-VL's)."""


# ----------------------------------------------------------------------------- vLLM
class Exaone4_5ProcessingInfo(qwen2_5_vl.Qwen2_5_VLProcessingInfo):
    """Qwen2.5-VL's images and tower lengths, EXAONE-4.5's config and processor."""

    CONFIG = Exaone4_5_Config
    PROCESSOR = Exaone4_5PilProcessor


@MULTIMODAL_REGISTRY.register_processor(
    QwenVLMultiModalProcessor, info=Exaone4_5ProcessingInfo, dummy_inputs=QwenVLDummyInputs
)
class RBLNExaone4_5Declaration(Declaration, SupportsMultiModal):
    """``Exaone4_5_ForConditionalGeneration`` as vLLM's registry and front end see it on RBLN
    (1-D positions: no ``SupportsMRoPE``)."""

    PLACEHOLDERS = {"image": PLACEHOLDER, "video": VIDEO_PLACEHOLDER}


# ----------------------------------------------------------------------------- family code
class Exaone4_5(qwen2_5_vl.WindowedTower, QwenVLCode):
    """The Qwen contract with EXAONE-4.5's tokens, its windowed tower and an embedder that
    adds nothing to the decoder's calls (the tower as Qwen's; no positions)."""

    PLACEHOLDER = PLACEHOLDER
    VIDEO_PLACEHOLDER = VIDEO_PLACEHOLDER
    SPECIAL_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
    PROCESSOR = Exaone4_5PilProcessor
    Embedder = TowerEmbedder

    def tiny_model(self, spec: Any, tokenizer: Any) -> tuple[Any, Any]:
        """EXAONE-4.5's recipe at the spec's shape: Qwen2.5-VL's windowed tower (grouped
        key/value heads) and an EXAONE-4 language model (post-norm layers with q/k norms)
        whose layers alternate a sliding window (rbln_ray.families.tiny.DEFAULT_WINDOW tokens,
        shorter than the test prompts) and full attention."""
        import transformers

        language = spec.language
        text = dict(
            tiny_text_kwargs(spec, tokenizer),
            model_type="exaone4",
            head_dim=language.hidden_size // language.num_heads,
            sliding_window=language.sliding_window or DEFAULT_WINDOW,
            sliding_window_pattern=2,
            tie_word_embeddings=False,
        )
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in self.SPECIAL_TOKENS}
        config = transformers.Exaone4_5_Config(
            text_config=text,
            vision_config=self.tiny_vision(spec, num_key_value_heads=1),
            image_token_id=ids[IMAGE_PAD],
            video_token_id=ids[VIDEO_PAD],
            tie_word_embeddings=False,
        )
        model = transformers.Exaone4_5_ForConditionalGeneration(config)
        return model, self.tiny_processor(spec, tokenizer)


CODE = Exaone4_5()
