"""What a fleet run measured, as ``benchmarks.sessions.summarise`` and BENCHMARKS 15 count it.

A request meets the SLO when its own TTFT (send to first token) and TPOT ((last - first) /
(output tokens - 1)) are within the bounds; goodput is those requests per second of the
measured window (the turns *sent* in it); percentiles interpolate linearly between ranks
(:func:`rbln_ray.common.stats.percentile`). The prefix-cache hit rate is vLLM's: prompt tokens found
cached over prompt tokens looked up, over every replica and the whole run.
"""

from __future__ import annotations

from typing import Any

from rbln_ray.common.stats import summary
from rbln_ray.planning.fleet.sim import FleetRun


def summarise(
    run: FleetRun, window: tuple[float, float], ttft_slo_s: float, tpot_slo_s: float,
    latency_s: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    """Throughput, latency percentiles, goodput and hit rate of a run. ``latency_s`` is
    added to every TTFT (a fixed HTTP path, when one is modelled)."""
    lo, hi = window
    records = [r for r in run.requests if lo <= r.sent < hi]
    done = [r for r in records if r.last >= 0]
    elapsed = hi - lo
    ttft = [r.first + latency_s - r.sent for r in done]
    tpot = [(r.last - r.first) / (r.generated - 1) for r in done if r.generated > 1]

    def good(r: Any) -> bool:
        per_token = (r.last - r.first) / max(1, r.generated - 1)
        return r.first + latency_s - r.sent <= ttft_slo_s and per_token <= tpot_slo_s

    met = sum(good(r) for r in done)
    queries = sum(rep.queries for rep in run.replicas)
    hits = sum(rep.hits for rep in run.replicas)
    n = run.config.replicas
    busy = [rep.busy_s for rep in run.replicas]
    return {
        "replicas": n,
        "requests": len(records),
        "completed": len(done),
        "elapsed_s": elapsed,
        "req_per_s": len(done) / elapsed,
        "output_tok_per_s": sum(r.generated for r in done) / elapsed,
        "prompt_tokens": sum(r.prompt_len for r in done),
        "ttft_ms": summary(ttft, 1e3),
        "tpot_ms": summary(tpot, 1e3),
        "slo_met": met,
        "slo_attainment": met / len(records) if records else None,
        "goodput_req_per_s": met / elapsed,
        "goodput_per_device": met / elapsed / n,
        "hit_rate": hits / queries if queries else None,
        "hit_rate_per_replica": summary(
            [rep.hits / rep.queries for rep in run.replicas if rep.queries]
        ),
        "device_busy_share": summary([b / run.end_s for b in busy]) if run.end_s else None,
        "steps": {
            "prefill": sum(rep.steps["prefill"] for rep in run.replicas),
            "decode": sum(rep.steps["decode"] for rep in run.replicas),
            "copied_tokens": sum(rep.copied_tokens for rep in run.replicas),
        },
        "session_stickiness": stickiness(run),
        "retries": run.retries,
        "events": run.events,
    }


def stickiness(run: FleetRun) -> float | None:
    """Share of follow-up turns served by the replica that served the turn before."""
    last: dict[str, int] = {}
    same = total = 0
    for r in sorted(run.requests, key=lambda r: r.sent):
        if r.replica < 0:
            continue
        if r.session in last:
            total += 1
            same += last[r.session] == r.replica
        last[r.session] = r.replica
    return same / total if total else None
