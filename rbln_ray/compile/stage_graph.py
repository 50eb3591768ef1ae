"""The torch module compiled for one pipeline stage.

Why a wrapper of our own around optimum-rbln's pieces: optimum's ``DecoderOnlyWrapper`` runs
embedding → all layers → norm → LM head in one graph and expects KV buffers for every layer.
A stage needs a slice of that: stage 0 starts from token ids, later stages from the previous
stage's hidden states, only the last stage ends in norm + LM head, and each stage passes
(and marks static) only its own layers' KV buffers. The layers themselves are optimum's
converted ``DecoderOnlyLayer`` / ``DecoderOnlyAttention`` objects, so the graphs call the same
``torch.ops.rbln_custom_ops.paged_*attn*`` kernels with the same arguments as optimum's own
compiled models (token-exact with them, and the same code path on a real ATOM).

Positional-only ``forward`` (like optimum's wrapper) because the compiler traces positional
inputs in ``input_info`` order: ``x, cache_position, block_tables, [query_position], *kv``.
"""

from __future__ import annotations

import torch
from optimum.rbln.transformers.models.decoderonly.decoderonly_architecture import (
    slice_and_unsqueeze_cos_sin,
)
from torch import nn


class StageGraph(nn.Module):
    """Layers ``[layer_start, layer_end)`` of a converted optimum decoder, plus the ends it owns."""

    def __init__(
        self,
        wrapper: nn.Module,
        layer_start: int,
        layer_end: int,
        *,
        first: bool,
        last: bool,
    ) -> None:
        super().__init__()
        causal_lm = wrapper.model  # DecoderOnlyForCausalLM
        decoder = causal_lm.model  # DecoderOnlyModel
        self.first = first
        self.last = last
        self.layer_start = layer_start
        self.num_local_layers = layer_end - layer_start
        self.num_hidden_layers = len(decoder.layers)
        self.max_seq_len = decoder.max_seq_len
        self.flash = decoder.attn_impl == "flash_attn"
        self.hidden_multiplier = decoder.hidden_multiplier
        self.rotary_emb = wrapper.rotary_emb
        self.embed_tokens = decoder.get_embedding() if first else None
        self.layers = nn.ModuleList(decoder.layers[layer_start:layer_end])
        self.norm = decoder.get_last_layernorm() if last else None
        self.lm_head = causal_lm.lm_head if last else None
        self._phase = "prefill"

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, phase: str) -> None:
        self._phase = phase
        for layer in self.layers:
            layer.phase = phase

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        args_list = list(args)
        x = args_list.pop(0)
        cache_position = args_list.pop(0)
        block_tables = args_list.pop(0)
        query_position = args_list.pop(0) if self.last and self._phase == "prefill" else None
        kv = args_list
        if len(kv) != 2 * self.num_local_layers:
            raise ValueError(f"expected {2 * self.num_local_layers} KV buffers, got {len(kv)}")
        # Layers index past_key_values by their global layer_idx.
        past: list[list[torch.Tensor] | None] = [None] * self.num_hidden_layers
        for i in range(self.num_local_layers):
            past[self.layer_start + i] = [kv[2 * i], kv[2 * i + 1]]

        hidden = self.embed_tokens(x) * self.hidden_multiplier if self.first else x
        cos, sin = self.rotary_emb(hidden, self.max_seq_len)
        cos, sin = slice_and_unsqueeze_cos_sin(cos, sin, cache_position)
        # Flash attention takes each row's start position, eager the first cache position.
        seq_positions = cache_position[:, 0].unsqueeze(-1) if self.flash else cache_position[:, :1]
        for layer in self.layers:
            hidden = layer(
                hidden_states=hidden,
                attention_mask=None,
                seq_positions=seq_positions,
                past_key_values=past,
                cos=cos,
                sin=sin,
                block_tables=block_tables,
            )
        if not self.last:
            return hidden
        hidden = self.norm(hidden)
        if query_position is not None:
            hidden = hidden[:, query_position.to(torch.int).unsqueeze(0)]
        return self.lm_head(hidden)
