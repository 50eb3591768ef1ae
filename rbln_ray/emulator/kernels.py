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
) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend over the cache.

    ``mask`` (1 = attend), when given, replaces the causal rule: ``[B,1,1,L,S]`` per query or
    ``[B,S]`` per key (the position-ids variant, combined with causality unless bidirectional).
    """
    batch, heads, groups, length, dim = q.shape
    table = _as_table(block_table, batch)
    seq = seq.reshape(batch, 1).to(torch.int64)
    slots = _slots(seq, length, table, block_size, kcache.shape[0])
    _write_cache(kcache, k, slots)
    _write_cache(vcache, v, slots)

    limit = table.shape[1] * block_size
    span = int(seq.max()) + length
    if mask is not None:
        span = max(span, mask.shape[-1])
    span = max(1, min(span, limit))
    keys, valid = _gather_cache(kcache, table, block_size, span)
    values, _ = _gather_cache(vcache, table, block_size, span)
    span = keys.shape[2]

    allowed = valid[:, None, :]  # [B,1,S]
    if mask is not None and mask.dim() > 2:
        m = mask.reshape(batch, -1, mask.shape[-1])[:, -length:, :span] > 0  # [B,L,S']
        if m.shape[-1] < span:
            m = torch.nn.functional.pad(m, (0, span - m.shape[-1]))
        allowed = allowed & m
    else:
        if mask is not None:
            km = mask.reshape(batch, -1)[:, :span] > 0
            if km.shape[-1] < span:
                km = torch.nn.functional.pad(km, (0, span - km.shape[-1]))
            allowed = allowed & km[:, None, :]
        if causal:
            q_pos = seq + torch.arange(length, dtype=torch.int64)  # [B,L]
            key_pos = torch.arange(span, dtype=torch.int64)
            allowed = allowed & (key_pos[None, None, :] <= q_pos[:, :, None])
    # Additive finfo.min (not -inf) keeps fully masked rows finite.
    bias = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill_(
        ~allowed, torch.finfo(q.dtype).min
    )
    if bias.shape[1] == 1 and length > 1:
        bias = bias.expand(batch, length, span)
    bias = bias[:, None, None].expand(batch, 1, groups, bias.shape[1], span)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(batch, heads, groups * length, dim),
        keys,
        values,
        attn_mask=bias.reshape(batch, 1, groups * bias.shape[3], span),
        scale=float(scale),
    )
    return out.reshape(batch, heads, groups, length, dim)


def cache_update(
    cache: torch.Tensor, state: torch.Tensor, position: torch.Tensor, axis: torch.Tensor
):
    """``rbln_cache_update``: copy ``state`` into ``cache`` from ``position`` along ``axis``."""
    ax = int(axis)
    start = int(position.reshape(-1)[0]) if position.numel() else 0
    cache.narrow(ax, start, state.shape[ax]).copy_(state)
    return cache
