"""Size a fleet by simulating it: the fewest replicas that serve a rate within an SLO.

What ``rbln-ray plan --simulate`` runs (:mod:`rbln_ray.cli.plan_cmd`): the analytic plan
(:mod:`rbln_ray.planning.planner`) prices one replica saturated with identical requests; this
serves the workload BENCHMARKS 15 measured (multi-turn chat and RAG sessions sharing
tenants' system prompts and documents, :mod:`.workload`) at the requested rate on simulated
replicas of the plan's shape behind the injected router (the real cache-aware router), and
searches the replica count: from a first guess, doubling until the share of requests meeting
the SLO reaches the target, then bisecting down to the fewest that still do. Every count
tried is one simulation of ``duration_s`` of arrivals, the first ``warmup_s`` not measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rbln_ray.planning.fleet.events import EventQueue
from rbln_ray.planning.fleet.metrics import summarise
from rbln_ray.planning.fleet.replica import ReplicaConfig
from rbln_ray.planning.fleet.sim import Fleet, FleetConfig, FleetRouter, Keyer
from rbln_ray.planning.fleet.workload import Corpus, SessionSpec, build_sessions

# BENCHMARKS 15: 32 tenants and 32 documents at its goal rate of 1.4375 req/s
TENANTS_PER_REQ_S = 32 / 1.4375
RouterFactory = Callable[[int, Callable[[], float]], Sequence[FleetRouter]]


@dataclass(frozen=True)
class SizingTarget:
    rate: float  # requests per second to serve
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.150
    attainment: float = 0.9  # share of requests meeting the SLO
    tenants: int | None = None  # default: BENCHMARKS 15's per request per second
    documents: int | None = None
    duration_s: float = 180.0
    warmup_s: float = 60.0
    max_replicas: int = 256  # larger fleets take minutes per simulation here
    seed: int = 0

    def spec(self) -> SessionSpec:
        density = max(1, math.ceil(TENANTS_PER_REQ_S * self.rate))
        return SessionSpec(
            rate=self.rate,
            duration_s=self.duration_s,
            seed=self.seed,
            tenants=self.tenants or density,
            num_docs=self.documents or density,
        )


@dataclass
class Sizing:
    replicas: int | None  # the fewest that met the target (None: none up to the limit)
    tried: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""


def simulate_count(
    replicas: int,
    target: SizingTarget,
    replica: ReplicaConfig,
    routers: RouterFactory,
    keyer: Keyer,
    corpus: Corpus | None = None,
) -> dict[str, Any]:
    """One simulation of ``target``'s workload on ``replicas`` replicas."""
    workload = build_sessions(target.spec(), tag="plan")
    queue = EventQueue()
    made = list(routers(replicas, lambda: queue.now))
    config = FleetConfig(replicas, replica, stop_s=target.duration_s, seed=target.seed)
    run = Fleet(config, workload, corpus or Corpus(), made, keyer, queue).run()
    res = summarise(run, (target.warmup_s, target.duration_s), target.ttft_slo_s,
                    target.tpot_slo_s)  # fmt: skip
    res["met"] = (res["slo_attainment"] or 0.0) >= target.attainment
    timings = [t for t in (getattr(r, "timings", None) for r in made) if t is not None]
    decisions = sorted(ns for t in timings for ns in t.decision_cpu_ns)
    reads = [ns for t in timings for ns in t.read_cpu_ns]
    if decisions:
        res["decision_cpu_us_p99"] = decisions[int(0.99 * (len(decisions) - 1))] / 1e3
        # the router's CPU per request in an ingress replica: reading it, then deciding
        res["router_cpu_s_per_request"] = (sum(decisions) + sum(reads)) / len(decisions) / 1e9
    return res


def size_fleet(
    target: SizingTarget,
    replica: ReplicaConfig,
    routers: RouterFactory,
    keyer: Keyer,
    first_guess: int = 1,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> Sizing:
    """The fewest replicas meeting ``target`` (module docstring)."""
    corpus = Corpus()
    results: dict[int, dict[str, Any]] = {}

    def meets(n: int) -> bool:
        if n not in results:
            res = simulate_count(n, target, replica, routers, keyer, corpus)
            res["replicas"] = n
            results[n] = res
            if progress:
                progress(res)
        return results[n]["met"]

    n = max(1, min(first_guess, target.max_replicas))
    if meets(n):
        good, bad = n, 0
        while bad == 0 and good > 1:  # halve until a count misses
            half = good // 2
            if meets(half):
                good = half
            else:
                bad = half
    else:
        bad = n
        good = 0
        while good == 0:
            if bad >= target.max_replicas:
                tried = [results[k] for k in sorted(results)]
                return Sizing(None, tried, f"not met with up to {target.max_replicas} replicas")
            nxt = min(2 * bad, target.max_replicas)
            if meets(nxt):
                good = nxt
            else:
                bad = nxt
    while good - bad > 1:  # bisect between a count that misses and one that meets
        mid = (good + bad) // 2
        if meets(mid):
            good = mid
        else:
            bad = mid
    tried = [results[k] for k in sorted(results)]
    return Sizing(good, tried, "")
