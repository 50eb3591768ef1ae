"""Serve's per-request overhead: where a request's milliseconds go before its first token.

The same streaming completions (token-id prompts, ``ignore_eos``, fixed ``max_tokens``), at
each concurrency, in emulator timing mode with a real model's ATOM device time (default
llama-3-8b), along three paths that differ by one layer each:

1. ``in_process``: vLLM ``AsyncLLM`` on the RBLN platform with the Ray executor (the engine
   as a Serve replica runs it), in a fresh process (``engine_run.py``);
2. ``serve_handle``: the Serve app's model deployment called through its Ray Serve handle
   (what ``rbln_ray.client.RBLNClient`` does): adds the Serve replica hop, the replica's
   vLLM HTTP app and the streamed chunks' way back;
3. ``serve``: the same app over HTTP through Serve's proxy and the app's ingress (with
   ``--routing direct``, Serve's proxy straight to the model replica, which is the ingress).

TTFT p50 differences give the split: ``serve_handle - in_process`` is the replica (Serve's
handle call, vLLM's HTTP layer in the replica, the chunk stream back), ``serve -
serve_handle`` is the proxy and ingress (HTTP parsing, auth, validation, routing, a second
handle hop). Controls on the same Ray instance, requests that reach no model: Serve's proxy
alone (``/-/healthz``), a bare FastAPI ingress behind it (Serve's own proxy-to-replica hop),
and the rbln-ray ingress answering ``/version`` itself. The goal (issue 49): Serve adds at
most 5 ms of TTFT p50 at concurrency 1.

    python -m benchmarks.serve_overhead [--quick] [--concurrency 1,4,8] [--shape llama-3-8b]
        [--throughput-optimized] [--routing direct]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from benchmarks import common
from benchmarks.loadgen import (
    StreamRecord,
    closed_loop,
    completion_body,
    run_load,
    wait_ready,
)
from benchmarks.online_serving import inprocess_runs

GOAL_ADDED_TTFT_MS = 5.0  # Serve over HTTP vs the in-process engine, TTFT p50, concurrency 1
PATHS = ("in_process", "serve_handle", "serve")


async def _handle_one(handle: Any, call: Any) -> dict[str, Any]:
    """One streamed request through the model deployment's handle: the loadgen record."""
    record = StreamRecord()
    pending = b""
    try:
        items = handle.options(stream=True).http.remote(call)
        first = True
        async for item in items:
            if first and item.status != 200:
                return record.failed(str(item.status))
            pending += item.body if first else item
            first = False
            *events, pending = pending.split(b"\n\n")
            for event in events:
                record.line(event.strip())
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point
        return record.failed(repr(exc)[:200])
    return record.done()


async def handle_load(
    prompts: list[list[int]], output_len: int, concurrency: int
) -> dict[str, Any]:
    """``run_load``'s closed loop, through the Serve handle instead of HTTP."""
    from ray import serve

    from rbln_ray.client import RBLNClient
    from rbln_ray.serve import APP_NAME, server_deployment_name

    client = RBLNClient("demo")  # builds the HTTPCall as the Python client sends it
    handle = serve.get_deployment_handle(server_deployment_name("demo"), APP_NAME)

    async def one(prompt: list[int]) -> dict[str, Any]:
        body = completion_body("demo", prompt, output_len)
        return await _handle_one(handle, client.call("POST", "/v1/completions", body))

    return await closed_loop(one, prompts, concurrency, desc=f"handle c={concurrency}")


def bare_ingress():
    """A FastAPI ingress that answers one route itself: Serve's own proxy-to-replica cost."""
    from fastapi import FastAPI
    from ray import serve

    app = FastAPI()

    @serve.deployment(name="BareIngress")
    @serve.ingress(app)
    class BareIngress:
        @app.get("/version")
        def version(self) -> dict[str, str]:
            return {"version": "bare"}

    return BareIngress.bind()


async def get_latency(url: str, requests: int = 200, warmup: int = 20) -> dict[str, Any]:
    """Sequential GETs of ``url`` on one connection: the latency summary (ms)."""
    import httpx

    from benchmarks.common import summary

    took = []
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        for i in range(warmup + requests):
            sent = time.perf_counter()
            response = await client.get(url)
            response.raise_for_status()
            if i >= warmup:
                took.append(time.perf_counter() - sent)
    return summary(took, 1e3)


def controls(port: int, loop: asyncio.AbstractEventLoop) -> dict[str, dict]:
    """Requests that never reach a model: Serve's proxy alone (``/-/healthz``), a bare
    FastAPI ingress behind it, and the rbln-ray ingress answering ``/version`` itself."""
    from ray import serve

    serve.run(bare_ingress(), name="bare", route_prefix="/bare")
    base = f"http://127.0.0.1:{port}"
    out = {
        "proxy_healthz": loop.run_until_complete(get_latency(f"{base}/-/healthz")),
        "bare_ingress_route": loop.run_until_complete(get_latency(f"{base}/bare/version")),
        "rbln_ingress_version": loop.run_until_complete(get_latency(f"{base}/version")),
    }
    serve.delete("bare")
    for name, latency in out.items():
        print(f"   {name:>22} p50 {latency['p50']:.1f} ms p99 {latency['p99']:.1f} ms", flush=True)
    return out


def serve_paths(compiled, prompts, concurrencies, args) -> dict[str, dict]:
    """Paths 2 and 3 on one Serve app (one replica), concurrency by concurrency, after the
    controls (:func:`controls`)."""
    import ray
    from ray import serve

    common.emulator_env("timing", args.shape)
    common.start_local_ray(num_cpus=8, rbln_devices=2)
    out: dict[str, dict] = {"serve_handle": {}, "serve": {}}
    # One event loop for the whole run: in Serve's high-throughput mode a handle's router
    # runs on the caller's loop, so the loop must outlive each call.
    loop = asyncio.new_event_loop()
    try:
        port = common.free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = common.deploy_serve_app(compiled, 1, port, {"routing": args.routing})
        loop.run_until_complete(wait_ready(url, 600))
        out["controls"] = controls(port, loop)
        for c in concurrencies:
            handle = loop.run_until_complete(handle_load(prompts, args.output_len, c))
            out["serve_handle"][str(c)] = handle
            _print("serve_handle", c, handle)
            http = loop.run_until_complete(run_load(url, "demo", prompts, args.output_len, c))
            out["serve"][str(c)] = http
            _print("serve", c, http)
    finally:
        serve.shutdown()
        ray.shutdown()
        loop.close()
    return out


def breakdown(results: dict[str, dict]) -> dict[str, dict[str, float]]:
    """TTFT p50 (ms) each layer adds, per concurrency."""

    def ttft(path: str, c: str) -> float:
        return results[path][c]["ttft_ms"]["p50"]

    return {
        c: {
            "replica_ms": ttft("serve_handle", c) - ttft("in_process", c),
            "proxy_and_ingress_ms": ttft("serve", c) - ttft("serve_handle", c),
            "serve_added_ms": ttft("serve", c) - ttft("in_process", c),
        }
        for c in results["serve"]
    }


def _print(name: str, c: int, r: dict) -> None:
    print(
        f"   {name:>12} c={c:<3} TTFT p50 {r['ttft_ms']['p50']:.1f} ms "
        f"p99 {r['ttft_ms']['p99']:.1f} ms TPOT p50 {r['tpot_ms']['p50']:.2f} ms "
        f"{r['output_tok_per_s']:.1f} tok/s failed {r['failed']}",
        flush=True,
    )


def plot(results: dict[str, dict], split: dict[str, dict], stem: str, quick: bool) -> None:
    plt = common.pyplot()
    concurrencies = list(results["serve"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(PATHS)
    for i, path in enumerate(PATHS):
        xs = [j + i * width for j in range(len(concurrencies))]
        left.bar(xs, [results[path][c]["ttft_ms"]["p50"] for c in concurrencies], width, label=path)
    left.set_xticks([j + width for j in range(len(concurrencies))], concurrencies)
    left.set_xlabel("concurrency")
    left.set_ylabel("TTFT p50 (ms)")
    left.legend()
    parts = ("replica_ms", "proxy_and_ingress_ms", "serve_added_ms")
    width = 0.8 / len(parts)
    for i, part in enumerate(parts):
        xs = [j + i * width for j in range(len(concurrencies))]
        right.bar(xs, [split[c][part] for c in concurrencies], width, label=part)
    right.set_xticks([j + width for j in range(len(concurrencies))], concurrencies)
    right.axhline(GOAL_ADDED_TTFT_MS, color="k", linestyle="--", label="goal at c=1")
    right.set_xlabel("concurrency")
    right.set_ylabel("TTFT p50 Serve adds (ms)")
    right.legend()
    fig.tight_layout()
    fig.savefig(common.plot_path(stem, quick))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--concurrency", default="1,4,8", help="comma list")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--shape", default="llama-3-8b", help="device time of this model on ATOM")
    p.add_argument(
        "--throughput-optimized",
        action="store_true",
        help="run the Serve app in Ray Serve's high-throughput mode (direct ingress behind "
        "HAProxy, gRPC between deployments): results go to serve_overhead_throughput_optimized",
    )
    p.add_argument(
        "--routing",
        default="load_aware",
        choices=("load_aware", "cache_aware", "direct"),
        help="the app's routing; direct (the model replica is the ingress) adds _direct to "
        "the result file's name",
    )
    args = p.parse_args(argv)
    if args.throughput_optimized:
        common.use_throughput_optimized_serve()
    stem = "serve_overhead" + ("_throughput_optimized" if args.throughput_optimized else "")
    stem += "_direct" if args.routing == "direct" else ""
    if args.quick:
        args.concurrency, args.num_prompts, args.output_len = "1,4", 8, 8
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    hf_dir, compiled = common.compiled_demo(args.batch, args.max_seq_len)
    prompts = common.prompts(args.num_prompts, args.input_len, common.vocab_of(hf_dir))
    engine_args = argparse.Namespace(**vars(args), emulator_mode="timing", timing_shape=args.shape)
    print(f"== in-process AsyncLLM, Ray executor ({args.shape}, timing mode)", flush=True)
    results = {"in_process": inprocess_runs("rbln", compiled, concurrencies, engine_args, "ray")}
    print("== the Serve app: handle, then HTTP", flush=True)
    results.update(serve_paths(compiled, prompts, concurrencies, args))
    split = breakdown(results)
    added = split[str(concurrencies[0])]["serve_added_ms"]
    goal = {
        "added_ttft_p50_ms_at_lowest_concurrency": added,
        "concurrency": concurrencies[0],
        "at_most_ms": GOAL_ADDED_TTFT_MS,
        "met": concurrencies[0] == 1 and added <= GOAL_ADDED_TTFT_MS,
    }
    print(f"Serve adds {added:.1f} ms TTFT p50 at c={concurrencies[0]}: {goal}", flush=True)
    common.save(
        stem,
        {"args": vars(args), "results": results, "breakdown_ms": split, "goal": goal},
        args.quick,
    )
    plot(results, split, stem, args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
