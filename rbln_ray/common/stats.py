"""Latency summaries as ``vllm bench serve`` reports them (mean, p50, p99, max).

One home for the arithmetic, because the measured benchmarks (``benchmarks/``) and the fleet
simulation (:mod:`rbln_ray.planning.fleet`) are compared figure by figure: both must rank
and interpolate the same way.
"""

from __future__ import annotations

import statistics


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile, interpolating linearly between ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean / p50 / p99 and max, scaled (e.g. 1e3 for ms); all None when there are none."""
    if not values:
        return {"mean": None, "p50": None, "p99": None, "max": None}
    return {
        "mean": statistics.fmean(values) * scale,
        "p50": percentile(values, 50) * scale,  # type: ignore[operator]
        "p99": percentile(values, 99) * scale,  # type: ignore[operator]
        "max": max(values) * scale,
    }
