"""M-RoPE positions (Qwen2-VL's 3-D rotary positions) of a request, from its token count and
its images' patch grids.

Why here: a Qwen2-VL language model rotates queries and keys by three positions per token —
temporal, height, width — instead of one. Text tokens have all three equal and consecutive;
an image's tokens (one per 2 x 2 merged patches) have the image's start position plus their
row and column; the text after an image continues from one past the image's largest
position. So positions run behind token indices by a per-request ``delta``, and a generated
token at KV position ``p`` (``cache_position``) has M-RoPE position ``p + delta`` in all three
dimensions. vLLM's own GPU runner asks the model (``SupportsMRoPE.get_mrope_input_positions``)
for exactly this; vLLM 0.30's Qwen2-VL module cannot be imported here (it needs torchvision),
so rbln-ray's declaration (:mod:`.vision_models`) and the RBLN runner
(:mod:`.qwen2_vl_inputs`) both use this function. It follows transformers'
``Qwen2VLModel.get_rope_index`` (images only: ``t = 1``), which ``tests/unit/test_mrope.py``
checks it against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


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
