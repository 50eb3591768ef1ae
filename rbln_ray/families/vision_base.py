"""What every vision-language family module builds on: the prompt embeddings the RBLN runner
feeds a compiled decoder, and the never-run model class vLLM's registry inspects.

Why here: optimum-rbln compiles the vision tower and the projector as their own graphs (one
image per call) and the language model's prefill takes ``inputs_embeds`` (ARCHITECTURE §4).
vLLM's multimodal processor has already expanded each image into its placeholder tokens and
preprocessed its pixels (``MultiModalFeatureSpec``: the processed tensors and the placeholder
range), so a prompt's embeddings are computed once, when its first prefill chunk runs, and
every chunk (and a prefix-cache resume) slices them. The embedding of token ids is the
language model's own host-side table (optimum keeps ``embed_tokens`` on the host when it
compiles with ``use_inputs_embeds``).

On RBLN the model runs through optimum-rbln, so vLLM only needs, per architecture, what its
front end uses: the multimodal processor and a class that declares multimodal support
(:class:`Declaration`). A family whose vLLM module cannot be imported here (it needs
torchvision, which the project venv cannot have) registers its own declaration through
vLLM's public ``ModelRegistry.register_model`` (:func:`rbln_ray.vllm_plugin.register_models`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Where an HF directory keeps its image processor's settings (transformers 4, 5).
PREPROCESSOR_CONFIG, PROCESSOR_CONFIG = "preprocessor_config.json", "processor_config.json"


class PromptEmbedder:
    """Builds and holds the input embeddings of the prompts in prefill; a family's module
    subclasses it with how an image becomes features and what else its decoder takes.
    The decoder is the ``language_model`` submodule unless the family says otherwise."""

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
        """One image's feature vectors (one per placeholder token) from its processed
        tensors: the family's compiled vision tower (and projector)."""
        raise NotImplementedError

    def forget(self, req_id: str) -> None:
        """Drop a prompt's embeddings (its prefill is done, or it finished)."""
        self._embeds.pop(req_id, None)


def not_on_rbln(*_: Any, **__: Any) -> Any:
    raise RuntimeError(
        "rbln-ray's vision-language declarations are never run: the RBLN worker serves the "
        "model through optimum-rbln"
    )


class Declaration(nn.Module):
    """What vLLM's model interface asks of a declaration, none of which runs on RBLN."""

    def embed_input_ids(self, input_ids: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        return not_on_rbln()

    def embed_multimodal(self, **kwargs: object) -> Any:
        return not_on_rbln()

    def get_language_model(self) -> nn.Module:
        return not_on_rbln()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, **kw: Any) -> Any:
        return not_on_rbln()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return not_on_rbln()


def image_processor_settings(model_dir: str | Path) -> dict[str, Any]:
    """An HF directory's saved image processor settings: ``preprocessor_config.json``, or
    (as transformers 5 saves a processor) the ``image_processor`` of
    ``processor_config.json``."""
    path = Path(model_dir)
    if (path / PREPROCESSOR_CONFIG).is_file():
        return json.loads((path / PREPROCESSOR_CONFIG).read_text())
    if (path / PROCESSOR_CONFIG).is_file():
        settings = json.loads((path / PROCESSOR_CONFIG).read_text()).get("image_processor")
        if settings:
            return settings
    raise FileNotFoundError(f"{path} has no image processor settings ({PREPROCESSOR_CONFIG})")
