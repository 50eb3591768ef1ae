"""Qwen2-VL on RBLN: images of any size as a variable number of tokens, M-RoPE positions, and
transformers' processor without its video half.

What differs from LLaVA (:mod:`.llava`), everywhere a request goes:

* **Processor.** transformers 5.15's ``Qwen2VLProcessor`` takes an image processor, a
  tokenizer *and* a video processor, and refuses to be built or loaded without the last;
  every video processor of transformers 5.15 needs torchvision, which the project venv cannot
  have. :class:`Qwen2VLImageProcessorOnly` declares just the image processor
  (``Qwen2VLImageProcessorPil``: PIL and numpy) and the tokenizer; every step of processing a
  prompt is transformers' own, and it saves itself as ``Qwen2VLProcessor``.
* **Tokens per image.** The processor resizes an image to multiples of 28 pixels within its
  pixel budget and the tower merges 2 x 2 patches of 14 pixels into one token; optimum-rbln
  compiles the tower for a maximum number of patches per image (:func:`vision_max_patches`,
  from the processor's budget), and a larger image is refused before it reaches the engine.
* **M-RoPE.** The language model rotates by three positions per token (temporal, height,
  width): text tokens have all three equal and consecutive, an image's tokens the image's
  start plus their row and column, and text after an image continues from one past the
  image's largest position. Positions run behind token indices by a per-request ``delta``
  (:func:`mrope_positions`, following transformers' ``get_rope_index``; checked against it
  in ``tests/unit/test_mrope.py``). vLLM asks the model for them
  (``SupportsMRoPE.get_mrope_input_positions``) and vLLM 0.30's own ``qwen2_vl`` module cannot
  be imported here (torchvision), so the declaration and the RBLN runner both use this
  function; optimum-rbln 0.12's graphs take them as one more input, ``position_emb`` (cos
  and sin, computed on the host by the model's own method), at every prefill chunk and
  decode step. KV positions stay token positions, so the scheduler, the KV blocks, chunked
  prefill and prefix caching are the text path's.
* **Where the decoder is.** ``RBLNQwen2VLForConditionalGeneration`` is itself the decoder;
  its vision tower is the ``visual`` submodule (the registry record says so).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch
from transformers import BatchFeature, ProcessorMixin, Qwen2VLConfig, Qwen2VLProcessor
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

from rbln_ray.common.artifact_files import RBLN_CONFIG
from rbln_ray.families.vision_base import Declaration, PromptEmbedder, image_processor_settings
from rbln_ray.upstream import optimum_internals

# Qwen2-VL's special tokens (its processor looks the image token up by this name) and what
# one image is in its prompts: the placeholder between the vision start and end markers.
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
SPECIAL_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
# The tiny model's pixel budget: at most 256 patches (64 image tokens) per image.
TINY_MAX_PIXELS = 28 * 28 * 64
MIN_PIXELS = 56 * 56  # Qwen2-VL's own minimum
SPEC_DEFAULTS = {"max_pixels": TINY_MAX_PIXELS}


# ----------------------------------------------------------------------------- processor
class Qwen2VLImageProcessorOnly(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` over images and text only (no video processor)."""

    def __init__(
        self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kw
    ) -> None:
        # What Qwen2VLProcessor.__init__ sets before its ProcessorMixin.__init__ (which would
        # require the video processor).
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = getattr(
            tokenizer, "image_token_id", None
        ) or tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = getattr(
            tokenizer, "video_token_id", None
        ) or tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kw)

    def to_dict(self) -> dict[str, Any]:
        config = super().to_dict()
        config["processor_class"] = Qwen2VLProcessor.__name__
        return config


def load_processor(model_dir: str | Path, **kwargs: Any) -> Qwen2VLImageProcessorOnly:
    """A Qwen2-VL directory's processor (images and text; see the module docstring)."""
    return Qwen2VLImageProcessorOnly.from_pretrained(str(model_dir), **kwargs)


def vision_max_patches(model_dir: str | Path) -> int:
    """How many patches one image may have (the vision tower's compiled ``max_seq_len``).

    A compiled directory answers from its ``rbln_config.json`` (the largest compiled length);
    an HF directory with what the compile gives it (:func:`vision_rbln_config`): the image
    processor's pixel budget ``max_pixels`` in patches (``max_pixels / patch_size^2``), so
    every image the processor can produce fits.
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


def vision_rbln_config(hf_dir: str | Path) -> dict[str, Any]:
    """The vision tower's compile settings: the patches of the largest image the processor
    makes (optimum-rbln has no default for it)."""
    return {"visual": {"max_seq_len": vision_max_patches(hf_dir)}}


def after_compile(hf_dir: str | Path, out: Path) -> None:
    """optimum saves the processors ``AutoProcessor`` loads, and transformers' Qwen2-VL one
    needs torchvision: save the image-only one, or the artifact has no image processor."""
    load_processor(hf_dir).save_pretrained(out)


# ----------------------------------------------------------------------------- M-RoPE
def image_grids(features: Sequence[Any]) -> list[tuple[int, int, int, int]]:
    """``(offset, t, h, w)`` of every image of a request, in prompt order, from vLLM's
    ``MultiModalFeatureSpec`` list (``image_grid_thw`` is kept on the CPU even when the
    prefix cache drops an image's pixels, for this)."""
    grids = []
    for feature in sorted(features, key=lambda f: f.mm_position.offset):
        if feature.modality != "image":
            raise ValueError(f"{feature.modality} inputs are not supported (images only)")
        if feature.data is None or "image_grid_thw" not in feature.data:
            raise RuntimeError(f"image {feature.identifier} arrived without its image_grid_thw")
        t, h, w = (int(x) for x in feature.data["image_grid_thw"].data.tolist())
        grids.append((feature.mm_position.offset, t, h, w))
    return grids


def mrope_positions(
    num_tokens: int, grids: Sequence[tuple[int, int, int, int]], spatial_merge_size: int
) -> tuple[torch.Tensor, int]:
    """``([3, num_tokens] int64 positions, delta)`` of a prompt whose images are
    ``(offset, t, h, w)`` (patch grids; each image's tokens start at ``offset`` and number
    ``t * h * w / spatial_merge_size^2``). ``delta`` is what later positions add to their
    token index."""
    pieces: list[torch.Tensor] = []
    text_start = 0  # token index where the current run of text begins
    next_pos = 0  # the position the next token takes
    for offset, t, h, w in grids:
        if t != 1:
            raise ValueError(f"an image has {t} frames; images have one")
        if offset < text_start:
            raise ValueError(f"images overlap at token {offset}")
        text = offset - text_start
        pieces.append(torch.arange(text).expand(3, -1) + next_pos)
        next_pos += text
        rows, cols = h // spatial_merge_size, w // spatial_merge_size
        grid = torch.stack(
            [
                torch.zeros(rows, cols, dtype=torch.long),
                torch.arange(rows).view(-1, 1).expand(rows, cols),
                torch.arange(cols).view(1, -1).expand(rows, cols),
            ]
        ).reshape(3, -1)
        pieces.append(grid + next_pos)
        next_pos += max(rows, cols)
        text_start = offset + rows * cols
    if text_start > num_tokens:
        raise ValueError(f"an image ends at token {text_start}, past the prompt's {num_tokens}")
    pieces.append(torch.arange(num_tokens - text_start).expand(3, -1) + next_pos)
    # the last position is next_pos + (num_tokens - text_start) - 1 (or the last image's
    # largest when no text follows it, which is next_pos - 1 too): delta = that + 1 - tokens
    return torch.cat(pieces, dim=1), next_pos - text_start


def positions_span(
    prompt_positions: torch.Tensor, delta: int, start: int, end: int
) -> torch.Tensor:
    """``[3, end - start]`` positions of tokens ``start..end-1``: the prompt's where the span
    lies in the prompt, ``index + delta`` (all three equal) past it (generated tokens, e.g. a
    preempted request's prefill again)."""
    prompt_len = prompt_positions.shape[1]
    inside = prompt_positions[:, start : min(end, prompt_len)]
    past = torch.arange(max(start, prompt_len), max(end, prompt_len)).expand(3, -1) + delta
    return torch.cat([inside, past], dim=1)


# ----------------------------------------------------------------------------- runner
class Embedder(PromptEmbedder):
    """Prompt embeddings and position embeddings of an ``RBLNQwen2VLForConditionalGeneration``
    (the decoder is the model itself; its vision tower is ``model.visual``)."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.merge_size = model.config.vision_config.spatial_merge_size
        self.dtype = model.rbln_config.dtype

    @property
    def language_model(self) -> Any:
        return self.model

    def _image_features(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        # the image's flattened patches [t*h*w, C*T*P*P] and grid [3]; one merged token each
        # 2 x 2 patches
        return self.model.visual(data["pixel_values"], grid_thw=data["image_grid_thw"].view(1, 3))

    def positions(self, state: Any) -> tuple[torch.Tensor, int]:
        """The request's prompt M-RoPE positions ``[3, prompt_len]`` and delta, computed once
        (vLLM's ``mrope_positions`` / ``mrope_position_delta`` fields of the state)."""
        if state.mrope_positions is None:
            grids = image_grids(state.mm_features)
            state.mrope_positions, state.mrope_position_delta = mrope_positions(
                len(state.prompt_token_ids), grids, self.merge_size
            )
        return state.mrope_positions, state.mrope_position_delta

    def _embeddings(self, position_ids: torch.Tensor) -> torch.Tensor:
        """``[2, batch, 1, length, head_dim]`` cos/sin of ``[3, batch, length]`` positions."""
        return optimum_internals.qwen2_vl_position_embeddings(self.model, self.dtype, position_ids)

    def prefill_inputs(self, state: Any, start: int, end: int) -> dict[str, torch.Tensor]:
        prompt, delta = self.positions(state)
        span = positions_span(prompt, delta, start, end)
        return {"position_embed": self._embeddings(span.unsqueeze(1))}

    def decode_inputs(self, states: Sequence[Any], cache_position: torch.Tensor) -> dict:
        deltas = [self.positions(s)[1] for s in states]
        deltas += [0] * (cache_position.shape[0] - len(deltas))  # padding rows: scratch position
        rows = cache_position.view(-1).long() + torch.tensor(deltas, dtype=torch.long)
        return {"position_embed": self._embeddings(rows.view(1, -1, 1).expand(3, -1, -1))}


# ----------------------------------------------------------------------------- vLLM
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
    return vision_max_patches(model)


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
class RBLNQwen2VLDeclaration(Declaration, SupportsMultiModal, SupportsMRoPE):
    """``Qwen2VLForConditionalGeneration`` as vLLM's registry and front end see it on RBLN.

    Constructible (it holds the HF config only) so that its M-RoPE contract,
    :meth:`get_mrope_input_positions`, is vLLM's own interface; the RBLN runner computes the
    same positions with the same function (:class:`Embedder`).
    """

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config: Qwen2VLConfig = vllm_config.model_config.hf_config

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality.startswith("image"):
            return PLACEHOLDER
        raise ValueError("only image inputs are supported")

    def get_mrope_input_positions(
        self, input_tokens: list[int], mm_features: list[MultiModalFeatureSpec]
    ) -> tuple[torch.Tensor, int]:
        merge = self.config.vision_config.spatial_merge_size
        return mrope_positions(len(input_tokens), image_grids(mm_features), merge)


# ----------------------------------------------------------------------------- tiny model
def tiny_model(spec: Any, tokenizer: Any) -> tuple[Any, Any]:
    """Qwen2-VL's recipe at the spec's shape: a ViT over 14-pixel patches (two frames per
    temporal patch) with 2-D rotary positions, 2 x 2 patches merged into one token by an MLP,
    a Qwen2 language model with M-RoPE (temporal, height, width sections of the rotary
    dimensions)."""
    import transformers

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    language = spec.language
    head_dim = language.hidden_size // language.num_heads
    pairs = head_dim // 2  # rotary pairs: Qwen2-VL's [16, 24, 24] of 64, scaled
    temporal = pairs // 4
    section = [temporal, (pairs - temporal) // 2, pairs - temporal - (pairs - temporal) // 2]
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=language.hidden_size,
        intermediate_size=language.intermediate_size,
        num_hidden_layers=language.num_layers,
        num_attention_heads=language.num_heads,
        num_key_value_heads=language.num_kv_heads,
        max_position_embeddings=language.max_position_embeddings,
        initializer_range=language.initializer_range,
        rope_scaling={"type": "mrope", "mrope_section": section},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(
        depth=spec.vision_layers,
        embed_dim=spec.vision_hidden_size,
        hidden_size=language.hidden_size,  # the merger's output: the LM's embeddings
        mlp_ratio=2,
        num_heads=spec.vision_heads,
        patch_size=spec.patch_size,
        # not a field of transformers' config, but in every Qwen2-VL checkpoint's, and
        # optimum-rbln 0.12's vision tower reads it
        spatial_patch_size=spec.patch_size,
        spatial_merge_size=2,
        temporal_patch_size=2,
        initializer_range=language.initializer_range,
    )
    config = transformers.Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False,
    )
    image_processor = transformers.Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS,
        max_pixels=spec.max_pixels,
        patch_size=spec.patch_size,
        merge_size=2,
        temporal_patch_size=2,
    )
    processor = Qwen2VLImageProcessorOnly(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )
    return transformers.Qwen2VLForConditionalGeneration(config), processor
