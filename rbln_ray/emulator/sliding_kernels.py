"""CPU reference kernels of ``paged_sliding_window_attn_{prefill,decode}``.

Why: optimum-rbln compiles the sliding-window layers of Gemma2/Gemma3/gpt-oss (and Mistral or
Qwen2 checkpoints with a window) to these two ops; on an NPU the compiler lowers them, on CPU
these functions define what they compute.

The contract, from optimum-rbln 0.12's call sites (``SlidingWindowAttentionOp`` and
``DecoderOnlyModel.get_swa_custom_op_args`` in ``decoderonly_architecture.py``):

- the cache of a sliding layer is ``[num_slots, Hkv, 1, window, D]``: one *slot* per batch
  entry (``SlidingWindowAttentionKVCacheMeta``: ``num_blocks = batch_size``), ``block_size``
  is the window, ``block_table`` holds the slot (``local_block_tables``: ``[1]`` in
  prefill, ``[B,1]`` in decode);
- ``cache_seq_len`` ``[B,1]`` = ``min(first position, window)``: the past tokens the slot
  holds; ``cache_offset`` = ``cache_seq_len`` + the valid tokens of this call (prefill:
  ``query_position + 1``; decode: 1);
- decode passes ``attn_mask`` ``[B,1,1,window]``, 1 for slot indices ``<= cache_seq_len``;
  prefill derives the window itself (``attn_mask`` only for image prefill, 4-D over the
  ``window + chunk`` compute buffer of past-then-chunk keys).

A slot therefore holds a sequence's most recent ``min(n, window)`` tokens, oldest first, in
slot indices ``0..``; the kernels keep it so (decode on a full slot shifts it by one, prefill
keeps the last ``window`` of past + chunk). A query at position ``p`` sees keys at ``p - w <
k <= p`` (transformers' ``sliding_window_overlay``). A negative slot id means "no slot"
(padding rows): nothing is read or written, as with paged blocks.
"""

from __future__ import annotations

import torch

from rbln_ray.emulator.kernels import attend


def _slot(block_table: torch.Tensor, row: int, num_slots: int) -> int | None:
    table = block_table.reshape(-1) if block_table.dim() < 2 else block_table[:, 0]
    slot = int(table[row if table.numel() > 1 else 0])
    return slot if 0 <= slot < num_slots else None


@torch.no_grad()
def sliding_window_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kcache: torch.Tensor,
    vcache: torch.Tensor,
    cache_seq_len: torch.Tensor,
    cache_offset: torch.Tensor,
    scale: torch.Tensor,
    block_table: torch.Tensor,
    window: int,
    is_bidirectional: bool | None = False,
    attn_mask: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
) -> torch.Tensor:
    """One prefill chunk (batch 1): attend over the slot's past plus the chunk, then keep the
    last ``window`` tokens of both in the slot. Chunk rows past ``cache_offset`` are padding:
    they are neither attended to nor stored.

    ``is_bidirectional``: queries also see later tokens of their own chunk (within the
    window), as optimum requests for prefix-LM style prefill.
    """
    _, heads, groups, length, dim = q.shape
    slot = _slot(block_table, 0, kcache.shape[0])
    past = min(int(cache_seq_len.reshape(-1)[0]), window) if slot is not None else 0
    valid = max(0, min(length, int(cache_offset.reshape(-1)[0]) - past))
    new_k, new_v = k[0, :, 0], v[0, :, 0]  # [Hkv, L, D]
    if slot is not None:
        keys = torch.cat([kcache[slot, :, 0, :past].to(q.dtype), new_k], dim=1)
        values = torch.cat([vcache[slot, :, 0, :past].to(q.dtype), new_v], dim=1)
    else:
        keys, values = new_k, new_v
    span = past + length
    if attn_mask is not None:
        allowed = attn_mask.reshape(-1, attn_mask.shape[-1])[-length:, :span] > 0  # [L,S]
    else:
        key_idx = torch.arange(span)
        query_idx = past + torch.arange(length)
        gap = query_idx[:, None] - key_idx[None, :]
        in_window = (gap < window) & ((gap >= 0) | bool(is_bidirectional))
        allowed = in_window & (key_idx < past + valid)[None, :]
    out = attend(q, keys[None], values[None], allowed[None, None, None], scale, s_aux)
    if slot is not None:
        kept = min(window, past + valid)
        first = past + valid - kept
        kcache[slot, :, 0, :kept] = keys[:, first : past + valid].to(kcache.dtype)
        vcache[slot, :, 0, :kept] = values[:, first : past + valid].to(vcache.dtype)
    return out


@torch.no_grad()
def sliding_window_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kcache: torch.Tensor,
    vcache: torch.Tensor,
    cache_seq_len: torch.Tensor,
    cache_offset: torch.Tensor,
    scale: torch.Tensor,
    block_table: torch.Tensor,
    window: int,
    is_bidirectional: bool | None = None,
    attn_mask: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row: append it to the row's slot (shifting out the oldest token of a full
    slot), then attend over the slot. ``is_bidirectional`` is meaningless for one token."""
    batch = q.shape[0]
    lengths = cache_seq_len.reshape(batch).tolist()
    keys = torch.zeros(batch, k.shape[1], window, k.shape[-1], dtype=q.dtype)
    values = torch.zeros_like(keys)
    allowed = torch.zeros(batch, window, dtype=torch.bool)
    for row in range(batch):
        slot = _slot(block_table, row, kcache.shape[0])
        if slot is None:
            continue
        n = min(int(lengths[row]), window)
        kc, vc = kcache[slot, :, 0], vcache[slot, :, 0]  # [Hkv, window, D] views
        if n == window:  # full: drop the oldest token
            kc[:, :-1] = kc[:, 1:].clone()
            vc[:, :-1] = vc[:, 1:].clone()
            n = window - 1
        kc[:, n] = k[row, :, 0, 0].to(kc.dtype)
        vc[:, n] = v[row, :, 0, 0].to(vc.dtype)
        keys[row], values[row] = kc.to(q.dtype), vc.to(q.dtype)
        if attn_mask is not None:
            allowed[row] = attn_mask[row].reshape(-1)[:window] > 0
        else:
            allowed[row, : n + 1] = True
    return attend(q, keys, values, allowed[:, None, None, None, :], scale, s_aux)
