"""The ingress at high concurrency: 256 concurrent streams through the Serve app vs in-process.

One emulated ATOM in timing mode (``--shape``, default llama-3-8b), the demo model compiled
for ``--batch`` (default 256) decode rows, so every stream decodes at once and the device
step is the same on both sides:

1. the rbln-ray Serve app (1 replica) over HTTP: the load generator (benchmarks/loadgen.py)
   keeps ``--concurrency`` streaming ``/v1/completions`` requests open;
2. the same engine in-process: vLLM's ``AsyncLLM`` with ``RBLNRayExecutor`` (the replica's
   executor) and the same ``--concurrency`` requests in flight.

Goal (issue 35): Serve's output tok/s >= 0.98 x in-process. Where the time goes: CPU seconds
per process of the Serve run (proxy, ingress, replica, engine core, worker, Ray's daemons,
the load generator), from psutil, and on both sides the engine's step counters (prefill and
decode calls, decode rows, device seconds) over the measured phase: the same tokens in more
device calls, or a device idle between calls, tell the two kinds of ingress cost apart.

    python -m benchmarks.ingress_streams [--quick] [--throughput-optimized]

``--throughput-optimized`` runs the Serve side in Ray Serve's high-throughput mode (HAProxy
in front of ingress replicas that serve HTTP themselves, gRPC between deployments); its
results are saved beside the default's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import time
from typing import Any

from benchmarks import common
from benchmarks.loadgen import run_load, wait_ready

GOAL = 0.98
ROLES = (  # process -> role, first match wins (Ray sets process titles)
    ("proxy", r"ProxyActor"),
    ("haproxy", r"haproxy"),
    ("ingress", r"OpenAIIngress"),
    ("replica (LLMServer)", r"LLMServer"),
    ("engine core", r"EngineCore"),
    ("worker actor", r"RBLNWorkerActor"),
    ("serve controller", r"ServeController"),
    ("ray daemons", r"raylet|gcs_server|dashboard|agent|log_monitor|monitor\.py"),
)


def cpu_by_role() -> dict[str, float]:
    """CPU seconds so far of this process (the load generator) and its descendants (the
    local Ray instance and everything it started), by role."""
    import psutil

    me = psutil.Process()
    out: dict[str, float] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            title = proc.name() + " " + " ".join(proc.cmdline())
            times = proc.cpu_times()
        except psutil.Error:
            continue
        role = "load generator" if proc.pid == me.pid else "other"
        for name, pattern in ROLES:
            if proc.pid != me.pid and re.search(pattern, title):
                role = name
                break
        out[role] = out.get(role, 0.0) + times.user + times.system
    return out


STEP_COUNTERS = ("prefill_steps", "decode_steps", "decode_rows", "padded_rows", "device_seconds")


def step_delta(before: dict[str, Any], after: dict[str, Any], wall: float) -> dict[str, Any]:
    """The engine's step counters over the measured phase, and the device's busy share."""
    out = {k: after[k] - before[k] for k in STEP_COUNTERS}
    out["device_busy_share"] = out["device_seconds"] / wall
    return out


def serve_run(compiled, prompts, args) -> dict[str, Any]:
    import ray
    from ray import serve

    common.emulator_env("timing", args.shape)
    common.start_local_ray(num_cpus=8, rbln_devices=1)
    # One event loop for the whole run: in Ray Serve's high-throughput mode a handle's router
    # runs on the caller's loop (RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0), so it must outlive
    # each call.
    loop = asyncio.new_event_loop()
    try:
        port = common.free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = common.deploy_serve_app(compiled, 1, port)
        loop.run_until_complete(wait_ready(url, 900))
        from rbln_ray.serve import APP_NAME
        from rbln_ray.serve.naming import server_deployment_name

        replica = serve.get_deployment_handle(server_deployment_name("demo"), APP_NAME)

        def steps() -> dict[str, Any]:  # the one replica's engine
            async def stats() -> dict[str, Any]:
                return await replica.engine_stats.remote()

            return loop.run_until_complete(stats())["steps"][0]

        # Warm-up apart, so the counters below cover exactly the measured phase.
        loop.run_until_complete(
            run_load(url, "demo", prompts[:4], args.output_len, 4, progress=False)
        )
        steps_before, before, t0 = steps(), cpu_by_role(), time.perf_counter()
        res = loop.run_until_complete(
            run_load(url, "demo", prompts, args.output_len, args.concurrency, warmup=0)
        )
        wall = time.perf_counter() - t0
        after, steps_after = cpu_by_role(), steps()
        res["cpu_s_by_role"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        res["cpu_share_by_role"] = {k: v / wall for k, v in res["cpu_s_by_role"].items()}
        res["steps"] = step_delta(steps_before, steps_after, wall)
        return res
    finally:
        serve.shutdown()
        ray.shutdown()
        loop.close()


def inprocess_run(compiled, args) -> dict[str, Any]:
    """The same load on the same engine in a process of its own (benchmarks/engine_run.py)."""
    spec = {
        "backend": "rbln",
        "executor": "ray",
        "model": str(compiled),
        "api": "async",
        "concurrency": args.concurrency,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_num_seqs": args.batch,
        "max_model_len": args.max_seq_len,
        "emulator_mode": "timing",
        "timing_shape": args.shape,
        "warmup": 4,
    }
    res = common.run_json("engine_run.py", spec, common.base_env(), timeout=7200)
    res["steps"] = step_delta(res.pop("step_stats_before"), res.pop("step_stats"), res["elapsed_s"])
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--batch", type=int, default=256, help="compiled decode rows")
    p.add_argument("--num-prompts", type=int, default=768)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--shape", default="llama-3-8b")
    p.add_argument(
        "--throughput-optimized",
        action="store_true",
        help="run the Serve app in Ray Serve's high-throughput mode: "
        + ", ".join(f"{k}={v}" for k, v in common.THROUGHPUT_OPTIMIZED_ENV.items()),
    )
    args = p.parse_args(argv)
    if args.throughput_optimized:
        common.use_throughput_optimized_serve()
    stem = "ingress_streams" + ("_throughput_optimized" if args.throughput_optimized else "")
    if args.quick:
        args.concurrency, args.batch, args.num_prompts, args.output_len = 32, 32, 64, 32
    hf, compiled = common.compiled_demo(args.batch, args.max_seq_len)
    prompts = common.prompts(args.num_prompts, args.input_len, common.vocab_of(hf))
    t0 = time.time()
    print(f"== Serve app over HTTP, {args.concurrency} streams", flush=True)
    serve = serve_run(compiled, prompts, args)
    print(f"   {serve['output_tok_per_s']:.1f} tok/s, failed {serve['failed']}", flush=True)
    print(f"== in-process AsyncLLM (RBLNRayExecutor), {args.concurrency} in flight", flush=True)
    inproc = inprocess_run(compiled, args)
    print(f"   {inproc['output_tok_per_s']:.1f} tok/s", flush=True)
    ratio = serve["output_tok_per_s"] / inproc["output_tok_per_s"]
    goal = {"ratio": ratio, "goal": GOAL, "met": ratio >= GOAL}
    common.save(
        stem,
        {
            "settings": vars(args) | {"compiled": str(compiled)},
            "wall_s": time.time() - t0,
            "results": {"serve (http)": serve, "in-process, ray executor": inproc},
            "goals": {f"serve_over_in_process_{args.concurrency}_streams": goal},
            "note": "emulator timing mode: outputs are garbage; device latency is modelled",
        },
        args.quick,
    )
    plt = common.pyplot()
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["serve (http)", "in-process"]
    ax0.bar(names, [serve["output_tok_per_s"], inproc["output_tok_per_s"]])
    ax0.set_title(f"output tok/s, {args.concurrency} streams (ratio {ratio:.3f})")
    shares = sorted(serve["cpu_share_by_role"].items(), key=lambda kv: -kv[1])
    ax1.barh([k for k, _ in shares], [v for _, v in shares])
    ax1.set_title("Serve run: CPU cores busy, by process role")
    fig.tight_layout()
    fig.savefig(common.plot_path(stem, args.quick))
    print(f"goal serve/in-process >= {GOAL}: {'MET' if goal['met'] else 'NOT MET'} {goal}")
    for role, share in shares:
        print(f"   {role:>22}: {share:.2f} cores")
    for name, res in (("serve", serve), ("in-process", inproc)):
        print(f"   {name} steps: {res['steps']}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    raise SystemExit(main())
