"""`rbln-ray plan` answers sensibly for Llama-3-8B-sized and 70B-sized models."""

from __future__ import annotations

import json

from rbln_ray.cli.plan_cmd import main as plan_main
from rbln_ray.npu.cost_model import DEVICE_DRAM_BYTES, preset
from rbln_ray.planning import Limits, Workload, plan, shape_from_dims

GiB = 2**30


def test_llama3_8b_plan(capsys) -> None:
    rc = plan_main(
        [
            "--model",
            "llama-3-8b",
            "--input-len",
            "512",
            "--output-len",
            "128",
            "--rate",
            "5",
            "--json",
        ]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    c = result["chosen"]
    assert c["cards"] >= 1 and c["replicas"] >= 1
    assert c["cards"] == c["replicas"] * c["devices_per_worker"]
    usable = (DEVICE_DRAM_BYTES - Limits().reserve_bytes) / GiB
    assert c["weights_per_device_gib"] + c["kv_per_device_gib"] <= usable
    weights_gib = preset("llama-3-8b").weight_bytes_total / GiB
    assert 14 < weights_gib < 15.5
    assert c["weights_per_device_gib"] * c["devices_per_worker"] >= weights_gib * 0.99
    # capacity covers the rate at the target utilization
    assert c["replica_req_s"] * c["replicas"] * 0.8 >= 5
    assert set(result["bounds"]) >= {"devices_per_worker", "batch", "replicas"}


def test_more_load_needs_more_cards_and_text_output(capsys) -> None:
    shape = preset("llama-3-8b")
    low = plan(shape, Workload(512, 128, rate=1)).chosen
    high = plan(shape, Workload(512, 128, rate=20)).chosen
    assert high.cards > low.cards
    assert (
        plan_main(
            ["--model", "llama-3-8b", "--input-len", "128", "--output-len", "64", "--rate", "2"]
        )
        == 0
    )
    assert "PLAN:" in capsys.readouterr().out


def test_70b_needs_a_shard_group_and_dims_input() -> None:
    shape = preset("llama-3-70b")
    limits = Limits(cards_per_node=16)
    chosen = plan(shape, Workload(512, 128, rate=1), limits=limits).chosen
    assert chosen is not None and chosen.devices_per_worker >= 16
    assert (
        "memory" in plan(shape, Workload(512, 128, 1), limits=limits).bounds["devices_per_worker"]
    )
    # 8 cards per node cannot hold 141 GB of FP16 weights in one shard group
    assert plan(shape, Workload(512, 128, rate=1)).chosen is None
    coarse = shape_from_dims(8.03e9, 32, 4096, 131072, vocab_size=128256)
    assert coarse.kv_bytes_per_token == 131072
    assert abs(coarse.params - 8.03e9) / 8.03e9 < 0.02


def test_moe_presets_count_only_active_experts_in_flops(capsys) -> None:
    """Mixtral-8x7B: memory holds all 8 experts (46.7 B params), FLOPs use the 2 routed
    ones (12.9 B); a one-token decode reads ~2/8 of the experts, a long prefill all."""
    from rbln_ray.npu.cost_model import Row, call_cost

    mixtral = preset("mixtral-8x7b")
    assert abs(mixtral.params - 46.7e9) / 46.7e9 < 0.01
    assert abs(mixtral.active_params - 12.9e9) / 12.9e9 < 0.01
    prefill = call_cost(mixtral, [Row(new=512)], logit_rows=1)
    per_layer_active = prefill.breakdown["flops_linear"] / (2 * 512 * mixtral.num_layers)
    assert per_layer_active == mixtral.active_layer_params < mixtral.layer_params / 3
    one = call_cost(mixtral, [Row(new=1, start=100)], logit_rows=1).breakdown["bytes_weights"]
    assert prefill.breakdown["bytes_weights"] > 3 * one
    embeddings = mixtral.vocab_size * mixtral.hidden_size * mixtral.weight_bytes  # a lookup
    all_read = mixtral.weight_bytes_total - embeddings
    assert abs(prefill.breakdown["bytes_weights"] - all_read) < 1e-3 * all_read
    assert (
        plan_main(
            ["--model", "mixtral-8x7b", "--input-len", "512", "--output-len", "64", "--rate", "1"]
        )
        == 0
    )
    assert "mixtral-8x7b" in capsys.readouterr().out
    for name in ("gemma-2-9b", "phi-2", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "gpt-oss-20b"):
        assert plan(preset(name), Workload(512, 128, rate=1)).model["name"] == name


def test_quantized_footprints_fit_llama3_8b_on_one_atom(capsys) -> None:
    """FP16 Llama-3-8B (15 GiB) leaves one ATOM no room for a batch of 4; int8 or fp8
    projections (half their bytes, plus fp32 scales) do, and fp8 KV doubles the batch that
    fits beside them."""
    from dataclasses import replace

    shape = preset("llama-3-8b")
    int8 = replace(shape, linear_weight_bytes=1.0)
    fp8kv = replace(int8, kv_bytes=1)
    projections = sum(i * o for i, o in shape.projection_dims().values()) * shape.num_layers
    saved = shape.weight_bytes_total - int8.weight_bytes_total
    scales = 4 * shape.num_layers * sum(o for _, o in shape.projection_dims().values())
    assert saved == projections - scales
    assert fp8kv.kv_bytes_per_token * 2 == shape.kv_bytes_per_token
    work = Workload(1024, 256, rate=1)

    def best_single_device_batch(s) -> int:
        fits = [o.batch for o in plan(s, work).options if o.devices_per_worker == 1 and o.fits]
        return max(fits, default=0)

    assert best_single_device_batch(shape) < 4
    assert best_single_device_batch(int8) >= 8
    assert best_single_device_batch(fp8kv) >= 2 * best_single_device_batch(int8) - 1
    # decode is bandwidth-bound at small batch: fewer weight bytes, a shorter step
    from rbln_ray.npu.cost_model import decode_cost

    assert decode_cost(int8, 1, 512).seconds < 0.62 * decode_cost(shape, 1, 512).seconds
    rc = plan_main(
        ["--model", "llama-3-8b", "--weights", "int8", "--kv-cache-dtype", "fp8"]
        + ["--input-len", "1024", "--output-len", "256", "--rate", "1", "--json"]
    )
    assert rc == 0
    options = json.loads(capsys.readouterr().out)["options"]
    assert max(o["batch"] for o in options if o["devices_per_worker"] == 1 and o["fits"]) >= 16


def test_artifact_options_and_lora_in_the_cost_model(tmp_path) -> None:
    from rbln_ray.npu.cost_model import Row, call_cost
    from rbln_ray.planning import compiled_shape

    shape = preset("llama-3-8b")
    raw = {
        "quantization": {"weights": "fp8", "kv_caches": "fp8"},
        "lora_config": {
            "adapters": [
                {"r": 8, "target_modules": ["q_proj", "v_proj"]},
                {"r": 16, "target_modules": ["o_proj"]},
            ],
            "max_lora_rank": 16,
        },
    }
    (tmp_path / "rbln_config.json").write_text(json.dumps(raw))
    compiled = compiled_shape(shape, str(tmp_path))
    assert compiled.linear_weight_bytes == 1.0 and compiled.kv_bytes == 1
    assert (compiled.lora_adapters, compiled.lora_rank) == (2, 16)
    assert compiled.lora_modules == ("o_proj", "q_proj", "v_proj")
    lora_only = replace_lora(shape, compiled)
    # 3 stacked adapters (base zeros included) x rank 16 x (in + out) of q, v, o, FP16
    dims = shape.projection_dims()
    per_layer = 3 * 16 * sum(sum(dims[m]) for m in ("q_proj", "v_proj", "o_proj")) * 2
    assert lora_only.weight_bytes_total - shape.weight_bytes_total == per_layer * 32
    rows = [Row(1, 100)] * 4
    assert call_cost(lora_only, rows, 4).flops > call_cost(shape, rows, 4).flops
    # an HF dir's pre-quantized quantization_config counts too
    hf = tmp_path / "hf"
    hf.mkdir()
    qc = {"quant_method": "rbln", "weights": "int8", "kv_caches": "fp16"}
    (hf / "config.json").write_text(json.dumps({"quantization_config": qc}))
    assert compiled_shape(shape, str(hf)).linear_weight_bytes == 1.0
    assert compiled_shape(shape, "llama-3-8b") == shape


def replace_lora(shape, source):
    from dataclasses import replace

    return replace(
        shape,
        lora_adapters=source.lora_adapters,
        lora_rank=source.lora_rank,
        lora_modules=source.lora_modules,
    )


def test_host_tier_sizing_for_a_node(capsys) -> None:
    """``--host-gib``: llama-3-8b keeps 2 x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB
    of KV per token, so 64 GiB hold 524,288 tokens; a 3,000-token prefix crosses PCIe 5.0 x16
    (63 GB/s at 80 %) in 7.8 ms plus one call (0.1 ms), far less than its prefill."""
    args = ["--model", "llama-3-8b", "--input-len", "3000", "--output-len", "128", "--rate",
            "4", "--host-gib", "64", "--json"]  # fmt: skip
    assert plan_main(args) == 0
    tier = json.loads(capsys.readouterr().out)["host_tier"]
    assert tier["tier_tokens"] == 64 * 2**30 // (2 * 32 * 8 * 128 * 2) == 524_288
    assert abs(tier["load_ms"] - (3000 * 131072 / (63e9 * 0.8) * 1e3 + 0.1)) < 1e-6
    assert tier["prefill_ms"] > 100 * tier["load_ms"]
    assert plan_main(args[:-1]) == 0
    assert "host KV tier: 64 GiB per node holds 524,288 tokens" in capsys.readouterr().out


def test_pd_advice_splits_pools_by_their_device_time(capsys) -> None:
    """``--pd``: a prefill-heavy workload (3,500 in / 32 out) needs more of a prefill
    replica per request than of a decode replica, a decode-heavy one (200 in / 1,024 out) the
    reverse; the decode pool's TPOT is one decode step, below the co-located plan's (whose
    TPOT carries the batch's prefills); the pools grow with the rate."""

    def advice(input_len: int, output_len: int, rate: float) -> tuple[dict, dict]:
        args = ["--model", "llama-3-8b", "--input-len", str(input_len), "--output-len",
                str(output_len), "--rate", str(rate), "--batch-sizes", "4", "--pd",
                "--json"]  # fmt: skip
        assert plan_main(args) == 0
        out = json.loads(capsys.readouterr().out)
        return out["disaggregation"], out["chosen"]

    heavy, chosen = advice(3500, 32, 1)
    assert heavy["prefill_s_per_request"] > heavy["decode_s_per_request"]
    assert heavy["prefill_replicas"] > heavy["decode_replicas"]
    assert heavy["prefill_s_per_request"] > chosen["prefill_ms"] / 1e3  # plus the export
    assert heavy["tpot_ms"] == chosen["decode_step_ms"] < chosen["tpot_ms"]
    light, _ = advice(200, 1024, 1)
    assert light["decode_s_per_request"] > 10 * light["prefill_s_per_request"]
    assert light["decode_replicas"] > light["prefill_replicas"]
    more, _ = advice(3500, 32, 4)
    assert more["prefill_replicas"] > heavy["prefill_replicas"]
    assert plan_main(["--model", "llama-3-8b", "--input-len", "3000", "--output-len", "128",
                      "--rate", "1", "--pd"]) == 0  # fmt: skip
    assert "prefill/decode disaggregation (Serve config `pd`)" in capsys.readouterr().out
