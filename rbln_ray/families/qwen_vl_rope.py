"""M-RoPE positions of the Qwen vision-language families, by transformers' own
``get_rope_index``.

Why here, and why transformers': the Qwen language models rotate by three positions per token
(temporal, height, width): text tokens have all three equal and consecutive, an image's tokens
the image's start plus their row and column, and text after an image continues from there;
positions run behind token indices by a per-request ``delta``. Each family's rule (sections
or interleaved, how a video's frames are numbered) is its transformers model's
``get_rope_index``: what ``generate`` and optimum-rbln's prefill use (vLLM 0.30's own M-RoPE
differs from it for videos). vLLM asks the model for them
(``SupportsMRoPE.get_mrope_input_positions``: the family's declaration) and the RBLN runner
needs them for every prefill chunk and decode step (the family's embedder), so both call
:func:`rope_index`. KV positions stay token positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MethodType, SimpleNamespace
from typing import Any

import torch

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
