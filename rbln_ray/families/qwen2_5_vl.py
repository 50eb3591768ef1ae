"""Qwen2.5-VL on RBLN: Qwen2-VL (:mod:`.qwen2_vl`) with window attention in the vision tower
(which EXAONE-4.5 shares: :class:`WindowedTower`).

What differs from Qwen2-VL, and why:

* **The tower's length.** Most of the tower's layers attend within windows of
  ``window_size`` pixels (``fullatt_block_indexes`` name the few that see the whole image).
  optimum-rbln 0.12 pads every window of an image to its full ``(window_size /
  patch_size)^2`` patches and runs the graph compiled for the smallest ``max_seq_len`` at
  least that long (one call per temporal patch). A square image of the pixel budget pads
  little; a skinny one (a window row or column cut short all along its length) up to about
  twice its patches. So the tower is compiled for a list of lengths (:func:`tower_lengths`):
  the budget's patches rounded up to whole windows, and the longest window-padded length any
  grid within the budget needs, so every image the processor makes at the model's budget
  fits; a request that raises the budget past it is refused with a 400 naming the image's
  window-padded length and the compiled one (:class:`Qwen2_5_VLProcessingInfo`).
* **Classes.** ``Qwen2_5_VLProcessor`` needs a video processor like Qwen2-VL's (rbln-ray's
  image-only subclass, the same way); positions are ``Qwen2_5_VLModel.get_rope_index``
  (which adds ``second_per_grid_ts`` for videos); the vision config names its fields
  ``hidden_size`` / ``out_hidden_size`` / ``intermediate_size``.

Everything else (prompt embeddings, M-RoPE position embeddings as the graphs' extra input,
vLLM's processor and declaration) is the shared Qwen-VL path's (:mod:`.qwen_vl_base`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLProcessor
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from vllm.multimodal import MULTIMODAL_REGISTRY

from rbln_ray.common.artifact_files import HF_CONFIG, RBLN_CONFIG
from rbln_ray.families.qwen_vl_base import (
    MRopeEmbedder,
    QwenVLCode,
    sectioned_mrope_text,
    vision_max_patches,
)
from rbln_ray.families.qwen_vl_processor import WithoutTorchvision
from rbln_ray.families.qwen_vl_rope import media
from rbln_ray.families.qwen_vl_vllm import (
    MRopeDeclaration,
    QwenVLDummyInputs,
    QwenVLMultiModalProcessor,
    QwenVLProcessingInfo,
)
from rbln_ray.families.vision_base import image_processor_settings

# The tiny model's windows: 56 pixels, 4 x 4 patches (2 x 2 merged tokens); its last layer
# attends over the whole image.
TINY_WINDOW = 56
# transformers' smart_resize refuses images more than this many times longer than wide
MAX_ASPECT = 200


class Qwen2_5_VLPilProcessor(WithoutTorchvision, Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` without torchvision: PIL images, numpy videos."""


# ----------------------------------------------------------------------------- tower length
def window_padded(h: int, w: int, merge: int, window: int, patch: int) -> int:
    """Patches optimum-rbln's tower runs for one temporal patch of an ``h x w`` patch grid:
    each attention window padded to ``(window / patch)^2`` patches (windows of merged tokens,
    as transformers' ``get_vision_window_index`` cuts them)."""
    side = window // merge // patch  # merged tokens along a window's side
    windows = math.ceil(h // merge / side) * math.ceil(w // merge / side)
    return windows * (window // patch) ** 2


def tower_lengths(max_pixels: int, patch: int, merge: int, window: int) -> list[int]:
    """The tower lengths to compile: the budget's patches rounded up to whole windows (what
    most images run) and the longest window-padded length of any grid within the budget
    (``max_pixels``; aspect ratio at most 200, as the processor allows)."""
    per_window = (window // patch) ** 2
    most = max_pixels // (patch * merge) ** 2  # merged tokens of the budget
    square = math.ceil(most * merge**2 / per_window) * per_window
    worst = max(
        window_padded(rows * merge, cols * merge, merge, window, patch)
        for rows in range(1, most + 1)
        for cols in range(1, most // rows + 1)
        if max(rows, cols) <= MAX_ASPECT * min(rows, cols)
    )
    return sorted({square, worst})


def vision_rbln_config(hf_dir: str | Path) -> dict[str, Any]:
    """The vision tower's compile settings: every length :func:`tower_lengths` names."""
    vision = json.loads((Path(hf_dir) / HF_CONFIG).read_text())["vision_config"]
    settings = image_processor_settings(hf_dir)
    max_pixels = (settings.get("size") or {}).get("longest_edge") or settings.get("max_pixels")
    lengths = tower_lengths(
        int(max_pixels),
        int(settings.get("patch_size", vision["patch_size"])),
        int(settings.get("merge_size", vision["spatial_merge_size"])),
        int(vision["window_size"]),
    )
    return {"visual": {"max_seq_len": lengths}}


@cache
def max_tower_length(model_dir: str) -> int:
    """The longest tower call a model directory takes: its compiled largest ``max_seq_len``,
    or (an HF directory, compiled on first use) what the compile will give it."""
    if (Path(model_dir) / RBLN_CONFIG).is_file():
        return vision_max_patches(model_dir)
    return max(vision_rbln_config(model_dir)["visual"]["max_seq_len"])


# ----------------------------------------------------------------------------- runner
class Embedder(MRopeEmbedder):
    """Positions by ``Qwen2_5_VLModel.get_rope_index``, whose videos' temporal positions
    step by their seconds per temporal patch."""

    ROPE_MODEL = Qwen2_5_VLModel

    @classmethod
    def rope_extra(cls, features: Sequence[Any]) -> dict[str, Any]:
        seconds = [
            float(f.data["second_per_grid_ts"].data)
            for f in media(features)
            if f.modality == "video"
        ]
        return {"second_per_grid_ts": torch.tensor(seconds)} if seconds else {}


# ----------------------------------------------------------------------------- vLLM
class Qwen2_5_VLProcessingInfo(QwenVLProcessingInfo):
    """The Qwen families', with window-padded tower lengths."""

    CONFIG = Qwen2_5_VLConfig
    PROCESSOR = Qwen2_5_VLPilProcessor

    def max_patches(self) -> int:
        return max_tower_length(self.ctx.model_config.model)

    def tower_length(self, h: int, w: int) -> int:
        vision = self.get_hf_config().vision_config
        return window_padded(h, w, vision.spatial_merge_size, vision.window_size, vision.patch_size)

    def describe(self, h: int, w: int) -> str:
        return (
            f"{h * w} patches ({h} x {w} after resizing), {self.tower_length(h, w)} patches "
            "with its attention windows padded"
        )


@MULTIMODAL_REGISTRY.register_processor(
    QwenVLMultiModalProcessor, info=Qwen2_5_VLProcessingInfo, dummy_inputs=QwenVLDummyInputs
)
class RBLNQwen2_5_VLDeclaration(MRopeDeclaration):
    """``Qwen2_5_VLForConditionalGeneration`` as vLLM's registry and front end see it on RBLN
    (vLLM 0.30's own ``qwen2_5_vl`` imports torchvision through ``qwen2_vl``)."""

    EMBEDDER = Embedder


# ----------------------------------------------------------------------------- family code
class WindowedTower:
    """The contract's tower for a windowed tower (Qwen2.5-VL's, EXAONE-4.5's): every length
    :func:`tower_lengths` names. Mixed in before the family's contract class."""

    def vision_rbln_config(self, hf_dir: str | Path) -> dict[str, Any]:
        return vision_rbln_config(hf_dir)

    @staticmethod
    def tiny_vision(spec: Any, **extra: Any) -> dict[str, Any]:
        """A tiny windowed tower: the spec's shape, SwiGLU MLP, 14-pixel patches merged
        2 x 2, layers attending within :data:`TINY_WINDOW`-pixel windows but the last."""
        return dict(
            depth=spec.vision_layers,
            hidden_size=spec.vision_hidden_size,
            intermediate_size=2 * spec.vision_hidden_size,
            num_heads=spec.vision_heads,
            out_hidden_size=spec.language.hidden_size,  # the merger's output: the LM's embeddings
            patch_size=spec.patch_size,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=TINY_WINDOW,
            fullatt_block_indexes=[spec.vision_layers - 1],
            initializer_range=spec.language.initializer_range,
            **extra,
        )


class Qwen2_5_VL(WindowedTower, QwenVLCode):
    PROCESSOR = Qwen2_5_VLPilProcessor
    Embedder = Embedder

    def tiny_model(self, spec: Any, tokenizer: Any) -> tuple[Any, Any]:
        """Qwen2.5-VL's recipe at the spec's shape: Qwen2-VL's, with a SwiGLU vision tower
        whose first layers attend within 56-pixel windows and whose last layer sees the whole
        image."""
        import transformers

        # spatial_patch_size: optimum-rbln 0.12's tower reads it
        vision = self.tiny_vision(spec, spatial_patch_size=spec.patch_size, tokens_per_second=2)
        config = transformers.Qwen2_5_VLConfig(
            text_config=sectioned_mrope_text(spec, tokenizer),
            vision_config=vision,
            tie_word_embeddings=False,
            **self.token_ids(tokenizer),
        )
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
        return model, self.tiny_processor(spec, tokenizer)


CODE = Qwen2_5_VL()
