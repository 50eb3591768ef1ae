"""Qwen2-VL's M-RoPE positions (``rbln_ray.families.qwen_vl_rope.rope_index``) against
transformers' own ``Qwen2VLModel.get_rope_index`` called as ``generate`` calls it (what
optimum-rbln's ``_preprocess_prefill`` uses too): on the prompt's token ids with the
processor's ``mm_token_type_ids``. rbln-ray calls the same function from vLLM's view of a
request (its ``MultiModalFeatureSpec`` list: placeholder ranges and grids, one image's pixels
possibly dropped by the prefix cache), through the function, rbln-ray's vLLM declaration
(``SupportsMRoPE``) and the span a prefill chunk or a decode row takes."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import Qwen2VLConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

# vLLM's own classes (and the family module, which declares Qwen2-VL to vLLM) are imported
# inside the tests: importing vllm.multimodal at collection (before the session fixture
# selects the emulator) would resolve vLLM's platform as plain CPU for every later test of
# the session.


def _rope():
    from rbln_ray.families import qwen_vl_rope

    return qwen_vl_rope


IMAGE, VIDEO, START = 9, 8, 7  # token ids of <|image_pad|>, <|video_pad|>, <|vision_start|>
MERGE = 2


def reference(layout: list[int | tuple[int, int]]) -> tuple[list[int], list, torch.Tensor, int]:
    """A prompt of text runs (``n`` tokens) and images (``(h, w)`` patch grids), with
    transformers' positions and delta for it; also its images as ``(offset, t, h, w)``."""
    tokens: list[int] = []
    grids: list = []
    for part in layout:
        if isinstance(part, int):
            tokens += [1] * part
        else:
            h, w = part
            tokens.append(START)
            grids.append((len(tokens), 1, h, w))
            tokens += [IMAGE] * (h * w // MERGE**2)
    config = Qwen2VLConfig(
        vision_config={"spatial_merge_size": MERGE},
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
    )
    model = types.SimpleNamespace(config=config)  # get_rope_index reads only these two
    model.get_vision_position_ids = types.MethodType(Qwen2VLModel.get_vision_position_ids, model)
    ids = torch.tensor([tokens])
    thw = torch.tensor([g[1:] for g in grids]) if grids else None
    positions, delta = Qwen2VLModel.get_rope_index(model, ids, (ids == IMAGE).int(), thw)
    return tokens, grids, positions[:, 0], int(delta.item())


LAYOUTS = [
    [12],  # text only: all three positions are the token index
    [3, (4, 4), 5],  # one square image
    [(8, 14), 2],  # a wide image first
    [2, (14, 8), 3, (4, 6), 7],  # two images of different shapes
    [5, (6, 4)],  # the prompt ends with its image
]
CONFIG = Qwen2VLConfig(vision_config={"spatial_merge_size": MERGE})


def rbln_positions(tokens: list[int], grids: list, features=None) -> tuple[torch.Tensor, int]:
    features = features or [_feature(o, h, w, keep_pixels=True) for o, _, h, w in grids]
    return _rope().rope_index(Qwen2VLModel, CONFIG, tokens, features)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_positions_and_delta_are_transformers(layout: list) -> None:
    tokens, grids, want, want_delta = reference(layout)
    got, delta = rbln_positions(tokens, grids)
    assert torch.equal(got, want) and delta == want_delta
    # a generated token at KV position p has position p + delta in all three dimensions,
    # which is where transformers' decode puts it (cache_position + rope_deltas)
    assert (
        _rope().positions_span(got, delta, len(tokens), len(tokens) + 2).tolist()
        == [[len(tokens) + delta, len(tokens) + 1 + delta]] * 3
    )


def _feature(offset: int, h: int, w: int, keep_pixels: bool):
    """vLLM's ``MultiModalFeatureSpec`` of an image, as its engine hands it to the runner."""
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalFieldElem,
        MultiModalKwargsItem,
        MultiModalSharedField,
        PlaceholderRange,
    )

    field = MultiModalSharedField(batch_size=1)
    fields = {"image_grid_thw": MultiModalFieldElem(data=torch.tensor([1, h, w]), field=field)}
    if keep_pixels:
        fields["pixel_values"] = MultiModalFieldElem(data=torch.zeros(h * w, 4), field=field)
    return MultiModalFeatureSpec(
        data=MultiModalKwargsItem(fields),
        modality="image",
        identifier=f"img{offset}",
        mm_position=PlaceholderRange(offset=offset, length=h * w // MERGE**2),
    )


def test_the_vllm_declaration_gives_the_same_positions_from_features() -> None:
    """vLLM's M-RoPE contract on rbln-ray's Qwen2-VL declaration, with one image's pixels
    already dropped by the prefix cache (its grid is kept on the CPU for exactly this), the
    features in any order."""
    from rbln_ray.families.qwen2_vl import RBLNQwen2VLDeclaration

    tokens, grids, want, want_delta = reference(LAYOUTS[3])
    features = [_feature(o, h, w, keep_pixels=i == 1) for i, (o, _, h, w) in enumerate(grids)]
    vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=CONFIG))
    declaration = RBLNQwen2VLDeclaration(vllm_config=vllm_config)
    got, delta = declaration.get_mrope_input_positions(tokens, features[::-1])
    assert torch.equal(got, want) and delta == want_delta


def test_a_chunk_takes_its_slice_and_generated_tokens_continue_after_delta() -> None:
    tokens, grids, want, delta = reference([100, (16, 16), 40])
    positions, _ = rbln_positions(tokens, grids)
    assert torch.equal(_rope().positions_span(positions, delta, 128, 160), want[:, 128:160])
    # a preempted request prefills prompt + generated tokens again: past the prompt, p + delta
    span = _rope().positions_span(positions, delta, 128, len(tokens) + 3)
    assert torch.equal(span[:, : len(tokens) - 128], want[:, 128:])
    assert (
        span[:, len(tokens) - 128 :].tolist() == [[len(tokens) + i + delta for i in range(3)]] * 3
    )


def test_bad_layouts_are_errors() -> None:
    overlapping = [_feature(0, 4, 4, True), _feature(2, 4, 4, True)]
    with pytest.raises(ValueError, match="overlaps"):
        rbln_positions([IMAGE] * 20, [], overlapping)
    with pytest.raises(ValueError, match="past the prompt"):
        rbln_positions([IMAGE] * 3, [(0, 1, 4, 4)])
