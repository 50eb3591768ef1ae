"""vLLM's view of the Qwen vision-language families on RBLN: the multimodal processor (how an
image or a video becomes placeholder tokens, and which ones the compiled tower refuses), its
dummy inputs, and the declaration vLLM's registry inspects.

Why rbln-ray's own: vLLM 0.30's ``qwen2_vl`` module (and every Qwen family's, which imports
it) needs torchvision, which the project venv cannot have. A family subclasses
:class:`QwenVLProcessingInfo` with its config and processor classes (and, for a windowed
tower, how many patches the tower runs for an image: :meth:`QwenVLProcessingInfo.
tower_length`) and registers its declaration with the processor and dummy inputs here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any, ClassVar

import torch
from transformers import BatchFeature
from vllm.config.multimodal import BaseDummyOptions
from vllm.inputs import MultiModalDataDict
from vllm.model_executor.models.interfaces import SupportsMRoPE, SupportsMultiModal
from vllm.multimodal.inputs import (
    MultiModalFeatureSpec,
    MultiModalFieldConfig,
    MultiModalKwargsItems,
)
from vllm.multimodal.parse import ImageProcessorItems, MultiModalDataItems, VideoProcessorItems
from vllm.multimodal.processing import (
    BaseMultiModalProcessor,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
)

from rbln_ray.families.image_frontend import ImageDummyInputs, ImageProcessingInfo
from rbln_ray.families.qwen_vl_base import MRopeEmbedder, QwenVLCode, vision_max_patches
from rbln_ray.families.qwen_vl_rope import rope_index
from rbln_ray.families.vision_base import Declaration


class QwenVLProcessingInfo(ImageProcessingInfo):
    """Images resized to multiples of ``patch_size x merge_size`` within the processor's
    pixel budget; one token per ``merge_size^2`` patches. A family sets its config and
    processor classes (``CONFIG``, ``PROCESSOR``)."""

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None, "video": None} if self.PROCESSOR.VIDEOS else {"image": None}

    def merge_size(self) -> int:
        return self.get_hf_config().vision_config.spatial_merge_size

    def max_patches(self) -> int:
        """Patches the compiled vision tower takes per call (its largest ``max_seq_len``)."""
        return _compiled_max_patches(self.ctx.model_config.model)

    def tower_length(self, h: int, w: int) -> int:
        """Patches the vision tower runs for one temporal patch of an ``h x w`` patch grid
        (it runs one call per temporal patch)."""
        return h * w

    def describe(self, h: int, w: int) -> str:
        """How a refused image's size is named (its patches, and what the tower runs)."""
        return f"{h * w} patches ({h} x {w} after resizing)"

    def check_fits(self, what: str, t: int, h: int, w: int) -> None:
        """Refuse an item the compiled vision tower cannot take (optimum's tower would raise
        inside the engine), naming both sizes."""
        most = self.max_patches()
        if self.tower_length(h, w) > most:
            raise ValueError(
                f"{what} is {self.describe(h, w)}, more than the {most} patches per image "
                "the compiled vision tower takes; send a smaller image or lower max_pixels"
            )

    def largest_image(self) -> tuple[int, int, int]:
        """``(width, height, tokens)`` of the image with the most tokens served: as many as
        the processor's pixel budget makes and the compiled tower takes (a larger image is
        refused), factored into the squarest grid of merged patches (vLLM's own Qwen2-VL does
        the same; a square image of the budget would round down)."""
        processor = self.get_hf_processor().image_processor
        merge = processor.merge_size
        unit = processor.patch_size * merge
        most = min(processor.size["longest_edge"] // (unit * unit), self.max_patches() // merge**2)
        for tokens in range(most, 0, -1):  # windowed towers: the squarest grid must fit too
            rows = next(d for d in range(math.isqrt(tokens), 0, -1) if tokens % d == 0)
            if self.tower_length(rows * merge, tokens // rows * merge) <= self.max_patches():
                return unit * (tokens // rows), unit * rows, tokens
        raise ValueError(f"the compiled vision tower takes no image ({self.max_patches()} patches)")

    def dummy_image_size(self) -> tuple[int, int]:
        width, height, _ = self.largest_image()
        return width, height

    def largest_video(self, seq_len: int) -> tuple[int, int, int, int]:
        """``(width, height, frames, tokens)`` of the longest video served: frames of the
        largest image, as many temporal patches of them as fit ``seq_len`` (at least one)."""
        width, height, tokens = self.largest_image()
        patches = max(1, seq_len // tokens)
        frames = patches * self.get_hf_processor().image_processor.temporal_patch_size
        return width, height, frames, patches * tokens

    def get_mm_max_tokens_per_item(
        self, seq_len: int, mm_counts: Mapping[str, int]
    ) -> Mapping[str, int]:
        most = {"image": self.largest_image()[2]}
        if "video" in self.get_supported_mm_limits():
            # no video of the model's length has more tokens (frames share Qwen3-VL's budget)
            most["video"] = max(seq_len, self.largest_video(seq_len)[3])
        return most


@cache
def _compiled_max_patches(model: str) -> int:
    return vision_max_patches(model)


class QwenVLDummyInputs(ImageDummyInputs):
    """The images' profiling inputs, and videos of the longest the budget takes."""

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        video = self.info.get_hf_processor().video_token * mm_counts.get("video", 0)
        return super().get_dummy_text(mm_counts) + video

    def get_dummy_mm_data(
        self,
        seq_len: int,
        mm_counts: Mapping[str, int],
        mm_options: Mapping[str, BaseDummyOptions],
    ) -> MultiModalDataDict:
        images = super().get_dummy_mm_data(seq_len, mm_counts, mm_options)["image"]
        if not mm_counts.get("video"):
            return {"image": images}
        width, height, frames, _ = self.info.largest_video(seq_len)
        videos = self._get_dummy_videos(
            width=width,
            height=height,
            num_frames=frames,
            num_videos=mm_counts["video"],
            overrides=mm_options.get("video"),
        )
        return {"image": images, "video": videos}


class QwenVLMultiModalProcessor(BaseMultiModalProcessor[QwenVLProcessingInfo]):
    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        grids = hf_inputs.get("image_grid_thw", torch.empty((0, 3)))
        videos = hf_inputs.get("video_grid_thw", torch.empty((0, 3)))
        fields = {
            "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", grids.prod(-1)),
            "image_grid_thw": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
            "pixel_values_videos": MultiModalFieldConfig.flat_from_sizes("video", videos.prod(-1)),
            "video_grid_thw": MultiModalFieldConfig.batched("video", keep_on_cpu=True),
        }
        if "second_per_grid_ts" in hf_inputs:  # Qwen2.5-VL: seconds per temporal patch
            fields["second_per_grid_ts"] = MultiModalFieldConfig.batched("video", keep_on_cpu=True)
        return fields

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargsItems,
    ) -> Sequence[PromptUpdate]:
        image_token = self.info.get_hf_config().image_token_id
        merge = self.info.merge_size()
        if "image" in mm_items:  # pixels only, no precomputed embeddings
            mm_items.get_items("image", ImageProcessorItems)

        def replacement(i: int) -> list[int]:
            t, h, w = (int(x) for x in out_mm_kwargs["image"][i]["image_grid_thw"].data)
            self.info.check_fits(f"image {i}", t, h, w)
            return [image_token] * (t * h * w // (merge * merge))

        updates = [
            PromptReplacement(modality="image", target=[image_token], replacement=replacement)
        ]
        if "video" not in self.info.get_supported_mm_limits():
            return updates
        video_token = self.info.get_hf_config().video_token_id
        processor = self.info.get_hf_processor(**hf_processor_mm_kwargs)
        tokenizer = self.info.get_tokenizer()
        videos = mm_items.get_items("video", VideoProcessorItems) if "video" in mm_items else None
        fps = hf_processor_mm_kwargs.get("fps")

        def video_replacement(i: int) -> PromptUpdateDetails:
            grid = out_mm_kwargs["video"][i]["video_grid_thw"].data
            t, h, w = (int(x) for x in grid)
            self.info.check_fits(f"video {i}", t, h, w)
            frames = videos.get(i) if videos is not None else None
            video_processor = processor.video_processor
            count = len(frames) if frames is not None else t * video_processor.temporal_patch_size
            metadata = video_processor.metadata(count, fps)
            # transformers' own placeholder text (Qwen3-VL: a timestamp and the frame's
            # tokens per temporal patch), whose video tokens take the video's features
            text = processor.replace_video_token(
                {"video_grid_thw": grid.view(1, 3), "video_metadata": [metadata]}, 0
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
            return PromptUpdateDetails.select_token_id(ids, video_token)

        updates.append(
            PromptReplacement(modality="video", target=[video_token], replacement=video_replacement)
        )
        return updates


class MRopeDeclaration(Declaration, SupportsMultiModal, SupportsMRoPE):
    """A Qwen family's ``*ForConditionalGeneration`` as vLLM's registry and front end see it
    on RBLN (a family subclasses it with its ``EMBEDDER`` and registers it with vLLM's
    multimodal registry).

    Constructible (it holds the HF config only) so that its M-RoPE contract,
    :meth:`get_mrope_input_positions`, is vLLM's own interface; the RBLN runner computes the
    same positions with the same function (the family's embedder).
    """

    PLACEHOLDERS = {"image": QwenVLCode.PLACEHOLDER, "video": QwenVLCode.VIDEO_PLACEHOLDER}
    EMBEDDER: ClassVar[type[MRopeEmbedder]]  # whose positions these are

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        torch.nn.Module.__init__(self)
        self.config = vllm_config.model_config.hf_config

    def get_mrope_input_positions(
        self, input_tokens: list[int], mm_features: list[MultiModalFeatureSpec]
    ) -> tuple[torch.Tensor, int]:
        embedder = self.EMBEDDER
        extra = embedder.rope_extra(mm_features)
        return rope_index(embedder.ROPE_MODEL, self.config, input_tokens, mm_features, **extra)
