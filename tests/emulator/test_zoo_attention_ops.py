"""The model-zoo attention ops against plain-torch references.

Ops: ``paged_sliding_window_attn_{prefill,decode}``, attention sinks (``s_aux``) on the
paged, flash and sliding ops, the ``*_kv_fp8`` variants, and ``paged_add_softmax_attn_decode``.
Each op is driven the way optimum-rbln's graphs call it (argument names from its call sites,
inputs built as ``get_swa_custom_op_args`` builds them) and compared with attention computed
from scratch over the whole token history, so the kernels' cache bookkeeping is checked, not
assumed.
"""

from __future__ import annotations

import pytest
import torch

OPS = torch.ops.rbln_custom_ops
HKV, G, D = 2, 2, 8  # kv heads, query heads per kv head, head dim
SCALE = torch.tensor(D**-0.5)


def reference(q, keys, values, visible, sinks=None):
    """Attention of one query token ``q`` ``[Hkv*G, D]`` over ``keys``/``values`` ``[n, Hkv, D]``
    restricted to positions ``visible``; ``sinks`` ``[Hkv*G]`` add one softmax column each."""
    out = torch.empty(HKV * G, D)
    idx = torch.tensor(sorted(visible), dtype=torch.long)
    for h in range(HKV * G):
        kv = h // G
        scores = keys[idx, kv] @ q[h] * SCALE
        if sinks is not None:
            scores = torch.cat([scores, sinks[h : h + 1]])
        probs = torch.softmax(scores, dim=0)[: len(idx)]
        out[h] = probs @ values[idx, kv]
    return out


def window_of(p: int, window: int) -> range:
    """Positions a query at ``p`` sees under transformers' sliding-window mask."""
    return range(max(0, p - window + 1), p + 1)


def swa_args(position: int, valid: int, window: int):
    """(cache_seq_len, cache_offset) exactly as optimum's ``get_swa_custom_op_args`` builds them."""
    seen = min(position, window)
    return torch.tensor([[seen]], dtype=torch.int32), torch.tensor(
        [[seen + valid]], dtype=torch.int32
    )


class Sequence:
    """Random per-token q/k/v of one sequence: q ``[T, Hkv*G, D]``, k/v ``[T, Hkv, D]``."""

    def __init__(self, length: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.q = torch.randn(length, HKV * G, D, generator=g)
        self.k = torch.randn(length, HKV, D, generator=g)
        self.v = torch.randn(length, HKV, D, generator=g)


def prefill_chunk(seq, start, end, chunk, slot, kcache, vcache, window, **extra):
    """One optimum prefill call: tokens ``[start, end)`` padded to ``chunk`` rows (garbage)."""
    n = end - start
    pad = chunk - n
    q = torch.cat([seq.q[start:end], torch.randn(pad, HKV * G, D)])  # padding rows: garbage
    k = torch.cat([seq.k[start:end], torch.randn(pad, HKV, D)])
    v = torch.cat([seq.v[start:end], torch.randn(pad, HKV, D)])
    cache_seq_len, cache_offset = swa_args(start, n, window)
    out = OPS.paged_sliding_window_attn_prefill(
        q=q.view(chunk, HKV, G, D).permute(1, 2, 0, 3).unsqueeze(0),
        k=k.permute(1, 0, 2).unsqueeze(0).unsqueeze(2),
        v=v.permute(1, 0, 2).unsqueeze(0).unsqueeze(2),
        kcache=kcache,
        vcache=vcache,
        cache_seq_len=cache_seq_len,
        cache_offset=cache_offset,
        scale=SCALE,
        block_table=torch.tensor([slot], dtype=torch.int16),
        block_size=window,
        is_bidirectional=extra.pop("is_bidirectional", False),
        attn_mask=None,
        **extra,
    )
    return out[0].permute(2, 0, 1, 3).reshape(chunk, HKV * G, D)[:n]


def decode_step(rows, window, kcache, vcache, **extra):
    """One decode call; ``rows`` = [(sequence or None, position, slot)]; None = padding row."""
    batch = len(rows)
    q = torch.randn(batch, HKV * G, D)
    k, v = torch.randn(batch, HKV, D), torch.randn(batch, HKV, D)
    positions = []
    for i, (seq, pos, _) in enumerate(rows):
        positions.append(pos)
        if seq is not None:
            q[i], k[i], v[i] = seq.q[pos], seq.k[pos], seq.v[pos]
    pos_t = torch.tensor(positions, dtype=torch.int32).view(batch, 1)
    seen = torch.clamp(pos_t, max=window)
    mask = torch.where(torch.arange(window)[None, :] - seen > 0, 0.0, 1.0)[:, None, None, :]
    out = OPS.paged_sliding_window_attn_decode(
        q=q.view(batch, HKV, G, 1, D),
        k=k.view(batch, HKV, 1, 1, D),
        v=v.view(batch, HKV, 1, 1, D),
        kcache=kcache,
        vcache=vcache,
        cache_seq_len=seen,
        cache_offset=seen + 1,
        scale=SCALE,
        block_table=torch.tensor([[s] for _, _, s in rows], dtype=torch.int16),
        block_size=window,
        attn_mask=mask,
        **extra,
    )
    return out.reshape(batch, HKV * G, D)


def caches(slots: int, window: int):
    return torch.zeros(slots, HKV, 1, window, D), torch.zeros(slots, HKV, 1, window, D)


@pytest.mark.parametrize(
    ("window", "chunk", "prompt"),
    [
        (8, 16, 40),  # window shorter than a chunk; prompt spans three chunks (last padded)
        (24, 16, 48),  # window longer than a chunk, prompt ends on a chunk boundary
        (32, 16, 10),  # whole prompt inside the window, one padded chunk
        (16, 16, 16),  # window == chunk == prompt
    ],
)
def test_sliding_window_prefill_then_decode_matches_reference(window, chunk, prompt):
    decode_steps = window + 5  # long enough to wrap the window while decoding
    seq = Sequence(prompt + decode_steps, seed=window + prompt)
    other = Sequence(prompt + decode_steps, seed=99)
    kcache, vcache = caches(3, window)
    for start in range(0, prompt, chunk):
        end = min(start + chunk, prompt)
        for s, slot in ((seq, 2), (other, 0)):
            got = prefill_chunk(s, start, end, chunk, slot, kcache, vcache, window)
            for i, p in enumerate(range(start, end)):
                exp = reference(s.q[p], s.k, s.v, window_of(p, window))
                torch.testing.assert_close(got[i], exp, rtol=1e-5, atol=1e-5)
    for step in range(decode_steps):
        p = prompt + step
        # live rows in slots 2 and 0, a padding row on the free slot 1, one with no slot
        rows = [(seq, p, 2), (None, 0, 1), (other, p, 0), (None, 5, -1)]
        got = decode_step(rows, window, kcache, vcache)
        for row, s in ((0, seq), (2, other)):
            exp = reference(s.q[p], s.k, s.v, window_of(p, window))
            torch.testing.assert_close(got[row], exp, rtol=1e-5, atol=1e-5)
        assert torch.isfinite(got).all()


def test_sliding_window_slot_holds_the_last_window_tokens_oldest_first():
    window, chunk = 8, 16
    seq = Sequence(30, seed=3)
    kcache, vcache = caches(2, window)
    prefill_chunk(seq, 0, 13, chunk, 1, kcache, vcache, window)
    torch.testing.assert_close(kcache[1, :, 0], seq.k[5:13].permute(1, 0, 2))
    decode_step([(seq, 13, 1)], window, kcache, vcache)
    torch.testing.assert_close(vcache[1, :, 0], seq.v[6:14].permute(1, 0, 2))
    assert kcache[0].abs().sum() == 0  # the other slot is untouched


def test_sliding_window_bidirectional_prefill_sees_its_whole_chunk():
    window, chunk = 64, 16
    seq = Sequence(20, seed=5)
    kcache, vcache = caches(1, window)
    got = prefill_chunk(seq, 0, 12, chunk, 0, kcache, vcache, window, is_bidirectional=True)
    for i in range(12):
        exp = reference(seq.q[i], seq.k, seq.v, range(12))
        torch.testing.assert_close(got[i], exp, rtol=1e-5, atol=1e-5)


def test_sliding_window_attention_sinks():
    window, chunk, prompt = 8, 16, 20
    seq = Sequence(prompt + 10, seed=11)
    sinks = torch.randn(HKV * G) * 2
    kcache, vcache = caches(1, window)
    s_aux = sinks[:, None]  # optimum passes self_attn.sinks.data[:, None]
    for start in range(0, prompt, chunk):
        end = min(start + chunk, prompt)
        got = prefill_chunk(seq, start, end, chunk, 0, kcache, vcache, window, s_aux=s_aux)
        for i, p in enumerate(range(start, end)):
            exp = reference(seq.q[p], seq.k, seq.v, window_of(p, window), sinks)
            torch.testing.assert_close(got[i], exp, rtol=1e-5, atol=1e-5)
    for p in range(prompt, prompt + 10):
        got = decode_step([(seq, p, 0)], window, kcache, vcache, s_aux=s_aux)
        exp = reference(seq.q[p], seq.k, seq.v, window_of(p, window), sinks)
        torch.testing.assert_close(got[0], exp, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ paged ops: sinks, FP8, T5
def paged_call(op, seq, start, end, chunk, table, kcache, vcache, block, **extra):
    n, pad = end - start, chunk - (end - start)
    q = torch.cat([seq.q[start:end], torch.zeros(pad, HKV * G, D)])
    k = torch.cat([seq.k[start:end], torch.zeros(pad, HKV, D)])
    v = torch.cat([seq.v[start:end], torch.zeros(pad, HKV, D)])
    out = op(
        q=q.view(chunk, HKV, G, D).permute(1, 2, 0, 3).unsqueeze(0),
        k=k.permute(1, 0, 2).unsqueeze(0).unsqueeze(2),
        v=v.permute(1, 0, 2).unsqueeze(0).unsqueeze(2),
        kcache=kcache,
        vcache=vcache,
        seq=torch.tensor([[start]], dtype=torch.int32),
        scale=SCALE,
        block_table=table,
        block_size=block,
        **extra,
    )
    return out[0].permute(2, 0, 1, 3).reshape(chunk, HKV * G, D)[:n]


def paged_decode(op, seq, pos, table, kcache, vcache, block, **extra):
    out = op(
        q=seq.q[pos].view(1, HKV, G, 1, D),
        k=seq.k[pos].view(1, HKV, 1, 1, D),
        v=seq.v[pos].view(1, HKV, 1, 1, D),
        kcache=kcache,
        vcache=vcache,
        seq=torch.tensor([[pos]], dtype=torch.int32),
        scale=SCALE,
        block_table=table.view(1, -1),
        block_size=block,
        **extra,
    )
    return out.reshape(HKV * G, D)


@pytest.mark.parametrize("flash", [False, True])
def test_paged_causal_attention_sinks(flash):
    block, chunk, prompt = 32, 16, 40
    seq = Sequence(prompt + 6, seed=21)
    sinks = torch.randn(HKV * G)
    kcache, vcache = torch.zeros(4, HKV, 1, block, D), torch.zeros(4, HKV, 1, block, D)
    table = torch.tensor([3, 1], dtype=torch.int16)
    extra = {"s_aux": sinks[:, None]} | ({"partition": block} if flash else {})
    kind = "paged_flash_causal_attn_" if flash else "paged_causal_attn_"
    for start in range(0, prompt, chunk):
        end = min(start + chunk, prompt)
        got = paged_call(
            getattr(OPS, kind + "prefill"),
            seq,
            start,
            end,
            chunk,
            table,
            kcache,
            vcache,
            block,
            is_bidirectional=False,
            **extra,
        )
        for i, p in enumerate(range(start, end)):
            exp = reference(seq.q[p], seq.k, seq.v, range(p + 1), sinks)
            torch.testing.assert_close(got[i], exp, rtol=1e-5, atol=1e-5)
    for p in range(prompt, prompt + 6):
        got = paged_decode(
            getattr(OPS, kind + "decode"), seq, p, table, kcache, vcache, block, **extra
        )
        torch.testing.assert_close(
            got, reference(seq.q[p], seq.k, seq.v, range(p + 1), sinks), rtol=1e-5, atol=1e-5
        )


def fp8(t: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 (e4m3) cache with per-tensor ``scale`` gives back for ``t``."""
    return (t / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale


@pytest.mark.parametrize("flash", [False, True])
def test_kv_fp8_attention_stores_scaled_fp8_and_attends_over_it(flash):
    block, chunk, prompt = 32, 16, 24
    seq = Sequence(prompt + 4, seed=31)
    k_scale, v_scale = 0.05, 0.03
    kcache = torch.zeros(2, HKV, 1, block, D, dtype=torch.float8_e4m3fn)
    vcache = torch.zeros(2, HKV, 1, block, D, dtype=torch.float8_e4m3fn)
    table = torch.tensor([1, 0], dtype=torch.int16)
    extra = {"k_scale": torch.tensor(k_scale), "v_scale": torch.tensor(v_scale)}
    extra |= {"partition": block} if flash else {}
    kind = "paged_flash_causal_attn_" if flash else "paged_causal_attn_"
    ref_k, ref_v = fp8(seq.k, k_scale), fp8(seq.v, v_scale)
    for start in range(0, prompt, chunk):
        end = min(start + chunk, prompt)
        op = getattr(OPS, kind + "prefill_kv_fp8")
        got = paged_call(op, seq, start, end, chunk, table, kcache, vcache, block, **extra)
        for i, p in enumerate(range(start, end)):
            exp = reference(seq.q[p], ref_k, ref_v, range(p + 1))
            torch.testing.assert_close(got[i], exp, rtol=1e-5, atol=1e-5)
    for p in range(prompt, prompt + 4):
        op = getattr(OPS, kind + "decode_kv_fp8")
        got = paged_decode(op, seq, p, table, kcache, vcache, block, **extra)
        torch.testing.assert_close(got, reference(seq.q[p], ref_k, ref_v, range(p + 1)))
    # the cache holds FP8 codes of k / k_scale, position for position
    stored = kcache[1, :, 0, :prompt].to(torch.float32) * k_scale
    torch.testing.assert_close(stored, ref_k[:prompt].permute(1, 0, 2))
    no_scales = {"partition": block} if flash else {}
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        op = getattr(OPS, kind + "decode_kv_fp8")
        paged_decode(op, seq, 0, table, kcache, vcache, block, **no_scales)


def test_add_softmax_decode_adds_the_mask_to_the_scores():
    """T5-style decode: an additive bias (position bias + inverted mask) replaces causality."""
    block, steps = 16, 12
    seq = Sequence(steps, seed=41)
    kcache, vcache = torch.zeros(2, HKV * G, 1, block, D), torch.zeros(2, HKV * G, 1, block, D)
    bias = torch.randn(HKV * G, block)
    for p in range(steps):
        mask = bias.clone()
        mask[:, p + 1 :] = torch.finfo(torch.float32).min  # future positions masked
        out = OPS.paged_add_softmax_attn_decode(
            seq.q[p].view(1, HKV * G, 1, 1, D),
            seq.k[p].repeat_interleave(G, 0).view(1, HKV * G, 1, 1, D),
            seq.v[p].repeat_interleave(G, 0).view(1, HKV * G, 1, 1, D),
            mask.view(1, HKV * G, 1, 1, block),
            kcache,
            vcache,
            torch.tensor([[p]], dtype=torch.int32),
            torch.tensor(1.0),
            torch.tensor([[1]], dtype=torch.int16),
            block,
        ).reshape(HKV * G, D)
        for h in range(HKV * G):
            keys = seq.k[: p + 1, h // G]
            probs = torch.softmax(keys @ seq.q[p, h] + bias[h, : p + 1], dim=0)
            torch.testing.assert_close(out[h], probs @ seq.v[: p + 1, h // G], rtol=1e-5, atol=1e-5)
