"""What every vision-language family module builds on: the prompt embeddings the RBLN runner
feeds a compiled decoder, the never-run model class vLLM's registry inspects, and the pieces
every family's tiny model shares (its language model's config).

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
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from rbln_ray.families.registry import DECODERS
from rbln_ray.families.tiny import decoder_config

logger = logging.getLogger(__name__)

# Where an HF directory keeps its image processor's settings (transformers 4, 5).
PREPROCESSOR_CONFIG, PROCESSOR_CONFIG = "preprocessor_config.json", "processor_config.json"


class PromptEmbedder:
    """Builds and holds the input embeddings of the prompts in prefill; a family's module
    subclasses it with how an image (or a video) becomes features and what else its decoder
    takes. The decoder is the ``language_model`` submodule unless the family says otherwise.

    Some towers give more than one vector per placeholder token: Qwen3-VL's also gives the
    features of some inner layers ("deepstack"), which the decoder adds to its hidden states
    after its first layers at the same positions. A family's ``_image_features`` then returns
    ``(features, side)`` with ``side`` ``[k, tokens, width]``; they are kept with the prompt's
    embeddings, at the same positions, in a ``[k, prompt_len, width]`` tensor and a
    ``[prompt_len]`` mask of the positions they fill (:meth:`side_features`).
    """

    def __init__(self, model: Any) -> None:
        # an optimum-rbln vision-language model (e.g. RBLNLlavaForConditionalGeneration)
        self.model = model
        self._embeds: dict[str, torch.Tensor] = {}
        self._side: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def language_model(self) -> Any:
        """The compiled decoder every prefill and decode call runs."""
        return self.model.language_model

    def prefill_inputs(self, state: Any, start: int, end: int) -> dict[str, torch.Tensor]:
        """Extra inputs of the prefill call over tokens ``start..end-1`` of request
        ``state`` (vLLM's ``CachedRequestState``), images or not."""
        return {}

    def decode_inputs(self, states: Sequence[Any | None], cache_position: torch.Tensor) -> dict:
        """Extra inputs of a decode call: ``states`` has one entry per device row, the row's
        request state or None for a padding row (``cache_position``: ``[batch, 1]``, every
        row's)."""
        return {}

    def has_images(self, features: Sequence[Any]) -> bool:
        """Whether a prompt carries media (images or videos): its prefill takes embeddings."""
        return bool(features)

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
        self._side.pop(req_id, None)
        with torch.no_grad():
            embeds = self.model.get_input_embeddings()(ids).clone()
            for feature in features:
                self._place(embeds, feature, req_id, start)
        self._embeds[req_id] = embeds
        return embeds

    def side_features(self, req_id: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(mask [prompt_len] bool, side [k, prompt_len, width])`` of a prompt whose tower
        gave side features (see the class), else None."""
        return self._side.get(req_id)

    def _place(self, embeds: torch.Tensor, feature: Any, req_id: str, start: int) -> None:
        where = feature.mm_position
        if where.offset + where.length <= start:
            # Inside the prefix-cached part of the prompt: its KV is on the device and no
            # prefill reads it (vLLM does not even send its pixels: strip_covered_mm_data).
            return
        if feature.data is None:
            raise RuntimeError(
                f"request {req_id}: {feature.modality} {feature.identifier} at positions "
                f"{where.offset}+{where.length} must be prefilled from {start}, but vLLM sent "
                "no pixels (its prefix cache covered it; the device no longer holds that prefix)"
            )
        image = self._media_features(req_id, feature.modality, feature.data.get_data())
        side = None
        if isinstance(image, tuple):
            image, side = image
        image = image.reshape(-1, embeds.shape[-1]).to(embeds.dtype)
        span = torch.arange(where.offset, where.offset + where.length)
        if where.is_embed is not None:
            span = span[where.is_embed]
        if span.numel() != image.shape[0]:
            raise RuntimeError(
                f"request {req_id}: {feature.modality} {feature.identifier} has "
                f"{image.shape[0]} feature vectors for {span.numel()} placeholder tokens"
            )
        embeds[span] = image
        if side is not None:
            if req_id not in self._side:
                mask = torch.zeros(embeds.shape[0], dtype=torch.bool)
                shape = (side.shape[0], embeds.shape[0], side.shape[-1])
                self._side[req_id] = (mask, torch.zeros(shape, dtype=embeds.dtype))
            mask, buffer = self._side[req_id]
            mask[span] = True
            buffer[:, span] = side.to(buffer.dtype)

    def _media_features(self, req_id: str, modality: str, data: dict[str, torch.Tensor]) -> Any:
        if modality == "image":
            return self._image_features(data)
        if modality == "video":
            return self._video_features(data)
        if modality == "audio":
            return self._audio_features(data)
        raise ValueError(f"request {req_id}: {modality} inputs are not supported")

    def _image_features(self, data: dict[str, torch.Tensor]) -> Any:
        """One image's feature vectors (one per placeholder token) from its processed
        tensors: the family's compiled vision tower (and projector); or ``(features,
        side)`` (see the class)."""
        raise NotImplementedError

    def _video_features(self, data: dict[str, torch.Tensor]) -> Any:
        """One video's feature vectors, as :meth:`_image_features` (families with videos)."""
        raise ValueError("video inputs are not supported by this model")

    def _audio_features(self, data: dict[str, torch.Tensor]) -> Any:
        """One audio clip's feature vectors, as :meth:`_image_features` (audio families)."""
        raise ValueError("audio inputs are not supported by this model")

    def forget(self, req_id: str) -> None:
        """Drop a prompt's embeddings (its prefill is done, or it finished)."""
        self._embeds.pop(req_id, None)
        self._side.pop(req_id, None)


def not_on_rbln(*_: Any, **__: Any) -> Any:
    raise RuntimeError(
        "rbln-ray's vision-language declarations are never run: the RBLN worker serves the "
        "model through optimum-rbln"
    )


def one_image(pixels: torch.Tensor) -> torch.Tensor:
    """An image's processed pixels as a batch of one ``[1, C, H, W]`` (vLLM hands one image
    as ``[C, H, W]``), what optimum's ``get_image_features`` takes."""
    return pixels.unsqueeze(0) if pixels.dim() == 3 else pixels


class Declaration(nn.Module):
    """What vLLM's model interface asks of a declaration, none of which runs on RBLN.

    ``PLACEHOLDERS``: what one item of each modality is in a prompt (None: the processor
    places it), which vLLM's chat rendering asks for (:meth:`get_placeholder_str`).
    """

    PLACEHOLDERS: ClassVar[Mapping[str, str | None]] = {}

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        not_on_rbln()

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        for kind, text in cls.PLACEHOLDERS.items():
            if modality.startswith(kind):
                return text
        raise ValueError(f"only {' and '.join(cls.PLACEHOLDERS)} inputs are supported")

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


# ----------------------------------------------------------------------------- tiny models
def tiny_text_kwargs(spec: Any, tokenizer: Any) -> dict[str, Any]:
    """The tiny language model's shape as config keyword arguments, its vocabulary and special
    ids the tokenizer's: what a family that writes its text config itself (the Qwen
    families' M-RoPE sections, EXAONE-4) starts from."""
    language = spec.language
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=language.hidden_size,
        intermediate_size=language.intermediate_size,
        num_hidden_layers=language.num_layers,
        num_attention_heads=language.num_heads,
        num_key_value_heads=language.num_kv_heads,
        max_position_embeddings=language.max_position_embeddings,
        initializer_range=language.initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def tiny_vision_kwargs(spec: Any, image_size: int | None = None) -> dict[str, Any]:
    """The tiny vision tower's shape as config keyword arguments (a ViT of the spec's width,
    depth and heads, its MLP twice as wide; ``image_size`` when the family's tower takes
    another side than the spec's): what every ViT-style family's vision config starts from."""
    return dict(
        hidden_size=spec.vision_hidden_size,
        intermediate_size=2 * spec.vision_hidden_size,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.image_size if image_size is None else image_size,
        patch_size=spec.patch_size,
    )


def tiny_text_config(spec: Any, tokenizer: Any) -> Any:
    """The tiny language model's transformers config: its decoder family's tiny recipe
    (:attr:`rbln_ray.families.registry.DecoderFamily.tiny`) at the spec's language shape, with
    the tokenizer's vocabulary and special ids."""
    return decoder_config(
        DECODERS[spec.language.family].tiny,
        replace(spec.language, vocab_size=len(tokenizer)),
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
