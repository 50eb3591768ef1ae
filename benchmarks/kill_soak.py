"""Soak with faults: one replica killed every minute under steady load; no request may fail.

The rbln-ray Serve app (demo model, batch 4, ``--replicas`` replicas, emulated ATOM in
compute mode, local Ray with 4 devices) under ``--concurrency`` closed-loop clients of
non-streaming completions (``max_tokens`` jittered 16-64, seeded). Every ``--kill-every``
seconds one running replica's actor is killed with ``ray.kill`` (as a crash would end it);
Serve starts a replacement, and the ingress retries the killed replica's requests on another
one (``rbln_request_retries_total``). Reported: requests, failures (anything but a 200 with
all tokens), retries, latency p50/p99/max, and per kill the seconds until all replicas run
again. A kill waits while fewer than two replicas run, so the last one is never the victim
(``late_s`` says by how much it waited); with 3 replicas a replacement may take up to two
periods without delaying a kill. Not in CI (10 minutes by default); run it alone on an
otherwise idle machine:

    python -m benchmarks.kill_soak [--seconds 600] [--replicas 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time
from typing import Any

from benchmarks import common

APP = "rbln-ray"
DEPLOYMENT = "LLMServer:demo"


def running_replicas() -> int:
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None or DEPLOYMENT not in app.deployments:
        return 0
    return app.deployments[DEPLOYMENT].replica_states.get("RUNNING", 0)


def replica_actor_names() -> list[str]:
    import ray

    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and f"#{DEPLOYMENT}#" in a["name"]
    )


def live_replicas(victims: set[str]) -> int:
    """Replicas running now that were never killed (Serve's replacements have new names)."""
    return min(running_replicas(), len(set(replica_actor_names()) - victims))


def retries_total() -> float:
    """``rbln_request_retries`` over every node's Ray metrics export (lags up to 10 s)."""
    import httpx
    import ray
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for node in ray.nodes():
        if node.get("Alive") and node.get("MetricsExportPort"):
            url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            for fam in text_string_to_metric_families(httpx.get(url, timeout=30).text):
                total += sum(
                    s.value for s in fam.samples if s.name == "ray_rbln_request_retries_total"
                )
    return total


async def clients(url: str, concurrency: int, stop: threading.Event, out: list[dict]) -> None:
    import httpx

    rng = random.Random(0)
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(w: int) -> None:
            while not stop.is_set():
                n = rng.randint(16, 64)
                body = {"model": "demo", "prompt": f"def f{w}(", "max_tokens": n}
                body["ignore_eos"] = True
                started = time.monotonic()
                try:
                    r = await client.post(f"{url}/v1/completions", json=body)
                    ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == n
                    error = None if ok else f"{r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as exc:
                    error = f"transport: {exc!r}"
                out.append({"start": started, "end": time.monotonic(), "error": error})

        await asyncio.gather(*(one(w) for w in range(concurrency)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 minutes, a kill every 40 s")
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--kill-every", type=float, default=60)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument(
        "--replicas", type=int, default=3, help="of 4 emulated devices; a kill needs 2 running"
    )
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.kill_every = 120, 40
    _, compiled = common.compiled_demo(args.batch)

    import ray
    from ray import serve
    from tqdm import tqdm

    common.emulator_env("compute")
    common.start_local_ray(num_cpus=8, rbln_devices=4)
    results: list[dict] = []
    kills: list[dict[str, Any]] = []
    stop = threading.Event()
    try:
        port = common.free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = common.deploy_serve_app(compiled, args.replicas, port)
        load = threading.Thread(
            target=lambda: asyncio.run(clients(url, args.concurrency, stop, results)),
            daemon=True,
        )
        retries_before = retries_total()
        t0 = time.monotonic()
        load.start()
        next_kill = t0 + args.kill_every
        with tqdm(total=int(args.seconds), desc="kill soak", unit="s") as bar:
            while (now := time.monotonic()) < t0 + args.seconds:
                bar.n = int(now - t0)
                bar.set_postfix(requests=len(results), kills=len(kills))
                bar.refresh()
                victims = {k["victim"] for k in kills}
                live = live_replicas(victims)
                for k in kills:
                    if k["recovered_s"] is None and live == args.replicas:
                        k["recovered_s"] = time.monotonic() - t0 - k["at_s"]
                # One kill per period, of a running replica, never the last one running.
                if now >= next_kill and live >= 2:
                    names = sorted(set(replica_actor_names()) - victims)
                    victim = random.Random(len(kills)).choice(names)
                    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
                    late = now - next_kill
                    kills.append(
                        {"at_s": now - t0, "late_s": late, "victim": victim, "recovered_s": None}
                    )
                    next_kill += args.kill_every
                time.sleep(0.5)  # the pacing of this control loop (kills, progress)
        stop.set()
        load.join(timeout=900)
        elapsed = time.monotonic() - t0
        retries = retries_total() - retries_before
    finally:
        stop.set()
        serve.shutdown()
        ray.shutdown()

    failed = [r for r in results if r["error"]]
    latency = [r["end"] - r["start"] for r in results]
    data = {
        "config": vars(args),
        "seconds": elapsed,
        "requests": len(results),
        "failed": len(failed),
        "failures": [r["error"] for r in failed[:20]],
        "retried": retries,
        "kills": kills,
        "latency_s": common.summary(latency),
        "latency_max_s": max(latency, default=None),
        "req_per_s": len(results) / elapsed if elapsed else None,
    }
    common.save("kill_soak", data, args.quick)
    plot(results, kills, t0, args.quick)
    print(
        f"kill soak: {len(results)} requests in {elapsed:.0f} s, {len(failed)} failed, "
        f"{len(kills)} kills, {retries:.0f} retried; recovery "
        f"{[round(k['recovered_s'] or -1, 1) for k in kills]} s"
    )
    return 0 if not failed else 1


def plot(results: list[dict], kills: list[dict], t0: float, quick: bool) -> None:
    plt = common.pyplot()
    bucket = 5.0
    ends = [r["end"] - t0 for r in results]
    n = int(max(ends, default=0) // bucket) + 1
    counts = [0] * n
    for e in ends:
        counts[int(e // bucket)] += 1
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.bar([i * bucket for i in range(n)], [c / bucket for c in counts], width=bucket, align="edge")
    for k in kills:
        ax.axvline(k["at_s"], color="red", linestyle="--", linewidth=1)
    ax.set_xlabel("seconds (red: replica killed)")
    ax.set_ylabel("completed req/s")
    ax.set_title(
        f"kill soak: {len(results)} requests, {sum(bool(r['error']) for r in results)} failed"
    )
    fig.tight_layout()
    fig.savefig(common.plot_path("kill_soak", quick))


if __name__ == "__main__":
    raise SystemExit(main())
