"""The ATOM timing model's arithmetic on a hand-computed case."""

from __future__ import annotations

import pytest

from rbln_ray.npu.cost_model import DeviceSpec, ModelShape, Row, call_cost, preset

SHAPE = ModelShape(
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=256,
)
SPEC = DeviceSpec(
    peak_flops=1e12,
    dram_bytes_per_s=1e9,
    compute_eff=1.0,
    dram_eff=1.0,
    call_overhead_s=1e-3,
    tp_eff=0.5,
    sync_per_layer_s=1e-4,
)


def test_decode_call_by_hand() -> None:
    # Per layer: q 64x64 + k,v 2x(64x32) + o 64x64 = 12288; MLP 3x64x128 = 24576; norms 128.
    layer = 12288 + 24576 + 128
    assert SHAPE.layer_params == layer == 36992
    # Two decode rows, each 1 new token after 10 cached.
    cost = call_cost(SHAPE, [Row(1, 10), Row(1, 10)], logit_rows=2, spec=SPEC)
    flops = 2 * 2 * layer * 2 + 2 * 256 * 64 * 2 + 4 * 2 * (4 * 16) * (2 * (10 + 1))
    assert flops == 372736
    weights = (2 * layer + 256 * 64) * 2
    kv_per_token = 2 * 2 * 2 * 16 * 2  # K and V, layers, kv heads, head_dim, FP16
    act = 2 * 2 * (6 * 64 + 2 * 128) * 2 + 2 * 256 * 4
    nbytes = weights + kv_per_token * 20 + kv_per_token * 2 + act
    assert nbytes == 193536
    assert cost.flops == pytest.approx(flops)
    assert cost.bytes == pytest.approx(nbytes)
    assert cost.compute_s == pytest.approx(flops / 1e12)
    assert cost.memory_s == pytest.approx(nbytes / 1e9)
    assert cost.bound == "bandwidth"
    assert cost.seconds == pytest.approx(nbytes / 1e9 + 1e-3)


def test_shard_group_and_compute_bound_prefill() -> None:
    one = call_cost(SHAPE, [Row(128, 0)], 1, SPEC)
    two = call_cost(SHAPE, [Row(128, 0)], 1, SPEC, num_devices=2)
    body = max(one.compute_s, one.memory_s)
    # Split over 2 devices, divided by tp_eff, plus per-layer sync.
    assert two.seconds == pytest.approx(body / 2 / 0.5 + 1e-3 + 2 * 1e-4)
    big = preset("llama-3-8b")
    prefill = call_cost(big, [Row(128, 0)], 1)
    decode = call_cost(big, [Row(1, 512)] * 4, 4)
    assert prefill.bound == "compute" and decode.bound == "bandwidth"
    assert 7.9e9 < big.params < 8.1e9
    assert big.kv_bytes_per_token == 131072


def test_verify_cost_is_a_decode_at_width_one_and_nearly_free_while_bandwidth_bound() -> None:
    from rbln_ray.npu.cost_model import PRESETS, decode_cost, expected_tokens, verify_cost

    shape = PRESETS["llama-3-8b"]
    for batch in (1, 4, 8):
        assert verify_cost(shape, batch, 1024, 1).seconds == decode_cost(shape, batch, 1024).seconds
        # ATOM: reading the weights dominates; 5 tokens per row cost about one
        ratio = verify_cost(shape, batch, 1024, 5).seconds / decode_cost(shape, batch, 1024).seconds
        assert 1.0 < ratio < 1.05, (batch, ratio)
    assert verify_cost(shape, 32, 1024, 9).bound == "compute"
    assert expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.0, 4) == 1
    assert abs(expected_tokens(0.6, 4) - (1 - 0.6**5) / 0.4) < 1e-12
