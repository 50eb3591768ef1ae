"""CPU reference kernels for the paged-attention custom ops optimum-rbln emits.

Why: optimum-rbln's decoder graphs call ``torch.ops.rbln_custom_ops.paged_*attn_*``; on an NPU
the compiler lowers them, on CPU these functions define what they compute.

Layouts (ARCHITECTURE §4): q ``[B,Hkv,G,L,D]``; k,v ``[B,Hkv,1,L,D]``; kcache/vcache
``[num_blocks,Hkv,1,block,D]`` (written in place); ``seq`` ``[B,1]`` = logical position of the
first query token; ``block_table`` 1-D (prefill, batch 1) or ``[B,nblk]`` (decode). Logical
position ``p`` of row ``b`` lives in block ``block_table[b, p // block]`` at offset
``p % block``. A negative block id means "no block": writes are skipped, reads are masked.
Positions past the table (chunk padding) are never written. Fully masked rows use
``finfo.min`` (not ``-inf``) so softmax stays finite. Flash attention's partitioning only
changes the on-chip schedule, not the math, so eager and flash share these kernels.
"""

from __future__ import annotations

import torch


def _as_table(block_table: torch.Tensor, batch: int) -> torch.Tensor:
    """Block table as ``[B, nblk]`` int64."""
    table = block_table.to(torch.int64)
    if table.dim() == 1:
        table = table.unsqueeze(0).expand(batch, -1)
    return table


def _slots(
    seq: torch.Tensor, length: int, table: torch.Tensor, block: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(valid ``[B,L]``, block ids, offsets) of the cache slots for positions ``seq + i``."""
    pos = seq + torch.arange(length, dtype=torch.int64)  # [B,L]
    in_range = (pos >= 0) & (pos < table.shape[1] * block)
    blk = torch.gather(table, 1, torch.where(in_range, pos // block, 0))
    valid = in_range & (blk >= 0) & (blk < num_blocks)
    if not bool(valid.any()):
        return None
    return valid, blk[valid], (pos % block)[valid]


def _write_cache(cache: torch.Tensor, new: torch.Tensor, slots) -> None:
    """Scatter ``new`` ``[B,H,1,L,D]`` into the ``cache`` slots chosen by :func:`_slots`."""
    if slots is None:
        return
    valid, blk, off = slots
    rows = new[:, :, 0].permute(0, 2, 1, 3)[valid]  # [n, H, D]
    cache[blk, :, 0, off] = rows.to(cache.dtype)


def _gather_cache(
    cache: torch.Tensor, table: torch.Tensor, block: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical cache ``[B,H,S,D]`` of the first ``length`` positions plus a ``[B,S]`` validity mask.

    Only the blocks covering ``length`` are read, so decode cost follows the live context,
    not ``max_seq_len``.
    """
    nblk_used = max(1, min(table.shape[1], -(-length // block)))
    used = table[:, :nblk_used]
    safe = used.clamp(min=0, max=cache.shape[0] - 1)
    if nblk_used == 1:
        span = min(length, block)
        kv = cache[:, :, 0, :span][safe[:, 0]]  # [B,H,span,D]
        valid = (used[:, :1] >= 0).expand(-1, span)
        return kv, valid
    kv = cache[safe][:, :, :, 0]  # [B,nblk,H,block,D]
    batch, _, heads, _, dim = kv.shape
    kv = kv.permute(0, 2, 1, 3, 4).reshape(batch, heads, nblk_used * block, dim)
    valid = (used >= 0).repeat_interleave(block, dim=1)
    return kv, valid


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    scale: torch.Tensor | float,
    sinks: torch.Tensor | None = None,
    additive: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped-query attention of ``q`` ``[B,Hkv,G,L,D]`` over ``keys``/``values`` ``[B,Hkv,S,D]``.

    ``allowed`` (bool, broadcastable to ``[B,Hkv,G,L,S]``) says which keys a query sees;
    ``additive`` (same broadcast) is added to the scaled scores (T5's position bias);
    ``sinks`` ``[Hkv*G, 1]`` are attention-sink logits (gpt-oss ``s_aux``): one extra
    softmax column per head that takes probability mass and contributes no value, computed
    the way transformers' ``eager_attention_forward`` for gpt-oss does.
    """
    batch, heads, groups, length, dim = q.shape
    span = keys.shape[2]
    shape = (batch, heads, groups, length, span)
    # Additive finfo.min (not -inf) keeps fully masked rows finite.
    bias = torch.zeros(shape, dtype=q.dtype).masked_fill_(
        ~allowed.expand(shape), torch.finfo(q.dtype).min
    )
    if additive is not None:  # clamped: finfo.min + finfo.min would overflow to -inf
        bias = (bias + additive.to(q.dtype).expand(shape)).clamp_(min=torch.finfo(q.dtype).min)
    flat_q = q.reshape(batch, heads, groups * length, dim)
    flat_bias = bias.reshape(batch, heads, groups * length, span)
    if sinks is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            flat_q, keys, values, attn_mask=flat_bias, scale=float(scale)
        )
        return out.reshape(batch, heads, groups, length, dim)
    scores = torch.matmul(flat_q, keys.transpose(-1, -2)) * float(scale) + flat_bias
    sink = sinks.reshape(heads, groups, 1, 1).to(scores.dtype)
    sink = sink.expand(heads, groups, length, 1).reshape(1, heads, groups * length, 1)
    combined = torch.cat([scores, sink.expand(batch, -1, -1, -1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.matmul(probs, values).reshape(batch, heads, groups, length, dim)


def quantize_kv(state: torch.Tensor, kv_scale: torch.Tensor | None, dtype: torch.dtype):
    """K/V as stored in a cache of ``dtype``: divided by the per-tensor scale of an FP8 cache
    (``*_kv_fp8`` ops) and saturated to the format's range, cast otherwise."""
    if kv_scale is None:
        return state
    limit = torch.finfo(dtype).max
    return (state / kv_scale.to(state.dtype)).clamp(-limit, limit)


def dequantize_kv(cached: torch.Tensor, kv_scale: torch.Tensor | None, dtype: torch.dtype):
    """Cached K/V back in the compute ``dtype`` (times the FP8 scale when there is one)."""
    out = cached.to(dtype)
    return out if kv_scale is None else out * kv_scale.to(dtype)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kcache: torch.Tensor,
    vcache: torch.Tensor,
    seq: torch.Tensor,
    scale: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    mask: torch.Tensor | None = None,
    causal: bool = True,
    s_aux: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    additive_mask: bool = False,
) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend over the cache.

    ``mask`` (1 = attend), when given, replaces the causal rule: ``[B,1,1,L,S]`` per query or
    ``[B,S]`` per key (the position-ids variant, combined with causality unless bidirectional).
    With ``additive_mask`` the mask is instead added to the scores (``paged_add_softmax_*``:
    0 = attend, ``finfo.min`` = masked, plus any bias such as T5's). ``s_aux``: attention
    sinks; ``k_scale``/``v_scale``: the per-tensor scales of an FP8 cache (``*_kv_fp8``).
    """
    batch, heads, groups, length, dim = q.shape
    table = _as_table(block_table, batch)
    seq = seq.reshape(batch, 1).to(torch.int64)
    slots = _slots(seq, length, table, block_size, kcache.shape[0])
    _write_cache(kcache, quantize_kv(k, k_scale, kcache.dtype), slots)
    _write_cache(vcache, quantize_kv(v, v_scale, vcache.dtype), slots)

    limit = table.shape[1] * block_size
    span = int(seq.max()) + length
    if mask is not None and not additive_mask:
        span = max(span, mask.shape[-1])
    span = max(1, min(span, limit))
    keys, valid = _gather_cache(kcache, table, block_size, span)
    values, _ = _gather_cache(vcache, table, block_size, span)
    keys = dequantize_kv(keys, k_scale, q.dtype)
    values = dequantize_kv(values, v_scale, q.dtype)
    span = keys.shape[2]

    allowed = valid[:, None, None, None, :]  # [B,1,1,1,S]
    additive = None
    if additive_mask:
        if mask is None or mask.dim() != 5:
            raise ValueError("paged_add_softmax_* needs an additive mask [B,Hkv,G,L,S]")
        additive = _fit(mask, span, torch.finfo(q.dtype).min)
    elif mask is not None and mask.dim() > 2:
        m = mask.reshape(batch, -1, mask.shape[-1])[:, -length:] > 0  # [B,L,S']
        allowed = allowed & _fit(m, span, False)[:, None, None]
    else:
        if mask is not None:
            km = mask.reshape(batch, -1)[:, :span] > 0
            allowed = allowed & _fit(km, span, False)[:, None, None, None, :]
        if causal:
            q_pos = seq + torch.arange(length, dtype=torch.int64)  # [B,L]
            key_pos = torch.arange(span, dtype=torch.int64)
            allowed = allowed & (
                key_pos[None, None, None, None, :] <= q_pos[:, None, None, :, None]
            )
    return attend(q, keys, values, allowed, scale, s_aux, additive)


@torch.no_grad()
def paged_add_softmax_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    kcache: torch.Tensor,
    vcache: torch.Tensor,
    seq: torch.Tensor,
    scale: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """``paged_add_softmax_attn_decode`` (T5, time-series transformers): ``mask`` is added to
    the scores (T5 passes position bias + the inverted attention mask), no causal rule."""
    return paged_attention(
        q,
        k,
        v,
        kcache,
        vcache,
        seq,
        scale,
        block_table,
        block_size,
        mask,
        causal=False,
        additive_mask=True,
    )


def _fit(t: torch.Tensor, span: int, fill) -> torch.Tensor:
    """``t`` cut or padded (with ``fill``) along its last axis to ``span``."""
    t = t[..., :span]
    if t.shape[-1] < span:
        t = torch.nn.functional.pad(t, (0, span - t.shape[-1]), value=fill)
    return t


def cache_update(
    cache: torch.Tensor, state: torch.Tensor, position: torch.Tensor, axis: torch.Tensor
):
    """``rbln_cache_update``: copy ``state`` into ``cache`` from ``position`` along ``axis``."""
    ax = int(axis)
    start = int(position.reshape(-1)[0]) if position.numel() else 0
    cache.narrow(ax, start, state.shape[ax]).copy_(state)
    return cache
