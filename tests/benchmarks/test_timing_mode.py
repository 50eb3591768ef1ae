"""Timing mode: a decode call takes about the modelled ATOM time and burns no CPU."""

from __future__ import annotations

import pytest

from rbln_ray.npu.cost_model import DeviceSpec, Row, call_cost, preset
from tests.helpers import compiled_model, run_script


def test_decode_call_sleeps_the_modelled_time() -> None:
    model = compiled_model("llama")
    # Model the device time of Llama-3-8B so the sleep dwarfs host jitter.
    result = run_script(
        "../benchmarks/timing_smoke.py",
        str(model),
        timeout=300,
        env={"RBLN_RAY_TIMING_SHAPE": "llama-3-8b"},
    )
    modelled = call_cost(preset("llama-3-8b"), [Row(1, 100)] * 4, 4, DeviceSpec()).seconds
    assert "timing" in result["runtime_repr"]
    assert result["logits_all_zero"] and result["logits_shape"][-1] == 4096
    assert result["stale_buffers_zeroed"]
    calls = [c for c in result["calls"] if c["kind"] == "decode"]
    assert len(calls) == 3
    for call in calls:
        assert call["modelled_s"] == pytest.approx(modelled, rel=1e-6)
        assert modelled * 0.999 <= call["end"] - call["start"] <= modelled * 1.5 + 0.02
    assert result["wall_s"] >= 3 * modelled
    assert result["cpu_s"] < 0.3 * result["wall_s"], result
