"""The benchmarks' step-log arithmetic (host overhead, occupancy) on hand-made logs."""

from __future__ import annotations

import pytest

from benchmarks.common import host_overhead
from benchmarks.host_overhead import occupancy


def _call(kind: str, start: float, end: float, batch: int = 4) -> dict:
    return {"kind": kind, "start": start, "end": end, "batch": batch, "modelled_s": None}


def test_host_overhead_skips_steps_next_to_a_prefill() -> None:
    calls = [
        _call("decode", 0.000, 0.010),
        _call("decode", 0.012, 0.022),  # period 12 ms, device 10 ms -> host 2 ms
        _call("prefill", 0.025, 0.040),  # the decode before it is not a decode-decode pair
        _call("decode", 0.043, 0.053),
        _call("decode", 0.056, 0.066),  # period 13 ms, device 10 ms -> host 3 ms
        _call("decode", 0.069, 0.070, batch=2),  # d3 -> here: host 3 ms (d3 is batch 4)
        _call("decode", 0.072, 0.073, batch=2),  # a batch-2 step: filtered out
    ]
    result = host_overhead(calls, batch=4)
    assert result["steps"] == 3
    assert result["host_ms"]["p50"] == pytest.approx(3.0)
    assert result["host_ms"]["mean"] == pytest.approx(8 / 3)
    assert result["device_ms"]["p50"] == pytest.approx(10.0)
    assert result["host_over_device_p50"] == pytest.approx(0.3)


def test_occupancy_counts_decode_rows_while_requests_wait() -> None:
    # Steps 1-3 belong to an earlier phase; the runner numbers steps from 1.
    history = [
        (1, "prefill", ("old",)),
        (2, "decode", ("old",)),
        (3, "decode", ("old",)),
        (4, "prefill", ("a",)),
        (5, "prefill", ("b",)),
        (6, "decode", ("a", "b")),
        (7, "prefill", ("c",)),  # the last admission: nothing waits after it
        (8, "decode", ("a", "b", "c")),
        (9, "decode", ("a", "c")),
    ]
    phase = {
        "rbln": {
            "step_stats": {"history": history},
            "step_stats_before": {"prefill_steps": 1, "decode_steps": 2},
            "calls": {"calls": [_call("decode", 1.0, 2.0), _call("decode", 3.0, 4.0)]},
            "window": [0.0, 10.0],
        }
    }
    occ = occupancy(phase, batch=4)
    assert (occ["prefill_steps"], occ["decode_steps"], occ["saturated_decode_steps"]) == (3, 3, 1)
    assert occ["row_occupancy"] == pytest.approx(2 / 4)
    assert occ["row_occupancy_drain_tail"] == pytest.approx(5 / 8)
    assert occ["row_occupancy_whole_phase"] == pytest.approx(7 / 12)
    assert occ["device_busy_fraction"] == pytest.approx(0.2)
