"""``rebel.Runtime._copy_kv_cache``: the on-device KV copy prefix caching relies on."""

from __future__ import annotations

import gc

import pytest
import rebel
import torch

BLOCKS, HEADS, SLOTS, DIM = 5, 2, 8, 4


class TwoLayerKV(torch.nn.Module):
    """Returns the sum of its two static KV buffers (enough to give the runtime a load)."""

    def forward(self, x, k0, v0):
        return (x.sum() + k0.sum() + v0.sum()).reshape(1)


def _compiled_pair() -> list[rebel.RBLNCompiledModel]:
    """Two graphs of one compile context (like optimum's prefill and decoder graphs)."""
    ctx = rebel.compile_context.CompileContext(use_weight_sharing=True)
    shape = [BLOCKS, HEADS, 1, SLOTS, DIM]
    info = [("x", [1], "float32")]
    for name in ("past_key_values_0", "past_key_values_1"):
        kv = torch.zeros(shape, device="meta")
        ctx.mark_static_address(kv, name)
        info.append((name, shape, "float32"))
    return [rebel.compile_from_torch(TwoLayerKV(), info, compile_context=ctx) for _ in range(2)]


def _runtime() -> rebel.Runtime:
    return rebel.Runtime(_compiled_pair()[0], tensor_type="pt", device=0)


@pytest.fixture
def runtime():
    rt = _runtime()
    yield rt
    del rt
    gc.collect()


def test_copy_matches_a_plain_torch_reference(runtime):
    torch.manual_seed(0)
    bufs = list(runtime.kv_buffers.values())
    for buf in bufs:
        buf.copy_(torch.randn(buf.shape))
    expected = [b.clone() for b in bufs]
    for ref in expected:  # the reference: slots [0, 5) of block 1 land in block 3
        ref[3, :, :, :5] = ref[1, :, :, :5]

    runtime._copy_kv_cache(1, 3, 5)

    for got, ref in zip(bufs, expected, strict=True):
        assert torch.equal(got, ref)
    # Slots past the copied length keep the destination's own values.
    assert not torch.equal(bufs[0][3, :, :, 5:], bufs[0][1, :, :, 5:])


def test_copy_of_a_whole_block_and_of_nothing(runtime):
    bufs = list(runtime.kv_buffers.values())
    for i, buf in enumerate(bufs):
        buf.copy_(torch.arange(buf.numel(), dtype=buf.dtype).view(buf.shape) + i)
    before = [b.clone() for b in bufs]
    runtime._copy_kv_cache(0, 4, 0)
    assert all(torch.equal(a, b) for a, b in zip(bufs, before, strict=True))
    runtime._copy_kv_cache(0, 4, SLOTS)
    assert all(torch.equal(b[4], b[0]) for b in bufs)


@pytest.mark.parametrize(
    ("src", "dst", "length", "match"),
    [
        (BLOCKS, 0, 1, r"block ids must be in \[0, 5\)"),
        (0, -1, 1, r"block ids must be in \[0, 5\)"),
        (0, 1, SLOTS + 1, r"length must be in \[0, 8\]"),
    ],
)
def test_copy_rejects_out_of_range_arguments(runtime, src, dst, length, match):
    with pytest.raises(ValueError, match=match):
        runtime._copy_kv_cache(src, dst, length)


def test_copy_is_seen_by_every_graph_of_the_load():
    """Copying through one runtime (the prefill graph) changes the KV the other graph of the
    same load (a decoder graph) reads: the buffers are the load's, not the runtime's."""
    prefill_cm, decode_cm = _compiled_pair()
    prefill = rebel.Runtime(prefill_cm, tensor_type="pt", device=0)
    decode = rebel.Runtime(decode_cm, tensor_type="pt", device=0)
    name = "past_key_values_0"
    prefill.kv_buffers[name][2].fill_(7.0)
    before = decode(torch.zeros(1)).item()
    prefill._copy_kv_cache(2, 0, SLOTS)
    assert torch.equal(decode.kv_buffers[name][0], torch.full((HEADS, 1, SLOTS, DIM), 7.0))
    assert decode(torch.zeros(1)).item() == before + 7.0 * HEADS * SLOTS * DIM
    del prefill, decode
    gc.collect()
