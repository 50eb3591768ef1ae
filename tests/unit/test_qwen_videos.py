"""Videos of the Qwen families without torchvision: rbln-ray's numpy port of transformers'
Qwen video processors (``rbln_ray.families.qwen_vl_processor.NumpyVideoProcessor``) against the
image processor it builds on, and a video's M-RoPE positions (``rope_index`` from vLLM's view
of a request) against transformers' ``get_rope_index`` called as ``generate`` calls it.

The model side (features, positions, decode) is checked end to end by
``tests/vllm_plugin/test_vision_language.py``; here the pieces whose reference is
transformers' own code."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2VLImageProcessorPil, Qwen3VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

IMAGE, VIDEO, START, END, TEXT = 9, 8, 7, 6, 1
MERGE = 2


def _families():
    # imported inside the tests (see tests/unit/test_mrope.py: vLLM's platform)
    from rbln_ray.families import qwen_vl_processor, qwen_vl_rope

    return types.SimpleNamespace(
        NumpyVideoProcessor=qwen_vl_processor.NumpyVideoProcessor,
        rope_index=qwen_vl_rope.rope_index,
    )


def _image_processor(patch: int = 14) -> Qwen2VLImageProcessorPil:
    unit = patch * MERGE
    return Qwen2VLImageProcessorPil(
        min_pixels=(2 * unit) ** 2, max_pixels=unit**2 * 64, patch_size=patch, merge_size=MERGE
    )


def _frames(count: int, height: int = 48, width: int = 64, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (count, height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize("budget", ["frame", "video"])
def test_two_identical_frames_are_the_image(budget: str) -> None:
    """The image processor gives an image one temporal patch of two equal frames; the video
    port must give those rows for a video of two equal frames (same resize, rescale,
    normalize, patch layout)."""
    ip = _image_processor(16 if budget == "video" else 14)
    frame = _frames(1)[0]
    video = _families().NumpyVideoProcessor(ip, budget)(np.stack([frame, frame]))
    image = ip(images=[frame], return_tensors="pt")
    assert torch.equal(video["pixel_values_videos"], image["pixel_values"])
    assert video["video_grid_thw"].tolist() == image["image_grid_thw"].tolist()


def test_frames_pad_to_whole_temporal_patches_and_keep_their_order() -> None:
    ip = _image_processor()
    processor = _families().NumpyVideoProcessor(ip, "frame")
    frames = _frames(3)
    odd = processor(frames)
    padded = processor(np.concatenate([frames, frames[-1:]]))
    assert odd["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert torch.equal(odd["pixel_values_videos"], padded["pixel_values_videos"])
    (meta,) = odd["video_metadata"]
    assert (meta.total_num_frames, meta.fps, meta.frames_indices) == (3, 2.0, [0, 1, 2])
    # frames keep their order: the first temporal patch is frames 0 and 1, not 0 and 2
    swapped = processor(frames[[0, 2, 1]])["pixel_values_videos"]
    assert not torch.equal(swapped[:16], odd["pixel_values_videos"][:16])


def test_a_video_budget_is_shared_by_its_frames() -> None:
    """Qwen3-VL's processor sizes a video within the budget over all its frames (so a long
    video has smaller frames); Qwen2-VL's gives every frame the whole budget."""
    ip = _image_processor(16)
    frames = _frames(16, 224, 224)
    shared = _families().NumpyVideoProcessor(ip, "video")(frames)["video_grid_thw"]
    each = _families().NumpyVideoProcessor(ip, "frame")(frames)["video_grid_thw"]
    assert shared[0, 1] * shared[0, 2] < each[0, 1] * each[0, 2]
    t, h, w = shared[0].tolist()
    assert t * 2 * h * w * 16 * 16 <= 32 * 32 * 64


def _feature(modality: str, offset: int, length: int, grid, is_embed=None, **extra):
    """vLLM's ``MultiModalFeatureSpec`` of an item, as the engine hands it to the runner."""
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalFieldElem,
        MultiModalKwargsItem,
        MultiModalSharedField,
        PlaceholderRange,
    )

    field = MultiModalSharedField(batch_size=1)
    fields = {f"{modality}_grid_thw": MultiModalFieldElem(data=torch.tensor(grid), field=field)}
    for key, value in extra.items():
        fields[key] = MultiModalFieldElem(data=torch.tensor(value), field=field)
    return MultiModalFeatureSpec(
        data=MultiModalKwargsItem(fields),
        modality=modality,
        identifier=f"{modality}{offset}",
        mm_position=PlaceholderRange(offset=offset, length=length, is_embed=is_embed),
    )


def _reference(model_cls, config, tokens: list[int], **grids) -> tuple[torch.Tensor, int]:
    """transformers' positions as ``generate`` computes them: the processor's
    ``mm_token_type_ids`` (by token id) and the grids."""
    model = types.SimpleNamespace(config=config)
    model.get_vision_position_ids = types.MethodType(model_cls.get_vision_position_ids, model)
    ids = torch.tensor([tokens])
    types_ = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    positions, delta = model_cls.get_rope_index(model, ids, types_, **grids)
    return positions[:, 0], int(delta.item())


def test_qwen2_5_video_positions_step_by_their_seconds_and_text_resumes_as_transformers() -> None:
    """Qwen2.5-VL: a video's temporal positions step by tokens_per_second x seconds per
    temporal patch (truncated), and the text after it resumes at its start plus its larger
    side, not past its largest position (vLLM 0.30's own rule): rbln-ray's positions from
    vLLM's features are transformers'."""
    from rbln_ray.families.qwen2_5_vl import Embedder

    config = Qwen2_5_VLConfig(vision_config={"spatial_merge_size": MERGE, "tokens_per_second": 2})
    video, image = (3, 4, 6), (1, 4, 4)  # temporal patches x rows x columns of patches
    n_video, n_image = 3 * 4 * 6 // 4, 4
    tokens = [TEXT] * 3 + [START] + [VIDEO] * n_video + [END] + [TEXT] * 2
    tokens += [START] + [IMAGE] * n_image + [END] + [TEXT] * 4
    seconds = [1.5]
    features = [
        _feature("video", 4, n_video, video, second_per_grid_ts=seconds[0]),
        _feature("image", 4 + n_video + 3 + 1, n_image, image),
    ]
    want, want_delta = _reference(
        Qwen2_5_VLModel,
        config,
        tokens,
        image_grid_thw=torch.tensor([image]),
        video_grid_thw=torch.tensor([video]),
        second_per_grid_ts=torch.tensor(seconds),
    )
    extra = Embedder.rope_extra(features)
    got, delta = _families().rope_index(Qwen2_5_VLModel, config, tokens, features, **extra)
    assert torch.equal(got, want) and delta == want_delta
    assert want[0, 4 + n_video // 3] - want[0, 4] == 2  # 2 tokens/s x int(1.5 s)


def test_qwen3_video_frames_are_positioned_one_by_one_between_their_timestamps() -> None:
    """Qwen3-VL: a video's placeholder is, per temporal patch, a timestamp text and the
    frame's tokens between vision markers; only the frame tokens are the video's (vLLM's
    ``is_embed``), and transformers positions each frame like an image."""
    config = Qwen3VLConfig(vision_config={"spatial_merge_size": MERGE})
    grid, per_frame, stamp = (2, 4, 4), 4, [TEXT, TEXT, TEXT]  # "<0.2 seconds>" as 3 tokens
    placeholder = []
    for _ in range(grid[0]):
        placeholder += stamp + [START] + [VIDEO] * per_frame + [END]
    tokens = [TEXT] * 2 + [START] + placeholder + [END] + [TEXT] * 3
    is_embed = torch.tensor([t == VIDEO for t in placeholder])
    features = [_feature("video", 3, len(placeholder), grid, is_embed=is_embed)]
    want, want_delta = _reference(Qwen3VLModel, config, tokens, video_grid_thw=torch.tensor([grid]))
    got, delta = _families().rope_index(Qwen3VLModel, config, tokens, features)
    assert torch.equal(got, want) and delta == want_delta
