"""Prompt embeddings of a vision-language request: token embeddings with every image's
features at its placeholder positions; and the extra inputs a family's compiled decoder takes.

Why here and not in vLLM's encoder cache: optimum-rbln compiles the vision tower and the
projector as their own graphs (one image per call) and the language model's prefill takes
``inputs_embeds`` (ARCHITECTURE §4). vLLM's multimodal processor has already expanded each
image into its placeholder tokens and preprocessed its pixels (``MultiModalFeatureSpec``:
the processed tensors and the placeholder range), so a prompt's embeddings are computed once,
when its first prefill chunk runs, and every chunk (and a prefix-cache resume) slices them.
The embedding of token ids is the language model's own host-side table (optimum keeps
``embed_tokens`` on the host when it compiles with ``use_inputs_embeds``).

Families differ in where the decoder is, how an image becomes features, and what else each
prefill chunk and decode step passes: :func:`prompt_embedder` picks the family's embedder
(LLaVA's below; Qwen2-VL's, with its M-RoPE position embeddings, in :mod:`.qwen2_vl_inputs`),
and the model runner merges :meth:`PromptEmbedder.prefill_inputs` /
:meth:`PromptEmbedder.decode_inputs` into its device calls.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)


class PromptEmbedder:
    """Builds and holds the input embeddings of the prompts in prefill (LLaVA's recipe:
    the vision tower and projector of ``get_image_features``, a ``language_model``
    submodule as the decoder)."""

    def __init__(self, model: Any) -> None:
        # an optimum-rbln vision-language model (e.g. RBLNLlavaForConditionalGeneration)
        self.model = model
        self._embeds: dict[str, torch.Tensor] = {}

    @property
    def language_model(self) -> Any:
        """The compiled decoder every prefill and decode call runs."""
        return self.model.language_model

    def prefill_inputs(self, state: Any, start: int, end: int) -> dict[str, torch.Tensor]:
        """Extra inputs of the prefill call over tokens ``start..end-1`` of request
        ``state`` (vLLM's ``CachedRequestState``), images or not."""
        return {}

    def decode_inputs(self, states: Sequence[Any], cache_position: torch.Tensor) -> dict:
        """Extra inputs of a decode call whose rows are ``states`` then padding rows
        (``cache_position``: ``[batch, 1]``, every row's)."""
        return {}

    def has_images(self, features: Sequence[Any]) -> bool:
        return any(f.modality == "image" for f in features)

    def embeds(
        self, req_id: str, token_ids: Sequence[int], features: Sequence[Any], start: int
    ) -> torch.Tensor:
        """``[len(token_ids), hidden]`` embeddings of this prompt, images in place; the
        positions before ``start`` (its prefill's first position: KV cached) are only
        guaranteed to hold their token embeddings."""
        cached = self._embeds.get(req_id)
        if cached is not None and cached.shape[0] >= len(token_ids):
            return cached
        ids = torch.tensor(list(token_ids), dtype=torch.long)
        with torch.no_grad():
            embeds = self.model.get_input_embeddings()(ids).clone()
            for feature in features:
                self._place(embeds, feature, req_id, start)
        self._embeds[req_id] = embeds
        return embeds

    def _place(self, embeds: torch.Tensor, feature: Any, req_id: str, start: int) -> None:
        if feature.modality != "image":
            raise ValueError(f"request {req_id}: {feature.modality} inputs are not supported")
        where = feature.mm_position
        if where.offset + where.length <= start:
            # Inside the prefix-cached part of the prompt: its KV is on the device and no
            # prefill reads it (vLLM does not even send its pixels: strip_covered_mm_data).
            return
        if feature.data is None:
            raise RuntimeError(
                f"request {req_id}: image {feature.identifier} at positions {where.offset}+"
                f"{where.length} must be prefilled from {start}, but vLLM sent no pixels "
                "(its prefix cache covered it; the device no longer holds that prefix)"
            )
        image = self._image_features(feature.data.get_data())
        image = image.reshape(-1, embeds.shape[-1]).to(embeds.dtype)
        span = torch.arange(where.offset, where.offset + where.length)
        if where.is_embed is not None:
            span = span[where.is_embed]
        if span.numel() != image.shape[0]:
            raise RuntimeError(
                f"request {req_id}: image {feature.identifier} has {image.shape[0]} feature "
                f"vectors for {span.numel()} placeholder tokens"
            )
        embeds[span] = image

    def _image_features(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's feature vectors from its processed tensors."""
        pixels = data["pixel_values"]
        if pixels.dim() == 3:  # one image: [C, H, W]
            pixels = pixels.unsqueeze(0)
        config = self.model.config
        return self.model.get_image_features(
            pixel_values=pixels,
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
        )

    def forget(self, req_id: str) -> None:
        """Drop a prompt's embeddings (its prefill is done, or it finished)."""
        self._embeds.pop(req_id, None)


def prompt_embedder(model: Any, family: str) -> PromptEmbedder:
    """The embedder of an optimum-rbln model of vision-language ``family``
    (``rbln_ray.compile.vision.VISION_FAMILIES``)."""
    if family == "qwen2_vl":
        from rbln_ray.vllm_plugin.qwen2_vl_inputs import Qwen2VLPromptEmbedder

        return Qwen2VLPromptEmbedder(model)
    return PromptEmbedder(model)
