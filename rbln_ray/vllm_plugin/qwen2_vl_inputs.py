"""Qwen2-VL's inputs on RBLN: image features from the compiled vision tower, and the M-RoPE
position embeddings every prefill chunk and decode step of its language model takes.

Why: optimum-rbln 0.12 compiles ``RBLNQwen2VLForConditionalGeneration``'s decoder with one
more input than a text decoder, ``position_emb`` (``[2, batch, 1, length, head_dim]``: cos and
sin of the 3-D M-RoPE positions, sections of the rotary dimensions taken from the temporal,
height and width positions), computed on the host. KV positions (``cache_position``) stay
token indices, so the scheduler, the KV blocks and prefix caching are the text path's; only
the rotary positions differ. Its own ``generate`` computes the positions with transformers'
``get_rope_index`` over the whole prompt and, in decode, ``cache_position + rope_delta``;
here they are vLLM's M-RoPE positions of each request (:mod:`.mrope`, stored on vLLM's
``CachedRequestState`` as vLLM's GPU runner does), sliced per prefill chunk, and turned into
cos/sin by the model's own ``_get_position_embeddings`` (optimum-rbln 0.12's method, which
``_preprocess_prefill`` / ``_preprocess_decoder`` call; its rotary tables are numpy-computed,
so host threads do not change them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rbln_ray.upstream import optimum_internals
from rbln_ray.vllm_plugin.image_inputs import PromptEmbedder
from rbln_ray.vllm_plugin.mrope import image_grids, mrope_positions, positions_span


class Qwen2VLPromptEmbedder(PromptEmbedder):
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
