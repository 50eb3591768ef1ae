"""The shared Qwen-VL base: what Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), Qwen3.5 and EXAONE-4.5
have in common on RBLN, beyond :mod:`.vision_base`.

What differs from LLaVA (:mod:`.llava`), everywhere a request goes:

* **Processor.** transformers' processor without its video half
  (:mod:`.qwen_vl_processor`), saved with the artifact (the contract's ``PROCESSOR``).
* **Tokens per image.** The processor resizes an image to multiples of ``patch_size x
  merge_size`` pixels within its pixel budget and the tower merges 2 x 2 patches into one
  token; optimum-rbln compiles the tower for a maximum number of patches per image
  (:func:`vision_max_patches`, from the processor's budget), and a larger image is refused
  before it reaches the engine (:mod:`.qwen_vl_vllm`).
* **Where the decoder is.** The optimum-rbln model is itself the decoder; its vision tower is
  the ``visual`` submodule, one call per image or per temporal patch of a video
  (:class:`TowerEmbedder`).
* **M-RoPE.** Every family but EXAONE-4.5 positions its tokens in three dimensions
  (:mod:`.qwen_vl_rope`); optimum-rbln 0.12's graphs take the positions as one more input,
  ``position_embed`` (cos and sin, computed on the host by the model's own method), at every
  prefill chunk and decode step (:class:`MRopeEmbedder`). KV positions stay token positions,
  so the scheduler, the KV blocks, chunked prefill and prefix caching are the text path's.

A family module subclasses :class:`QwenVLCode` (its contract), an embedder here, and the vLLM
classes of :mod:`.qwen_vl_vllm` with its own transformers classes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from rbln_ray.common.artifact_files import RBLN_CONFIG
from rbln_ray.families.contract import VisionCode
from rbln_ray.families.qwen_vl_processor import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START
from rbln_ray.families.qwen_vl_rope import positions_span, rope_index
from rbln_ray.families.vision_base import (
    PromptEmbedder,
    image_processor_settings,
    tiny_text_kwargs,
)
from rbln_ray.upstream import optimum_internals

# The tiny models' pixel budget: at most 256 patches of 14 pixels (64 image tokens) an image.
TINY_MAX_PIXELS = 28 * 28 * 64
MIN_PIXELS = 56 * 56  # Qwen2-VL's own minimum


# ----------------------------------------------------------------------------- tower length
def vision_max_patches(model_dir: str | Path) -> int:
    """How many patches one image may have (the vision tower's compiled ``max_seq_len``).

    A compiled directory answers from its ``rbln_config.json`` (the largest compiled length);
    an HF directory with what the compile gives it (:meth:`QwenVLCode.vision_rbln_config`):
    the image processor's pixel budget ``max_pixels`` in patches (``max_pixels /
    patch_size^2``), so every image the processor can produce fits.
    """
    path = Path(model_dir)
    compiled = path / RBLN_CONFIG
    if compiled.is_file():
        visual = json.loads(compiled.read_text()).get("visual") or {}
        lengths = visual.get("max_seq_len")
        if lengths:
            return max(lengths) if isinstance(lengths, list) else int(lengths)
    settings = image_processor_settings(path)
    max_pixels = (settings.get("size") or {}).get("longest_edge") or settings.get("max_pixels")
    if not max_pixels:
        raise ValueError(f"{path}: its image processor names no max_pixels (size.longest_edge)")
    return int(max_pixels) // int(settings.get("patch_size", 14)) ** 2


# ----------------------------------------------------------------------------- runner
class TowerEmbedder(PromptEmbedder):
    """Prompt embeddings of a model that is itself the decoder, with its vision tower as
    ``model.visual``: an image's (or a video's) flattened patches ``[t*h*w, C*T*P*P]`` and
    grid ``[3]`` through the compiled tower, one merged token each 2 x 2 patches."""

    @property
    def language_model(self) -> Any:
        return self.model

    def _tower(self, pixels: torch.Tensor, grid: torch.Tensor) -> Any:
        """One image's or video's features (one call per temporal patch)."""
        return self.model.visual(pixels, grid_thw=grid.view(1, 3))

    def _image_features(self, data: dict[str, torch.Tensor]) -> Any:
        return self._tower(data["pixel_values"], data["image_grid_thw"])

    def _video_features(self, data: dict[str, torch.Tensor]) -> Any:
        return self._tower(data["pixel_values_videos"], data["video_grid_thw"])


class MRopeEmbedder(TowerEmbedder):
    """:class:`TowerEmbedder` plus the cos/sin of each prompt's M-RoPE positions at every
    prefill chunk and decode step. A family sets ``ROPE_MODEL``, its transformers model
    (whose ``get_rope_index`` gives the positions), and :meth:`rope_extra` when that takes
    more than the grids."""

    ROPE_MODEL: ClassVar[type]

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.dtype = model.rbln_config.dtype

    @classmethod
    def rope_extra(cls, features: Sequence[Any]) -> dict[str, Any]:
        """The family's further arguments of ``get_rope_index`` (none by default)."""
        return {}

    def positions(self, state: Any) -> tuple[torch.Tensor, int]:
        """The request's prompt M-RoPE positions ``[3, prompt_len]`` and delta, computed once
        (vLLM's ``mrope_positions`` / ``mrope_position_delta`` fields of the state)."""
        if state.mrope_positions is None:
            state.mrope_positions, state.mrope_position_delta = rope_index(
                self.ROPE_MODEL,
                self.model.config,
                state.prompt_token_ids,
                state.mm_features,
                **self.rope_extra(state.mm_features),
            )
        return state.mrope_positions, state.mrope_position_delta

    def _embeddings(self, position_ids: torch.Tensor) -> torch.Tensor:
        """``[2, batch, 1, length, head_dim]`` cos/sin of ``[3, batch, length]`` positions."""
        return optimum_internals.qwen2_vl_position_embeddings(self.model, self.dtype, position_ids)

    def prefill_inputs(self, state: Any, start: int, end: int) -> dict[str, torch.Tensor]:
        prompt, delta = self.positions(state)
        span = positions_span(prompt, delta, start, end)
        return {"position_embed": self._embeddings(span.unsqueeze(1))}

    def decode_inputs(self, states: Sequence[Any | None], cache_position: torch.Tensor) -> dict:
        # padding rows (None): their scratch position as it is
        deltas = [self.positions(s)[1] if s is not None else 0 for s in states]
        rows = cache_position.view(-1).long() + torch.tensor(deltas, dtype=torch.long)
        return {"position_embed": self._embeddings(rows.view(1, -1, 1).expand(3, -1, -1))}


# ----------------------------------------------------------------------------- tiny models
def sectioned_mrope_text(spec: Any, tokenizer: Any) -> dict[str, Any]:
    """The language model's config of a tiny Qwen2-VL or Qwen2.5-VL: a Qwen2 decoder of the
    spec's shape with M-RoPE sections of its rotary dimensions (Qwen2-VL's [16, 24, 24] of
    64, scaled)."""
    language = spec.language
    pairs = language.hidden_size // language.num_heads // 2
    temporal = pairs // 4
    section = [temporal, (pairs - temporal) // 2, pairs - temporal - (pairs - temporal) // 2]
    return dict(
        tiny_text_kwargs(spec, tokenizer),
        rope_scaling={"type": "mrope", "mrope_section": section},
    )


def interleaved_mrope_text(spec: Any, tokenizer: Any) -> dict[str, Any]:
    """A tiny Qwen3 language model's config with interleaved M-RoPE (Qwen3-VL's sections
    [24, 20, 20] of 64 rotary pairs, scaled to the head)."""
    language = spec.language
    head_dim = language.hidden_size // language.num_heads
    pairs = head_dim // 2
    temporal = pairs - 2 * (pairs * 20 // 64)
    return dict(
        tiny_text_kwargs(spec, tokenizer),
        head_dim=head_dim,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [temporal, (pairs - temporal) // 2, (pairs - temporal) // 2],
            "mrope_interleaved": True,
        },
    )


# ----------------------------------------------------------------------------- family code
class QwenVLCode(VisionCode):
    """The contract as the Qwen families keep it: Qwen's tokens, images and videos, the tiny
    models' pixel budget, a tower compiled for the processor's largest image, the processor
    saved with the artifact (a family sets ``PROCESSOR`` and ``Embedder``)."""

    PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
    VIDEO_PLACEHOLDER = VISION_START + VIDEO_PAD + VISION_END
    SPECIAL_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
    SPEC_DEFAULTS = {"max_pixels": TINY_MAX_PIXELS}

    def vision_rbln_config(self, hf_dir: str | Path) -> dict[str, Any]:
        """The vision tower's compile settings: the patches of the largest image the
        processor makes (optimum-rbln has no default for it)."""
        return {"visual": {"max_seq_len": vision_max_patches(hf_dir)}}

    @staticmethod
    def token_ids(tokenizer: Any) -> dict[str, int]:
        """The Qwen special tokens' ids, as the configs name them."""
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QwenVLCode.SPECIAL_TOKENS}
        return {
            "image_token_id": ids[IMAGE_PAD],
            "video_token_id": ids[VIDEO_PAD],
            "vision_start_token_id": ids[VISION_START],
            "vision_end_token_id": ids[VISION_END],
        }

    @staticmethod
    def tiny_image_processor(spec: Any, patch: int, min_pixels: int = MIN_PIXELS) -> Any:
        """transformers' PIL Qwen2-VL image processor (every Qwen family's images) with
        ``patch``-pixel patches, 2 x 2 merged, and the spec's pixel budget."""
        import transformers

        return transformers.Qwen2VLImageProcessorPil(
            min_pixels=min_pixels,
            max_pixels=spec.max_pixels,
            patch_size=patch,
            merge_size=2,
            temporal_patch_size=2,
        )

    def tiny_processor(self, spec: Any, tokenizer: Any, image_processor: Any = None) -> Any:
        """The family's processor over its tiny image processor (default: the spec's
        ``patch_size``) and ``tokenizer``, with the tokenizer's chat template."""
        if self.PROCESSOR is None:
            raise TypeError(f"{type(self).__name__} sets no PROCESSOR")
        return self.PROCESSOR(
            image_processor=image_processor or self.tiny_image_processor(spec, spec.patch_size),
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )
