"""Qwen2-VL on RBLN: images of any size as a variable number of tokens, M-RoPE positions, and
transformers' processor without its video half.

What differs from LLaVA (:mod:`.llava`), everywhere a request goes:

* **Processor.** transformers 5.15's ``Qwen2VLProcessor`` takes an image processor, a
  tokenizer *and* a video processor, and refuses to be built or loaded without the last;
  every video processor of transformers 5.15 needs torchvision, which the project venv cannot
  have. :class:`Qwen2VLPilProcessor` declares just the image processor
  (``Qwen2VLImageProcessorPil``: PIL and numpy) and the tokenizer; every step of processing a
  prompt is transformers' own, and it saves itself as ``Qwen2VLProcessor``.
* **Tokens per image.** The processor resizes an image to multiples of 28 pixels within its
  pixel budget and the tower merges 2 x 2 patches of 14 pixels into one token; optimum-rbln
  compiles the tower for a maximum number of patches per image (:func:`vision_max_patches`,
  from the processor's budget), and a larger image is refused before it reaches the engine.
* **M-RoPE.** The language model rotates by three positions per token (temporal, height,
  width): text tokens have all three equal and consecutive, an image's tokens the image's
  start plus their row and column, and text after an image continues from there. Positions
  run behind token indices by a per-request ``delta``. They are transformers' own
  ``get_rope_index`` (:func:`rope_index`: the function ``generate`` and optimum-rbln's prefill
  use; vLLM 0.30's own M-RoPE differs from it for videos), called on a stand-in holding the
  HF config. vLLM asks the model for them (``SupportsMRoPE.get_mrope_input_positions``) and
  vLLM 0.30's own ``qwen2_vl`` module cannot be imported here (torchvision), so the
  declaration and the RBLN runner both use this function; optimum-rbln 0.12's graphs take
  them as one more input, ``position_emb`` (cos and sin, computed on the host by the model's
  own method), at every prefill chunk and decode step. KV positions stay token positions, so
  the scheduler, the KV blocks, chunked prefill and prefix caching are the text path's.
* **Where the decoder is.** ``RBLNQwen2VLForConditionalGeneration`` is itself the decoder;
  its vision tower is the ``visual`` submodule (the registry record says so).

The later Qwen families (:mod:`.qwen2_5_vl`, :mod:`.qwen3_vl`) subclass the processor, the
embedder and vLLM's classes here with their own transformers classes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from types import MethodType, SimpleNamespace
from typing import Any, TypedDict

import numpy as np
import torch
from transformers import BatchFeature, ProcessorMixin, Qwen2VLConfig, Qwen2VLProcessor
from transformers.image_transforms import resize as np_resize
from transformers.image_utils import ChannelDimension
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel
from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
    smart_resize as smart_resize_video,
)
from transformers.video_utils import VideoMetadata, make_batched_videos
from vllm.config.multimodal import BaseDummyOptions
from vllm.inputs import MultiModalDataDict
from vllm.model_executor.models.interfaces import SupportsMRoPE, SupportsMultiModal
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import (
    MultiModalFeatureSpec,
    MultiModalFieldConfig,
    MultiModalKwargsItems,
)
from vllm.multimodal.parse import ImageProcessorItems, MultiModalDataItems, VideoProcessorItems
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
)

from rbln_ray.common.artifact_files import RBLN_CONFIG
from rbln_ray.families.vision_base import Declaration, PromptEmbedder, image_processor_settings
from rbln_ray.upstream import optimum_internals

# Qwen2-VL's special tokens (its processor looks the image token up by this name) and what
# one image is in its prompts: the placeholder between the vision start and end markers.
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
VIDEO_PLACEHOLDER = VISION_START + VIDEO_PAD + VISION_END
SPECIAL_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
# The tiny model's pixel budget: at most 256 patches (64 image tokens) per image.
TINY_MAX_PIXELS = 28 * 28 * 64
MIN_PIXELS = 56 * 56  # Qwen2-VL's own minimum
SPEC_DEFAULTS = {"max_pixels": TINY_MAX_PIXELS}


# ----------------------------------------------------------------------------- processor
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


class Qwen2VLPilProcessor(WithoutTorchvision, Qwen2VLProcessor):
    """``Qwen2VLProcessor`` without torchvision: PIL images, numpy videos."""


def load_processor(model_dir: str | Path, **kwargs: Any) -> Qwen2VLPilProcessor:
    """A Qwen2-VL directory's processor (images and text; see the module docstring)."""
    return Qwen2VLPilProcessor.from_pretrained(str(model_dir), **kwargs)


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
# transformers' mm_token_type_ids: what each prompt token is (text 0, image 1, video 2)
MODALITY_TYPES = {"image": 1, "video": 2}


def media(features: Sequence[Any]) -> list[Any]:
    """A request's images (and videos) in prompt order, from vLLM's ``MultiModalFeatureSpec``
    list, each with its patch grid (``*_grid_thw`` is kept on the CPU even when the prefix
    cache drops an item's pixels, for the positions)."""
    items = sorted(features, key=lambda f: f.mm_position.offset)
    for f in items:
        if f.modality not in MODALITY_TYPES:
            raise ValueError(f"{f.modality} inputs are not supported")
        if f.data is None or f"{f.modality}_grid_thw" not in f.data:
            raise RuntimeError(f"{f.modality} {f.identifier} arrived without its grid_thw")
    return items


def grid_of(feature: Any) -> tuple[int, int, int]:
    """``(t, h, w)``: an image's or a video's grid of patches (temporal patches, rows, columns)."""
    t, h, w = (int(x) for x in feature.data[f"{feature.modality}_grid_thw"].data.tolist())
    return t, h, w


def rope_index(
    rope_model: type,
    config: Any,
    token_ids: Sequence[int],
    features: Sequence[Any],
    **extra: Any,
) -> tuple[torch.Tensor, int]:
    """``([3, len(token_ids)] int64 positions, delta)`` of a prompt, by transformers' own
    ``rope_model.get_rope_index`` (e.g. ``Qwen2VLModel``'s): what ``generate`` and optimum-rbln's
    prefill use, so positions follow each family's rule exactly (vLLM 0.30's own differ from
    transformers 5.15's for videos: where text resumes after a video and how its temporal
    positions round). ``delta`` is what later positions add to their token index.

    The function reads only the model's config and its ``get_vision_position_ids`` (which
    uses no state), so it runs on a stand-in holding the HF config: in vLLM's front end (the
    declaration) and in the RBLN runner alike. Which tokens are an item's comes from the
    item's placeholder range (the tokens it embeds at, ``is_embed``), as transformers' processor
    marks them by token id; its grids go in prompt order. ``extra``: the family's other
    arguments (Qwen2.5-VL's ``second_per_grid_ts``).
    """
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    types = torch.zeros_like(ids, dtype=torch.int)
    grids: dict[str, list[tuple[int, int, int]]] = {"image": [], "video": []}
    for f in media(features):
        where = f.mm_position
        if where.offset + where.length > ids.shape[1]:
            raise ValueError(
                f"{f.modality} {f.identifier} ends at token {where.offset + where.length}, past "
                f"the prompt's {ids.shape[1]}"
            )
        span = torch.arange(where.offset, where.offset + where.length)
        if where.is_embed is not None:
            span = span[where.is_embed]
        if (types[0, span] != 0).any():
            raise ValueError(f"{f.modality} {f.identifier} overlaps another at {where.offset}")
        types[0, span] = MODALITY_TYPES[f.modality]
        grids[f.modality].append(grid_of(f))
    host = SimpleNamespace(config=config)
    host.get_vision_position_ids = MethodType(rope_model.get_vision_position_ids, host)
    positions, delta = rope_model.get_rope_index(
        host,
        ids,
        types,
        image_grid_thw=torch.tensor(grids["image"]) if grids["image"] else None,
        video_grid_thw=torch.tensor(grids["video"]) if grids["video"] else None,
        **extra,
    )
    return positions[:, 0], int(delta.view(-1)[0])


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
    (the decoder is the model itself; its vision tower is ``model.visual``). The other Qwen
    families subclass it with their transformers model (``ROPE_MODEL``, whose
    ``get_rope_index`` gives the positions)."""

    ROPE_MODEL: type = Qwen2VLModel

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.dtype = model.rbln_config.dtype

    @property
    def language_model(self) -> Any:
        return self.model

    def _tower(self, pixels: torch.Tensor, grid: torch.Tensor) -> Any:
        """One image's or video's features: its flattened patches ``[t*h*w, C*T*P*P]`` and
        grid ``[3]`` through the compiled tower (one call per temporal patch); one merged token
        each 2 x 2 patches."""
        return self.model.visual(pixels, grid_thw=grid.view(1, 3))

    def _image_features(self, data: dict[str, torch.Tensor]) -> Any:
        return self._tower(data["pixel_values"], data["image_grid_thw"])

    def _video_features(self, data: dict[str, torch.Tensor]) -> Any:
        return self._tower(data["pixel_values_videos"], data["video_grid_thw"])

    @classmethod
    def rope_extra(cls, features: Sequence[Any]) -> dict[str, Any]:
        """The family's further arguments of ``get_rope_index`` (none for Qwen2-VL)."""
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


# ----------------------------------------------------------------------------- vLLM
class Qwen2VLProcessingInfo(BaseProcessingInfo):
    """Qwen2-VL: images resized to multiples of ``patch_size x merge_size`` within the
    processor's pixel budget; one token per ``merge_size^2`` patches. The other Qwen families
    subclass it with their config and processor classes, and (windowed towers) how many
    patches the tower runs for an image (:meth:`tower_length`)."""

    CONFIG: type = Qwen2VLConfig
    PROCESSOR: type = Qwen2VLPilProcessor

    def get_hf_config(self) -> Any:
        return self.ctx.get_hf_config(self.CONFIG)

    def get_hf_processor(self, **kwargs: object) -> Any:
        return self.ctx.get_hf_processor(self.PROCESSOR, **kwargs)

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


class Qwen2VLDummyInputs(BaseDummyInputsBuilder[Qwen2VLProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        processor = self.info.get_hf_processor()
        return processor.image_token * mm_counts.get("image", 0) + (
            processor.video_token * mm_counts.get("video", 0)
        )

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


class Qwen2VLMultiModalProcessor(BaseMultiModalProcessor[Qwen2VLProcessingInfo]):
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


@MULTIMODAL_REGISTRY.register_processor(
    Qwen2VLMultiModalProcessor, info=Qwen2VLProcessingInfo, dummy_inputs=Qwen2VLDummyInputs
)
class RBLNQwen2VLDeclaration(Declaration, SupportsMultiModal, SupportsMRoPE):
    """``Qwen2VLForConditionalGeneration`` as vLLM's registry and front end see it on RBLN.

    Constructible (it holds the HF config only) so that its M-RoPE contract,
    :meth:`get_mrope_input_positions`, is vLLM's own interface; the RBLN runner computes the
    same positions with the same function (:class:`Embedder`).
    """

    EMBEDDER: type[Embedder] = Embedder  # whose positions these are

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = vllm_config.model_config.hf_config

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality.startswith("image"):
            return PLACEHOLDER
        if modality.startswith("video"):
            return VIDEO_PLACEHOLDER
        raise ValueError("only image and video inputs are supported")

    def get_mrope_input_positions(
        self, input_tokens: list[int], mm_features: list[MultiModalFeatureSpec]
    ) -> tuple[torch.Tensor, int]:
        embedder = self.EMBEDDER
        extra = embedder.rope_extra(mm_features)
        return rope_index(embedder.ROPE_MODEL, self.config, input_tokens, mm_features, **extra)


# ----------------------------------------------------------------------------- tiny model
def token_ids(tokenizer: Any) -> dict[str, int]:
    """The Qwen special tokens' ids, as the configs name them."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return {
        "image_token_id": ids[IMAGE_PAD],
        "video_token_id": ids[VIDEO_PAD],
        "vision_start_token_id": ids[VISION_START],
        "vision_end_token_id": ids[VISION_END],
    }


def tiny_text(spec: Any, tokenizer: Any) -> dict[str, Any]:
    """The language model's config of a tiny Qwen2-VL or Qwen2.5-VL: a Qwen2 decoder of the
    spec's shape with M-RoPE sections of its rotary dimensions (Qwen2-VL's [16, 24, 24] of
    64, scaled)."""
    language = spec.language
    head_dim = language.hidden_size // language.num_heads
    pairs = head_dim // 2
    temporal = pairs // 4
    section = [temporal, (pairs - temporal) // 2, pairs - temporal - (pairs - temporal) // 2]
    return dict(
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


def tiny_image_processor(spec: Any, min_pixels: int = MIN_PIXELS) -> Any:
    """transformers' PIL Qwen2-VL image processor with the spec's patch and pixel budget."""
    import transformers

    return transformers.Qwen2VLImageProcessorPil(
        min_pixels=min_pixels,
        max_pixels=spec.max_pixels,
        patch_size=spec.patch_size,
        merge_size=2,
        temporal_patch_size=2,
    )


def tiny_model(spec: Any, tokenizer: Any) -> tuple[Any, Any]:
    """Qwen2-VL's recipe at the spec's shape: a ViT over 14-pixel patches (two frames per
    temporal patch) with 2-D rotary positions, 2 x 2 patches merged into one token by an MLP,
    a Qwen2 language model with M-RoPE (temporal, height, width sections of the rotary
    dimensions)."""
    import transformers

    language = spec.language
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
        text_config=tiny_text(spec, tokenizer),
        vision_config=vision,
        tie_word_embeddings=False,
        **token_ids(tokenizer),
    )
    processor = Qwen2VLPilProcessor(
        image_processor=tiny_image_processor(spec),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )
    return transformers.Qwen2VLForConditionalGeneration(config), processor
