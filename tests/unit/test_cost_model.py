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


def test_whisper_calls_by_hand() -> None:
    """A tiny Whisper's encoder and decoder calls, the formula worked by hand
    (rbln_ray.npu.speech_cost), on a device of round numbers."""
    from rbln_ray.npu.cost_model import DeviceSpec
    from rbln_ray.npu.speech_cost import SpeechShape, decoder_cost, encoder_cost

    spec = DeviceSpec(
        peak_flops=1e12, dram_bytes_per_s=1e9, compute_eff=1, dram_eff=1, call_overhead_s=0
    )
    s = SpeechShape(d_model=4, encoder_layers=1, decoder_layers=1, heads=1, encoder_ffn=8,
                    decoder_ffn=8, vocab_size=10, num_mel_bins=2, source_positions=3)  # fmt: skip
    enc = encoder_cost(s, spec)
    # conv 2*3*2*4*6 + 2*3*4*4*3 = 288 + 288; linear 2*1*(64+64)*3 = 768;
    # attention 4*1*4*9 = 144; cross projection 2*(1*2*16)*3 = 192
    assert enc.flops == 288 + 288 + 768 + 144 + 192
    # weights (128 + 3*2*4+3*16 + 32) * 2 = 464; activations 1*3*(24+16)*2 = 240, mel 6*2*4 = 48;
    # cross KV written 2*1*3*4*2 = 48
    assert enc.bytes == 464 + 240 + 48 + 48
    dec = decoder_cost(s, [0, 5], spec)
    # linear 2*1*(96+64)*2 = 640; head 2*10*4*2 = 160; self 4*1*4*(1+6) = 112;
    # cross 4*1*4*3*2 = 96
    assert dec.flops == 640 + 160 + 112 + 96
    # weights (160 + 40)*2 = 400; self KV 16*(5+2) = 112; cross KV 48*2 = 96;
    # activations 1*2*(32+16)*2 + 2*10*4 = 272
    assert dec.bytes == 400 + 112 + 96 + 272
    assert dec.seconds == max(dec.flops / 1e12, dec.bytes / 1e9)


def test_timing_mode_models_whisper_graphs_by_their_own_shape(tmp_path, monkeypatch) -> None:
    """A Whisper directory's graphs get the speech cost model: its own config, or a Whisper
    preset named by RBLN_RAY_TIMING_SHAPE; a decoder preset there is refused by name."""
    import json
    from types import SimpleNamespace

    import pytest

    from rbln_ray.emulator.speech_timing import SpeechGraphTiming, speech_shape_of
    from rbln_ray.npu.speech_cost import PRESETS

    cfg = {"model_type": "whisper", "d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
           "decoder_attention_heads": 1, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
           "vocab_size": 100, "num_mel_bins": 80, "max_source_positions": 1500}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    decoder = SimpleNamespace(
        path=str(tmp_path / "decoder.rbln"),
        input_info=[("decoder_input_ids", [4, 1], "int64"), ("cache_position", [4, 1], "int32")],
    )
    monkeypatch.delenv("RBLN_RAY_TIMING_SHAPE", raising=False)
    assert speech_shape_of(decoder).d_model == 64
    monkeypatch.setenv("RBLN_RAY_TIMING_SHAPE", "whisper-large-v3")
    timing = SpeechGraphTiming(decoder, speech_shape_of(decoder))
    import torch

    ids, pos = torch.zeros(4, 1, dtype=torch.long), torch.tensor([[0], [9], [0], [0]])
    cost = timing.cost((ids, pos))
    assert (
        cost.breakdown["bytes_cross_kv_read"]
        == 4 * PRESETS["whisper-large-v3"].cross_kv_bytes_per_row
    )
    monkeypatch.setenv("RBLN_RAY_TIMING_SHAPE", "llama-3-8b")
    with pytest.raises(ValueError, match="names no speech model"):
        speech_shape_of(decoder)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert speech_shape_of(decoder) is None


def test_the_registry_passes_down_which_mlps_have_no_gate() -> None:
    """Which families' MLPs are up/down only is a registry fact (DecoderFamily.gated_mlp);
    the cost model, below the registry, costs a config of such a model_type with two
    matrices a layer, every other with three."""
    from rbln_ray.families.registry import DECODERS
    from rbln_ray.npu.cost_model import ModelShape

    def shape(model_type: str) -> ModelShape:
        return ModelShape.from_hf_config(
            {"model_type": model_type, "num_hidden_layers": 1, "hidden_size": 8,
             "num_attention_heads": 2, "intermediate_size": 16, "vocab_size": 10}
        )  # fmt: skip

    ungated = {f.model_type for f in DECODERS.values() if not f.gated_mlp}
    assert ungated == {"gpt2", "opt", "phi"}
    for f in DECODERS.values():
        assert shape(f.model_type).gated_mlp == f.gated_mlp, f.name
    assert shape("opt").expert_params == 2 * 8 * 16
    assert shape("llama").expert_params == 3 * 8 * 16


def test_a_handover_between_nodes_costs_its_kv_bytes_over_the_network(monkeypatch) -> None:
    """llama-3-8b's KV is 128 KiB per token: 2,048 tokens (256 MiB) over 100 Gb/s at 0.8 take
    about 27 ms; the link is set from the environment like the other timing parameters."""
    from rbln_ray.npu.cost_model import network_transfer_cost

    shape = preset("llama-3-8b")
    assert shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert network_transfer_cost(shape, 2048) == pytest.approx(2048 * 131072 / (12.5e9 * 0.8))
    monkeypatch.setenv("RBLN_RAY_TIMING_NETWORK_GBITS", "400")
    fast = DeviceSpec.from_env()
    assert fast.network_bytes_per_s == 50e9
    assert network_transfer_cost(shape, 2048, fast) == pytest.approx(
        network_transfer_cost(shape, 2048) / 4
    )


def test_timing_mode_waits_the_modelled_network_time_of_a_handover(tmp_path, monkeypatch) -> None:
    """What a decode replica waits for KV fetched from another node: the modelled shape's
    bytes over the link in timing and modelled mode, nothing in compute mode."""
    from rbln_ray.emulator.timing import network_seconds
    from rbln_ray.npu.cost_model import network_transfer_cost

    monkeypatch.setenv("RBLN_RAY_TIMING_SHAPE", "llama-3-8b")
    monkeypatch.setenv("RBLN_RAY_EMULATOR_MODE", "compute")
    assert network_seconds(tmp_path, 2048) == 0.0
    for mode in ("timing", "modelled"):
        monkeypatch.setenv("RBLN_RAY_EMULATOR_MODE", mode)
        expected = network_transfer_cost(preset("llama-3-8b"), 2048)
        assert network_seconds(tmp_path, 2048) == pytest.approx(expected)
