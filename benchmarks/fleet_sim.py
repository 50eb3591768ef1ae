"""Fleet simulation: the cache-aware router at 4 to 1,024 replicas (issue 49, items 1 and 2).

A discrete-event simulation (``rbln_ray/planning/fleet``) in which the real router code
decides (``rbln_ray/serve/fleet_router.py``: ``CacheAwareRouter`` fed as Serve feeds it, each
decision timed on this machine), and replicas are simulated: rbln-ray's engine step shapes
on the cost model's device times (Llama-3-8B on one ATOM), prefix caching on the compiled
RBLN block plan (16 blocks of 4,096 tokens, the real ``OuterBlockManager``), reports of
cached blocks and service times as replicas send them.

Two parts, one run, one commit:

1. **Validation**: 4 replicas, BENCHMARKS 15's workload and protocol exactly (its sessions,
   draw for draw: rates 1.0-1.5 req/s with seeds 100-104, 300 s of arrivals, the first 60 s
   not measured, 32 tenants, 32 documents), against its measured run of (a)
   (``benchmarks/results/cluster_goodput_issue35.json``).
2. **Scale**: 4, 16, 64, 256 and 1,024 replicas, the same workload with tenants, documents
   and rate scaled with the replica count (8 tenants, 8 documents and 1.4375 / 4 req/s per
   replica: BENCHMARKS 15's goal rate), ``--duration`` of arrivals, the first ``--warmup``
   not measured; small fleets pooled over several seeds so every row measures at least as
   many replica-seconds as the 64-replica one. Per row: goodput per device, hit rate, TTFT
   and TPOT p50/p99, router decision time p50/p99 (wall and CPU, µs), the router's state
   in bytes, and the ingress replicas the row needs (``rbln_ray/planning/fleet/ingress.py``).
   Two controls: 64 replicas with every decision the full scan (``exact_scan_max`` above
   64: the order as measured in BENCHMARKS 15) and 256 replicas behind 8 ingress routers.

    python -m benchmarks.fleet_sim             # full: ~minutes of CPU, longer on a busy host
    python -m benchmarks.fleet_sim --quick     # smoke: 4 and 16 replicas, 60 s
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
from typing import Any

from benchmarks import common
from rbln_ray.common.stats import percentile
from rbln_ray.planning.fleet import (
    DEFAULT_MODE,
    THROUGHPUT_MODE,
    Corpus,
    EventQueue,
    Fleet,
    FleetConfig,
    ReplicaConfig,
    SessionSpec,
    build_sessions,
    summarise,
)
from rbln_ray.planning.fleet.ingress import replicas_needed
from rbln_ray.planning.fleet.metrics import stickiness
from rbln_ray.serve.fleet_router import SimulatedRouter, block_keys
from rbln_ray.serve.kv_events import STATS_BLOCKS, report_keys

MEASURED = common.RESULTS / "cluster_goodput_issue35.json"  # BENCHMARKS 15's full run
RATES = (1.0, 1.25, 1.375, 1.4375, 1.5)  # its rates, seeds 100 + their place
GOAL_RATE = 1.4375  # its goal's rate: the scale rows' rate per 4 replicas
COUNTS = (4, 16, 64, 256, 1024)
GOAL_DECISION_US = 1000.0
GOAL_GOODPUT_RATIO = 0.9
TOLERANCE = 0.10  # validation: goodput and TTFT p50 within 10 %


# ------------------------------------------------------------------ one simulated run
def simulate(
    replicas: int,
    rate: float,
    duration: float,
    seed: int,
    tenants: int,
    docs: int,
    routers: int = 1,
    exact_scan_max: int | None = None,
    corpus: Corpus | None = None,
    report_load: bool = True,
) -> dict[str, Any]:
    """One run; returns the run, its routers and the router state at the window's end."""
    spec = SessionSpec(rate=rate, duration_s=duration, seed=seed, tenants=tenants, num_docs=docs)
    workload = build_sessions(spec, tag=f"r{rate:g}")  # its session ids: cluster_goodput's
    queue = EventQueue()
    extra = {} if exact_scan_max is None else {"exact_scan_max": exact_scan_max}
    sims = [SimulatedRouter(replicas, lambda: queue.now, **extra) for _ in range(routers)]
    fleet = Fleet(
        FleetConfig(replicas, ReplicaConfig(report_load=report_load), stop_s=duration, seed=seed),
        workload,
        corpus or Corpus(),
        sims,
        block_keys(),
        queue,
    )
    probe: dict[str, Any] = {}

    def at_window_end() -> None:  # the router's state while the fleet is loaded
        probe["state_bytes"] = sims[0].state_bytes()
        probe["reports"] = [r.routing_stats for r in sims[0].listing]

    queue.at(duration, at_window_end)
    wall, cpu = time.perf_counter(), time.process_time()
    run = fleet.run()
    return {
        "run": run,
        "routers": sims,
        "wall_s": time.perf_counter() - wall,
        "cpu_s": time.process_time() - cpu,
        **probe,
    }


def unpickle_ms(reports: list[dict[str, Any]]) -> dict[str, float]:
    """CPU ms to unpickle one broadcast of these reports, as replicas send them (keys as
    int64 byte strings, ``kv_events.pack_keys``) and as they sent them before (key lists)."""
    lists = [{**r, STATS_BLOCKS: sorted(report_keys(r.get(STATS_BLOCKS)))} for r in reports]
    out = {}
    for name, payload in (("list", lists), ("bytes", reports)):
        blob = pickle.dumps(payload, protocol=5)
        times = []
        for _ in range(5):
            start = time.thread_time()
            pickle.loads(blob)
            times.append(time.thread_time() - start)
        out[f"{name}_ms"] = statistics.median(times) * 1e3
        out[f"{name}_bytes"] = len(blob)
    return out


def pooled(results: list[dict[str, Any]], window: tuple[float, float], args: Any) -> dict:
    """Metrics of several seeds' runs as one: every measured request's latencies, rates
    per second of all the windows together, the routers' decisions in the windows."""
    runs = [r["run"] for r in results]
    merged = type(runs[0])(
        runs[0].config,
        [q for run in runs for q in run.requests],
        [rep for run in runs for rep in run.replicas],
        [router for run in runs for router in run.routers],
        sum(run.events for run in runs),
        sum(run.retries for run in runs),
        sum(run.broadcasts for run in runs),
        max(run.end_s for run in runs),
    )
    res = summarise(merged, window, args.ttft_slo_s, args.tpot_slo_ms / 1e3)
    seeds = len(runs)
    for key in ("req_per_s", "output_tok_per_s", "goodput_req_per_s"):
        res[key] /= seeds
    res["replicas"] = len(runs[0].replicas)
    res["goodput_per_device"] = res["goodput_req_per_s"] / res["replicas"]
    res["seeds"] = seeds
    # per run (the seeds' session ids repeat), weighted by the run's requests
    sticky = [(stickiness(run), len(run.requests)) for run in runs]
    sticky = [(s, n) for s, n in sticky if s is not None]
    res["session_stickiness"] = (
        sum(s * n for s, n in sticky) / sum(n for _, n in sticky) if sticky else None
    )
    lo, hi = window
    routers = [s for r in results for s in r["routers"]]
    chosen = [
        (ns, cpu)
        for s in routers
        for at, ns, cpu in zip(s.timings.decided_at, s.timings.decision_ns,
                               s.timings.decision_cpu_ns, strict=True)
        if lo <= at < hi
    ]  # fmt: skip
    wall_us = [ns / 1e3 for ns, _ in chosen]
    cpu_us = [cpu / 1e3 for _, cpu in chosen]
    every = [ns / 1e3 for s in routers for ns in s.timings.decision_ns]
    read_cpu = [ns / 1e3 for s in routers for ns in s.timings.read_cpu_ns]
    update_cpu = [ns / 1e6 for s in routers for ns in s.timings.update_cpu_ns]
    update_wall = [ns / 1e6 for s in routers for ns in s.timings.update_ns]
    res["router"] = {
        "decisions_measured": len(chosen),
        "decision_us": {"p50": percentile(wall_us, 50), "p99": percentile(wall_us, 99),
                        "max": max(wall_us, default=None)},
        "decision_cpu_us": {"p50": percentile(cpu_us, 50), "p99": percentile(cpu_us, 99),
                            "mean": statistics.fmean(cpu_us) if cpu_us else None},
        "decision_us_whole_run": {"p50": percentile(every, 50), "p99": percentile(every, 99),
                                  "decisions": len(every)},
        "read_cpu_us": {"p50": percentile(read_cpu, 50), "p99": percentile(read_cpu, 99),
                        "mean": statistics.fmean(read_cpu) if read_cpu else None},
        "reindex_ms": {"p50": percentile(update_wall, 50), "p99": percentile(update_wall, 99),
                       "cpu_mean": statistics.fmean(update_cpu) if update_cpu else None},
        "broadcasts_per_s": sum(r.broadcasts for r in runs) / sum(r.end_s for r in runs),
        "routers": len(results[0]["routers"]),
    }  # fmt: skip
    res["router_state_bytes"] = results[0]["state_bytes"]
    res["report_unpickle"] = unpickle_ms(results[0]["reports"])
    res["sim_wall_s"] = sum(r["wall_s"] for r in results)
    res["sim_cpu_s"] = sum(r["cpu_s"] for r in results)
    return res


def ingress(res: dict[str, Any]) -> dict[str, Any]:
    """Ingress replicas the row needs, per Serve mode and report format (ingress.py)."""
    router = res["router"]
    per_request = (router["decision_cpu_us"]["mean"] + router["read_cpu_us"]["mean"]) / 1e6
    reindex = router["reindex_ms"]["cpu_mean"] / 1e3 if router["reindex_ms"]["cpu_mean"] else 0
    out: dict[str, Any] = {
        "inputs": {
            "output_tok_per_s": res["output_tok_per_s"],
            "req_per_s": res["req_per_s"],
            "router_cpu_s_per_request": per_request,
            "broadcasts_per_s": router["broadcasts_per_s"],
            "reindex_cpu_s": reindex,
            "unpickle_ms": res["report_unpickle"],
            "cpu_s_per_token": {"default": DEFAULT_MODE.cpu_s_per_token,
                                "throughput_optimized": THROUGHPUT_MODE.cpu_s_per_token},
        }
    }  # fmt: skip
    for mode, costs in (("default", DEFAULT_MODE), ("throughput_optimized", THROUGHPUT_MODE)):
        for fmt in ("list", "bytes"):
            broadcast = reindex + res["report_unpickle"][f"{fmt}_ms"] / 1e3
            try:
                k = replicas_needed(
                    res["output_tok_per_s"], res["req_per_s"], per_request,
                    router["broadcasts_per_s"], broadcast, costs,
                )  # fmt: skip
            except ValueError:
                k = None  # the broadcasts alone fill an ingress replica
            out[f"{mode}_{fmt}"] = k
    return out


# ------------------------------------------------------------------ the two parts
def validation(args: argparse.Namespace, corpus: Corpus) -> dict[str, Any]:
    measured = json.loads(MEASURED.read_text())
    rows = []
    for rate in args.validation_rates:  # each with the measured run's seed for it
        sim = simulate(4, rate, 300.0, 100 + RATES.index(rate), 32, 32, corpus=corpus)
        res = pooled([sim], (60.0, 300.0), args)
        m = measured["results"]["a"][f"{rate:g}"]
        row = {
            "rate": rate,
            "sim": slim(res),
            "measured": {
                "requests": m["requests"],
                "goodput_req_per_s": m["goodput_req_per_s"],
                "slo_attainment": m["slo_attainment"],
                "ttft_ms": m["ttft_ms"],
                "tpot_ms": m["tpot_ms"],
                "hit_rate": m["prefix_cache"]["overall"],
                "prompt_tokens": m["prompt_tokens"],
            },
        }
        row["goodput_ratio"] = res["goodput_req_per_s"] / m["goodput_req_per_s"]
        row["ttft_p50_ratio"] = res["ttft_ms"]["p50"] / m["ttft_ms"]["p50"]
        row["ttft_p50_gap_ms"] = res["ttft_ms"]["p50"] - m["ttft_ms"]["p50"]
        row["goodput_within_10pct"] = abs(row["goodput_ratio"] - 1) <= TOLERANCE
        row["ttft_p50_within_10pct"] = abs(row["ttft_p50_ratio"] - 1) <= TOLERANCE
        rows.append(row)
        print(
            f"validation {rate:g} req/s: goodput {res['goodput_req_per_s']:.2f} vs "
            f"{m['goodput_req_per_s']:.2f} ({row['goodput_ratio']:.2f}x), TTFT p50 "
            f"{res['ttft_ms']['p50']:.0f} vs {m['ttft_ms']['p50']:.0f} ms, hit rate "
            f"{res['hit_rate']:.2f} vs {m['prefix_cache']['overall']:.2f}",
            flush=True,
        )
    return {"measured_commit": measured["settings"]["commit"], "rows": rows}


def scale_row(
    n: int,
    args: argparse.Namespace,
    corpus: Corpus,
    control: str | None = None,
    routers: int | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """One row: ``n`` replicas behind ``routers`` ingress routers (default: ``--routers``),
    ``kw`` passed to :func:`simulate` (a control's changes)."""
    seeds = max(1, args.seed_replicas // n)
    routers = routers or args.router_counts.get(n, 1)
    runs = [
        simulate(n, GOAL_RATE * n / 4, args.duration, 200 + s, 8 * n, 8 * n, routers,
                 corpus=corpus, **kw)
        for s in range(seeds)
    ]  # fmt: skip
    res = pooled(runs, (args.warmup, args.duration), args)
    res["ingress"] = ingress(res)
    row = {
        "replicas": n,
        "router_decision_us_p50": res["router"]["decision_us"]["p50"],
        "router_decision_us_p99": res["router"]["decision_us"]["p99"],
        "router_decision_cpu_us_p50": res["router"]["decision_cpu_us"]["p50"],
        "router_decision_cpu_us_p99": res["router"]["decision_cpu_us"]["p99"],
        "goodput_per_device": res["goodput_per_device"],
        "hit_rate": res["hit_rate"],
        "ttft_ms_p50": res["ttft_ms"]["p50"],
        "ttft_ms_p99": res["ttft_ms"]["p99"],
        "tpot_ms_p50": res["tpot_ms"]["p50"],
        "tpot_ms_p99": res["tpot_ms"]["p99"],
        "kv_index_bytes": res["router_state_bytes"]["kv_index"],
        "router_state_bytes": sum(res["router_state_bytes"].values()),
        "ingress_replicas": res["ingress"]["default_bytes"],  # the format replicas send
        "ingress_replicas_throughput_optimized": res["ingress"]["throughput_optimized_bytes"],
        "simulated_ingress_routers": res["router"]["routers"],
        "rate_req_per_s": GOAL_RATE * n / 4,
        "tenants": 8 * n,
        "documents": 8 * n,
        "control": control,
        **kw,
        "detail": res,
    }
    print(
        f"{n:5d} replicas{f' ({control})' if control else ''}: goodput/device "
        f"{row['goodput_per_device']:.3f}, hit rate "
        f"{row['hit_rate']:.2f}, TTFT p50/p99 {row['ttft_ms_p50']:.0f}/"
        f"{row['ttft_ms_p99']:.0f} ms, "
        f"decision p50/p99 {row['router_decision_us_p50']:.0f}/"
        f"{row['router_decision_us_p99']:.0f} us (CPU {row['router_decision_cpu_us_p50']:.0f}/"
        f"{row['router_decision_cpu_us_p99']:.0f}), index {row['kv_index_bytes'] / 2**20:.1f} MiB, "
        f"ingress {row['ingress_replicas']} ({row['ingress_replicas_throughput_optimized']}), "
        f"{res['sim_wall_s']:.0f} s wall, load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    return row


def slim(res: dict[str, Any]) -> dict[str, Any]:
    keep = ("requests", "completed", "goodput_req_per_s", "goodput_per_device",
            "slo_attainment", "ttft_ms", "tpot_ms", "hit_rate", "prompt_tokens",
            "output_tok_per_s", "session_stickiness", "router")  # fmt: skip
    return {k: res[k] for k in keep if k in res}


def goals(rows: list[dict[str, Any]], validation: dict[str, Any]) -> dict[str, Any]:
    by_n = {r["replicas"]: r for r in rows}
    base, top = by_n.get(4), by_n.get(max(by_n))
    out: dict[str, Any] = {}
    if base and top:
        ratio = top["goodput_per_device"] / base["goodput_per_device"]
        out["largest"] = {
            "replicas": top["replicas"],
            "decision_us_p99": top["router_decision_us_p99"],
            "decision_cpu_us_p99": top["router_decision_cpu_us_p99"],
            "decision_p99_met_wall": top["router_decision_us_p99"] <= GOAL_DECISION_US,
            "decision_p99_met_cpu": top["router_decision_cpu_us_p99"] <= GOAL_DECISION_US,
            "goodput_per_device_ratio_to_4": ratio,
            "goodput_met": ratio >= GOAL_GOODPUT_RATIO,
            "kv_index_bytes": top["kv_index_bytes"],
        }
    v = [r for r in validation["rows"] if r["rate"] == GOAL_RATE]
    if v:
        out["validation_at_goal_rate"] = {
            k: v[0][k]
            for k in ("goodput_ratio", "ttft_p50_ratio", "ttft_p50_gap_ms",
                      "goodput_within_10pct", "ttft_p50_within_10pct")
        }  # fmt: skip
    return out


# ------------------------------------------------------------------ plot
def plot(rows: list[dict[str, Any]], validation: dict[str, Any], quick: bool) -> Any:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.4))
    main = sorted((r for r in rows if r.get("control") is None), key=lambda r: r["replicas"])
    xs = [r["replicas"] for r in main]
    ax = axes[0]
    ax.plot(xs, [r["goodput_per_device"] for r in main], marker="o", label="simulated")
    if main:
        ax.axhline(GOAL_GOODPUT_RATIO * main[0]["goodput_per_device"], ls=":", color="gray",
                   label="0.9 x the 4-replica figure")  # fmt: skip
    measured = [r for r in validation["rows"] if r["rate"] == GOAL_RATE]
    if measured:
        ax.scatter([4], [measured[0]["measured"]["goodput_req_per_s"] / 4], marker="x",
                   color="red", zorder=3, label="measured (BENCHMARKS 15)")  # fmt: skip
    ax.set_title("goodput per device (req/s meeting the SLO)")
    ax.legend(fontsize=7)
    ax = axes[1]
    for key, label, style in (
        ("router_decision_us_p50", "wall p50", "o-"),
        ("router_decision_us_p99", "wall p99", "o--"),
        ("router_decision_cpu_us_p50", "CPU p50", "s-"),
        ("router_decision_cpu_us_p99", "CPU p99", "s--"),
    ):
        ax.plot(xs, [r[key] for r in main], style, label=label)
    ax.axhline(GOAL_DECISION_US, ls=":", color="gray", label="1 ms")
    ax.set_yscale("log")
    ax.set_title("router decision (us, this host)")
    ax.legend(fontsize=7)
    ax = axes[2]
    ax.plot(xs, [r["ttft_ms_p50"] for r in main], marker="o", label="TTFT p50")
    ax.plot(xs, [r["ttft_ms_p99"] for r in main], marker="o", label="TTFT p99")
    ax.plot(xs, [r["tpot_ms_p99"] for r in main], marker="s", label="TPOT p99")
    ax2 = ax.twinx()
    ax2.plot(xs, [100 * r["hit_rate"] for r in main], "g^-", label="hit rate (%)")
    ax2.set_ylim(0, 100)
    ax.set_yscale("log")
    ax.set_title("latency (ms) and prefix-cache hit rate (%)")
    ax.legend(fontsize=7, loc="upper left")
    ax2.legend(fontsize=7, loc="lower right")
    ax = axes[3]
    ax.plot(xs, [r["kv_index_bytes"] / 2**20 for r in main], marker="o", label="KV index (MiB)")
    ax.plot(xs, [r["router_state_bytes"] / 2**20 for r in main], marker="o",
            label="router state (MiB)")  # fmt: skip
    ax.plot(xs, [r["ingress_replicas"] or 0 for r in main], "s--", label="ingress replicas")
    ax.plot(xs, [r["ingress_replicas_throughput_optimized"] or 0 for r in main], "s:",
            label="ingress replicas (throughput mode)")  # fmt: skip
    ax.set_yscale("log")
    ax.set_title("router memory, ingress replicas")
    ax.legend(fontsize=7)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas (ATOMs)")
    fig.suptitle("fleet simulation: real cache-aware router, simulated Llama-3-8B ATOM replicas"
                 + (" (quick)" if quick else ""))  # fmt: skip
    fig.tight_layout()
    path = common.plot_path("fleet_sim", quick)
    fig.savefig(path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke: 4 and 16 replicas, 60 s")
    p.add_argument("--counts", default=",".join(map(str, COUNTS)))
    p.add_argument("--duration", type=float, default=180.0, help="seconds of arrivals")
    p.add_argument("--warmup", type=float, default=60.0, help="first seconds not measured")
    p.add_argument("--seed-replicas", type=int, default=64,
                   help="small fleets run this many replicas' worth of seeds")  # fmt: skip
    p.add_argument(
        "--routers", default="256:2,1024:6",
        help="ingress routers simulated per replica count (n:k; others 1)",
    )  # fmt: skip
    p.add_argument(
        "--controls",
        default="exact64,routers256,noload256,routers32",
        help="comma list: exact64 (full scan at 64), routers256 (8 routers at 256), "
        "noload256 (the same without load reports), routers32 (32 routers at 256)",
    )
    p.add_argument("--ttft-slo-s", type=float, default=2.0)
    p.add_argument("--tpot-slo-ms", type=float, default=150.0)
    if "--quick" in (argv if argv is not None else sys.argv[1:]):
        p.set_defaults(counts="4,16", duration=60.0, warmup=20.0, seed_replicas=16,
                       controls="")  # fmt: skip
    args = p.parse_args(argv)
    pairs = (x.split(":") for x in args.routers.split(",") if x)
    args.router_counts = {int(a): int(b) for a, b in pairs}
    args.validation_rates = RATES if not args.quick else (GOAL_RATE,)
    commit = common.commit()
    t0 = time.time()
    load_before = os.getloadavg()
    corpus = Corpus()
    valid = validation(args, corpus)
    rows = [scale_row(int(n), args, corpus) for n in args.counts.split(",") if n]
    controls = [c for c in args.controls.split(",") if c]
    if "exact64" in controls:
        rows.append(scale_row(64, args, corpus, "full scan", exact_scan_max=10**6))
    if "routers256" in controls:
        rows.append(scale_row(256, args, corpus, "8 ingress routers", 8))
    if "noload256" in controls:
        rows.append(scale_row(256, args, corpus, "8 ingress routers, no load reports", 8,
                              report_load=False))  # fmt: skip
    if "routers32" in controls:
        rows.append(scale_row(256, args, corpus, "32 ingress routers", 32))
    g = goals([r for r in rows if r.get("control") is None], valid)
    path = common.save(
        "fleet_sim",
        {
            "commit": commit,
            "settings": {k: v for k, v in vars(args).items()},
            "wall_s": time.time() - t0,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "validation": valid,
            "rows": rows,
            "goals": g,
            "note": "simulated replicas (cost model), real router code timed on this host",
        },
        args.quick,
    )
    print(f"plot: {plot(rows, valid, args.quick)}")
    print(f"goals: {json.dumps(g, indent=1)}")
    return 0 if path else 1


if __name__ == "__main__":
    raise SystemExit(main())
