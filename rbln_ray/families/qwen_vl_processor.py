"""Qwen-style HF processors without torchvision: transformers' processors with rbln-ray's numpy
port of their video processor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and the families built on them,
EXAONE-4.5 included).

Why: transformers 5.15's Qwen processors take an image processor, a tokenizer *and* a video
processor, and refuse to be built or loaded without the last; every video processor of
transformers 5.15 needs torchvision, which the project venv cannot have. A family's processor
is ``class X(WithoutTorchvision, <transformers processor>)``: it declares just the image
processor (PIL and numpy) and the tokenizer, every step of processing a prompt is
transformers' own, videos go through :class:`NumpyVideoProcessor`, and it saves itself as
the transformers class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import numpy as np
import torch
from transformers import BatchFeature, ProcessorMixin
from transformers.image_transforms import resize as np_resize
from transformers.image_utils import ChannelDimension
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
    smart_resize as smart_resize_video,
)
from transformers.video_utils import VideoMetadata, make_batched_videos

# Qwen's image and video tokens (its processors look them up by these names) and the markers
# around one image or video in a prompt.
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"


class NumpyVideoProcessor:
    """transformers' Qwen video processors (``Qwen2VLVideoProcessor``, ``Qwen3VLVideoProcessor``)
    without torchvision, which every transformers 5.15 video processor needs.

    Same steps, on numpy and PIL with the model's own image processor: every frame resized to
    the video's size (multiples of ``patch_size x merge_size`` within the pixel budget;
    ``budget="frame"``: each frame's, as Qwen2-VL and Qwen2.5-VL; ``"video"``: over all
    frames, as Qwen3-VL, by transformers' own ``smart_resize`` of each), rescaled and
    normalized as the image processor does (two identical frames give the image's rows),
    padded to whole temporal patches by repeating the last frame and cut into patches in
    transformers' layout. The budget is the image processor's (so every temporal patch fits
    the compiled vision tower, which runs one call per temporal patch), unless a request
    sets ``min_pixels`` / ``max_pixels``. Frames are used as given (no sampling: the caller
    chose them); their rate is ``fps`` (2 per second, the rate transformers' Qwen processors
    sample at, unless a request sets it), which sets the temporal positions (Qwen2.5-VL's
    ``second_per_grid_ts``) and Qwen3-VL's timestamps. Returns transformers' fields and
    ``video_metadata``, which the processors' own ``_process_videos`` / ``replace_video_token``
    read.
    """

    class valid_kwargs(TypedDict, total=False):  # noqa: N801 - transformers' attribute name
        """Request settings the processor's kwargs merge passes on (beyond ``VideosKwargs``)."""

        min_pixels: int
        max_pixels: int

    def __init__(self, image_processor: Any, budget: str = "frame", fps: float = 2.0) -> None:
        if budget not in ("frame", "video"):
            raise ValueError(f"budget must be 'frame' or 'video', not {budget!r}")
        self.image_processor = image_processor
        self.budget = budget
        self.fps = fps
        self.patch_size = image_processor.patch_size
        self.merge_size = image_processor.merge_size
        self.temporal_patch_size = image_processor.temporal_patch_size
        self.size = dict(image_processor.size)

    def metadata(self, num_frames: int, fps: float | None = None) -> VideoMetadata:
        """What transformers knows of a video of ``num_frames`` frames given at ``fps``."""
        return VideoMetadata(
            total_num_frames=num_frames,
            fps=float(fps or self.fps),
            frames_indices=list(range(num_frames)),
        )

    def resized(self, frames: int, height: int, width: int, least: int, most: int) -> tuple:
        """``(height, width)`` every frame of a video is resized to."""
        factor = self.patch_size * self.merge_size
        if self.budget == "video":
            if frames < self.temporal_patch_size:
                raise ValueError(
                    f"a video needs at least {self.temporal_patch_size} frames, not {frames}"
                )
            return smart_resize_video(
                frames, height, width, self.temporal_patch_size, factor, least, most
            )
        return smart_resize(height, width, factor=factor, min_pixels=least, max_pixels=most)

    def __call__(
        self,
        videos: Any,
        video_metadata: Sequence[Any] | None = None,
        fps: float | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        size: Mapping[str, int] | None = None,
        **_: Any,
    ) -> BatchFeature:
        size = {**self.size, **(size or {})}
        least = min_pixels or size["shortest_edge"]
        most = max_pixels or size["longest_edge"]
        ip = self.image_processor
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        rows, grids, metas = [], [], []
        for i, video in enumerate(make_batched_videos(videos)):
            frames = np.asarray(video)
            if frames.ndim != 4:
                raise ValueError(f"a video is [frames, height, width, 3], not {frames.shape}")
            if frames.shape[-1] != 3 and frames.shape[1] == 3:  # channels first
                frames = frames.transpose(0, 2, 3, 1)
            given = video_metadata[i] if video_metadata else None
            if isinstance(given, Mapping):
                given = VideoMetadata(**{k: v for k, v in given.items() if k in VIDEO_METADATA})
            metas.append(given or self.metadata(len(frames), fps))
            height, width = self.resized(len(frames), *frames.shape[1:3], least, most)
            out = []
            for frame in frames:
                x = np.ascontiguousarray(frame.transpose(2, 0, 1))  # [C, H, W], as the PIL path
                x = np_resize(
                    x,
                    size=(height, width),
                    resample=ip.resample,
                    data_format=ChannelDimension.FIRST,
                    input_data_format=ChannelDimension.FIRST,
                )
                if ip.do_rescale:
                    x = ip.rescale(x, ip.rescale_factor)
                if ip.do_normalize:
                    x = ip.normalize(x, ip.image_mean, ip.image_std)
                out.append(np.asarray(x, dtype=np.float32))
            clip = np.stack(out)  # [T, C, H, W]
            if pad := -len(clip) % tp:
                clip = np.concatenate([clip, np.repeat(clip[-1:], pad, axis=0)])
            t, c = len(clip) // tp, clip.shape[1]
            gh, gw = height // p, width // p
            patches = clip.reshape(t, tp, c, gh // m, m, p, gw // m, m, p)
            patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # transformers' patchify
            rows.append(torch.from_numpy(np.ascontiguousarray(patches).reshape(-1, c * tp * p * p)))
            grids.append([t, gh, gw])
        data = {
            "pixel_values_videos": torch.cat(rows),
            "video_grid_thw": torch.tensor(grids, dtype=torch.long),
            "video_metadata": metas,
        }
        return BatchFeature(data)


# VideoMetadata's fields (a request's metadata may carry others, e.g. vLLM's video_backend)
VIDEO_METADATA = {f.name for f in dataclasses.fields(VideoMetadata)}


class WithoutTorchvision:
    """What makes a Qwen-style processor work without transformers' video processor: the
    attributes transformers' ``__init__`` sets from the tokenizer (``TOKENS``: attribute ->
    default token; each also gets its ``_id``), then ``ProcessorMixin.__init__`` with the image
    processor and the tokenizer only (transformers' own ``__init__`` requires a video
    processor, and every one needs torchvision). transformers 5.15 derives what a processor
    saves and loads from its ``__init__`` signature, so the subclass saves and loads without
    one, and it saves itself as the transformers class (``to_dict``) so any transformers
    install reads it. Videos (``VIDEOS``: the budget of :class:`NumpyVideoProcessor`, "" for
    none) go through rbln-ray's numpy port, built from the image processor, so nothing more
    is saved. Mixed in before the transformers class: ``class X(WithoutTorchvision,
    Qwen2VLProcessor)``."""

    TOKENS: dict[str, str] = {"image_token": IMAGE_PAD, "video_token": VIDEO_PAD}
    VIDEOS = "frame"

    def __init__(
        self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kw
    ) -> None:
        for attr, default in self.TOKENS.items():
            token = getattr(tokenizer, attr, default)
            setattr(self, attr, token)
            token_id = getattr(tokenizer, f"{attr}_id", None)
            setattr(self, f"{attr}_id", token_id or tokenizer.convert_tokens_to_ids(token))
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kw)
        if self.VIDEOS and image_processor is not None:
            self.video_processor = NumpyVideoProcessor(image_processor, self.VIDEOS)

    def to_dict(self) -> dict[str, Any]:
        config = super().to_dict()  # type: ignore[misc]
        saved_as = next(c for c in type(self).__mro__ if c.__module__.startswith("transformers."))
        config["processor_class"] = saved_as.__name__
        return config
