"""Replica scaling on a multi-node Ray cluster, emulator timing mode.

A ``ray.cluster_utils.Cluster`` of ``--nodes`` raylets x ``--devices-per-node`` emulated ATOMs
on this machine; the rbln-ray Serve app with N = 1, 2, 4, 8 replicas (one device each) of the
demo graph, whose device latency is modelled as ``--shape`` (default llama-3-8b) and spent
sleeping, so 8 devices fit on 2 cores. Load: a closed loop of ``--per-replica-concurrency``
x N streaming requests. Scaling efficiency = throughput(N) / (N x throughput(1)); goal >= 0.9.
Outputs in timing mode are garbage (zeros); only the timing is meaningful. ``--executor uni``
runs each replica's worker in its engine process (``distributed_executor_backend: uni``): two
processes a replica instead of three, which is what lets 16 replicas fit in this host's memory.
Each point records the host's busy CPU and its peak memory in use, the limits that bend the
curve on this machine.

    python -m benchmarks.scaling [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from benchmarks import common
from benchmarks.loadgen import run_load, wait_ready

GOAL_EFFICIENCY = 0.9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--replicas", default="1,2,4,8")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--devices-per-node", type=int, default=4)
    p.add_argument("--cpus-per-node", type=int, default=10, help="logical CPUs Ray advertises")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--shape", default="llama-3-8b", help="timing-mode device model")
    p.add_argument("--per-replica-concurrency", type=int, default=8)
    p.add_argument("--requests-per-replica", type=int, default=24)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--executor", choices=("ray", "uni"), default="ray",
                   help="the replicas' distributed_executor_backend")  # fmt: skip
    args = p.parse_args(argv)
    if args.quick:
        args.replicas, args.requests_per_replica, args.output_len = "1,2", 8, 16
        args.input_len = 32
    replicas = [int(n) for n in args.replicas.split(",")]
    if max(replicas) > args.nodes * args.devices_per_node:
        raise SystemExit("more replicas than emulated devices in the cluster")
    hf_dir, compiled = common.compiled_demo(args.batch)
    vocab = common.vocab_of(hf_dir)

    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    common.emulator_env("timing", args.shape)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": args.cpus_per_node,
            "resources": {"RBLN": args.devices_per_node},
            "include_dashboard": False,
        },
    )
    for _ in range(args.nodes - 1):
        cluster.add_node(num_cpus=args.cpus_per_node, resources={"RBLN": args.devices_per_node})
    cluster.wait_for_nodes()
    results: dict[str, dict] = {}
    t0 = time.time()
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        port = common.free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        for n in replicas:
            print(f"== {n} replica(s)", flush=True)
            url = common.deploy_serve_app(
                compiled,
                n,
                port,
                placement_strategy="PACK",
                engine_kwargs={"distributed_executor_backend": args.executor},
            )
            asyncio.run(wait_ready(url, 900))
            prompts = common.prompts(args.requests_per_replica * n, args.input_len, vocab, seed=n)
            streams = args.per_replica_concurrency * n
            with HostSampler() as host:
                res = asyncio.run(run_load(url, "demo", prompts, args.output_len, streams))
            res["host"] = host.summary()
            nodes = _replica_nodes()
            res["replica_nodes"] = nodes
            results[str(n)] = res
            print(
                f"   {res['output_tok_per_s']:.1f} tok/s {res['req_per_s']:.2f} req/s "
                f"TPOT p50 {res['tpot_ms']['p50']:.1f} ms failed {res['failed']} nodes {nodes} "
                f"host {res['host']}",
                flush=True,
            )
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    base = results[str(replicas[0])]["output_tok_per_s"] / replicas[0]
    efficiency = {n: r["output_tok_per_s"] / (int(n) * base) for n, r in results.items()}
    goals = {
        "scaling_ge_0.9N": {
            "efficiency": efficiency,
            "met": min(efficiency.values()) >= GOAL_EFFICIENCY,
        }
    }
    common.save(
        "scaling",
        {
            "settings": vars(args) | {"compiled": str(compiled)},
            "wall_s": time.time() - t0,
            "results": results,
            "goals": goals,
            "note": "emulator timing mode: outputs are garbage; device latency is modelled",
        },
        args.quick,
    )
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [int(n) for n in results]
    ax.plot(xs, [results[str(n)]["output_tok_per_s"] for n in xs], marker="o", label="measured")
    ax.plot(xs, [base * n for n in xs], linestyle="--", label="linear")
    ax.plot(xs, [0.9 * base * n for n in xs], linestyle=":", label="0.9 x linear (goal)")
    ax.set_xlabel("replicas (1 emulated ATOM each)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Serve replica scaling, timing mode ({args.shape})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(common.plot_path("scaling", args.quick))
    g = goals["scaling_ge_0.9N"]
    print(f"goal scaling >= 0.9 x N: {'MET' if g['met'] else 'NOT MET'} {g}")
    return 0


class HostSampler:
    """The host's busy cores (mean over the load) and peak memory in use, sampled each
    second while the load runs: the two limits of a whole cluster on one machine."""

    def __enter__(self) -> HostSampler:
        import threading

        import psutil

        self._stop = threading.Event()
        self._mem: list[int] = []
        self._cpu0 = psutil.cpu_times()

        def sample() -> None:
            while not self._stop.wait(1.0):
                self._mem.append(psutil.virtual_memory().used)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        import psutil

        self._stop.set()
        self._thread.join()
        cpu1 = psutil.cpu_times()
        idle = (cpu1.idle + cpu1.iowait) - (self._cpu0.idle + self._cpu0.iowait)
        total = sum(cpu1) - sum(self._cpu0)
        self._busy_cores = psutil.cpu_count() * (1 - idle / total) if total else 0.0

    def summary(self) -> dict[str, float]:
        return {
            "busy_cores_mean": round(self._busy_cores, 2),
            "memory_used_gb_max": round(max(self._mem, default=0) / 2**30, 2),
        }


def _replica_nodes() -> dict[str, float]:
    """RBLN devices in use on each node (spread check; one device per replica)."""
    import ray

    try:
        available = ray._private.state.state.available_resources_per_node()
    except Exception:  # noqa: BLE001 - a private API: report nothing rather than fail
        return {}
    used = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        total = node["Resources"].get("RBLN", 0)
        free = available.get(node["NodeID"], {}).get("RBLN", 0)
        used[node["NodeID"][:8]] = total - free
    return used


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    raise SystemExit(main())
