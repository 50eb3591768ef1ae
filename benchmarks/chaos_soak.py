"""Chaos soak: random faults of every kind under mixed streaming load; nothing may hang.

A multi-raylet Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head without RBLN
devices, where Serve's controller and proxy run, and ``--nodes`` raylets of
``--devices-per-node`` emulated ATOMs, timing mode: a device call sleeps the modelled time of
``--shape``), the rbln-ray Serve app with ``--replicas`` replicas of the tiny Llama, and
``--concurrency`` closed-loop clients, half of them streaming. Every ``--fault-every`` seconds
one fault, the kinds in turn:

* ``worker_kill``: SIGKILL a replica's RBLN worker actor;
* ``worker_stop``: SIGSTOP a worker (alive, no progress: the step deadline must end it);
* ``engine_kill``: SIGKILL a replica's vLLM engine-core process;
* ``replica_kill``: SIGKILL a replica's actor process;
* ``raylet_kill``: remove a worker raylet (every process on it dies); a fresh raylet with the
  same devices joins ``--node-back-after`` seconds later (one that dies by itself within a
  minute, as one did in an earlier run, is replaced again and listed in
  ``replacement_raylets_died``);
* ``proxy_kill``: SIGKILL Serve's HTTP proxy (clients on it lose their connections).

With ``--adversaries`` the soak injects no faults; instead, after ``--baseline-seconds`` of
ordinary load alone, adversarial clients join for ``--seconds`` (:mod:`benchmarks.adversaries`:
template bombs, stalled request bodies, over-limit fan-out on every route) against the
cache-aware app, and the ordinary requests' outcomes and latency are compared between the
two phases (goal: none fails, p99 within 2 x the baseline's).

Every request must end with exactly one terminal outcome, each counted: ``ok`` (a 200 with
every token, or a stream ending in ``[DONE]`` without an error event), ``error`` (an HTTP error
with a body, or a stream's error event), ``connection`` (the connection dropped: only a
killed proxy may cause it) and ``hung`` (no terminal outcome within ``--request-deadline``
seconds: must be 0). After each fault the seconds until every replica runs again and a probe
request succeeds ("capacity back") are recorded. JSON + PNG under benchmarks/results; the
figures go to RELIABILITY.md. Not in CI (20 minutes by default); run it alone:

    python -m benchmarks.chaos_soak [--seconds 1200] [--quick] [--adversaries]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.adversaries import KINDS, Adversaries

APP = "rbln-ray"
MODEL = "demo"  # the name common.deploy_serve_app gives the model
DEPLOYMENT = f"LLMServer:{MODEL}"
FAULTS = (
    "worker_kill",
    "worker_stop",
    "engine_kill",
    "replica_kill",
    "raylet_kill",
    "proxy_kill",
)
NEW_NODE_GRACE_S = 60.0  # a replacement raylet alive this long is taken as started


# ----------------------------------------------------------------------------- load
async def one_request(client: Any, url: str, stream: bool, n: int, deadline: float) -> dict:
    """One completion; its terminal outcome (never raises)."""
    import httpx

    body = {"model": MODEL, "prompt": "x = ", "max_tokens": n, "ignore_eos": True}
    body["stream"] = stream
    started = time.monotonic()
    outcome = "hung"
    detail = ""

    async def run() -> tuple[str, str]:
        if not stream:
            r = await client.post(f"{url}/v1/completions", json=body)
            if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == n:
                return "ok", ""
            return "error", f"{r.status_code}: {r.text[:120]}"
        done, error = False, ""
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return "error", f"{r.status_code}: {(await r.aread())[:120]!r}"
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith('data: {"error"'):
                    error = line[:120]
        if error:
            return "error", error
        return ("ok", "") if done else ("connection", "stream ended without [DONE]")

    try:
        outcome, detail = await asyncio.wait_for(run(), timeout=deadline)
    except TimeoutError:
        outcome, detail = "hung", f"no terminal outcome within {deadline:g} s"
    except httpx.HTTPError as exc:
        outcome, detail = "connection", repr(exc)[:120]
    return {
        "start": started,
        "end": time.monotonic(),
        "stream": stream,
        "outcome": outcome,
        "detail": detail,
    }


async def clients(
    url: str, concurrency: int, deadline: float, stop: threading.Event, out: list[dict]
) -> None:
    import httpx

    rng = random.Random(0)
    async with httpx.AsyncClient(timeout=None) as client:

        async def loop(w: int) -> None:
            while not stop.is_set():
                n = rng.randint(8, 48)
                out.append(await one_request(client, url, w % 2 == 0, n, deadline))

        await asyncio.gather(*(loop(w) for w in range(concurrency)))


# ----------------------------------------------------------------------------- faults
def replicas() -> list[dict]:
    """engine_stats of every running replica (pid, actor name, worker pids).

    Asked through Serve's deployment handle (a replica's actor exposes Serve's methods, not
    the deployment's), which reaches one replica per call: calls repeat until each running
    replica answered; one that does not answer within 10 s (e.g. its worker stopped) is
    left out this time."""
    from ray import serve

    want = running_replicas()
    handle = serve.get_deployment_handle(DEPLOYMENT, APP)
    found: dict[str, dict] = {}
    for _ in range(8 * max(want, 1)):
        if len(found) >= want:
            break
        try:
            stats = handle.engine_stats.remote().result(timeout_s=10)
        except Exception:  # noqa: BLE001 - a replica going away right now
            continue
        found[stats["actor_name"]] = stats
    return list(found.values())


def running_replicas() -> int:
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None or DEPLOYMENT not in app.deployments:
        return 0
    return app.deployments[DEPLOYMENT].replica_states.get("RUNNING", 0)


def proxy_pid() -> int | None:
    from ray.util.state import list_actors

    for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
        if actor.class_name == "ProxyActor":
            return actor.pid
    return None


class Chaos:
    """Injects one fault of each kind in turn (skipping a kind with no victim right now)."""

    def __init__(self, cluster: Any, devices_per_node: int, node_back_after: float) -> None:
        self.cluster = cluster
        self.devices = devices_per_node
        self.node_back_after = node_back_after
        self.rng = random.Random(1)
        self.turn = 0
        self.stopped: list[int] = []  # SIGSTOPped pids, resumed at the end if still alive
        self.pending_nodes: list[float] = []  # when a removed raylet is replaced
        # Replacement raylets not yet known to have lived NEW_NODE_GRACE_S (node, started at),
        # and those that died sooner, which no fault of the soak killed: replaced again and
        # reported (``replacements_died``), never hidden.
        self.new_nodes: list[tuple[Any, float]] = []
        self.replacements_died: list[dict[str, Any]] = []

    def inject(self) -> dict[str, Any] | None:
        for _ in range(len(FAULTS)):
            kind = FAULTS[self.turn % len(FAULTS)]
            self.turn += 1
            victim = getattr(self, kind)()
            if victim is not None:
                return {"kind": kind, "victim": victim}
        return None

    def _replica(self) -> dict | None:
        found = replicas()
        return self.rng.choice(found) if found else None

    def worker_kill(self) -> str | None:
        replica = self._replica()
        if replica is None:
            return None
        pid = replica["workers"][0]["pid"]
        os.kill(pid, signal.SIGKILL)
        return f"worker pid {pid}"

    def worker_stop(self) -> str | None:
        replica = self._replica()
        if replica is None:
            return None
        pid = replica["workers"][0]["pid"]
        os.kill(pid, signal.SIGSTOP)
        self.stopped.append(pid)
        return f"worker pid {pid} (SIGSTOP)"

    def engine_kill(self) -> str | None:
        import psutil

        replica = self._replica()
        if replica is None:
            return None
        children = psutil.Process(replica["pid"]).children()
        cores = [c for c in children if "EngineCore" in c.name() + " ".join(c.cmdline())]
        if not cores:
            return None
        cores[0].kill()
        return f"engine core pid {cores[0].pid}"

    def replica_kill(self) -> str | None:
        replica = self._replica()
        if replica is None:
            return None
        os.kill(replica["pid"], signal.SIGKILL)
        return f"replica pid {replica['pid']}"

    def raylet_kill(self) -> str | None:
        workers = [n for n in self.cluster.worker_nodes if n.remaining_processes_alive()]
        if len(workers) < 2:  # keep one raylet with devices
            return None
        node = self.rng.choice(workers)
        self.cluster.remove_node(node, allow_graceful=False)
        self.pending_nodes.append(time.monotonic() + self.node_back_after)
        return f"raylet {node.node_id[:8]}"

    def proxy_kill(self) -> str | None:
        pid = proxy_pid()
        if pid is None:
            return None
        os.kill(pid, signal.SIGKILL)
        return f"proxy pid {pid}"

    def replace_nodes(self, t0: float) -> None:
        now = time.monotonic()
        for node, started in list(self.new_nodes):
            if node.remaining_processes_alive():
                if now - started > NEW_NODE_GRACE_S:
                    self.new_nodes.remove((node, started))
                continue
            self.new_nodes.remove((node, started))
            self.replacements_died.append(
                {"node": node.node_id[:8], "at_s": now - t0, "lived_s": now - started}
            )
            self.cluster.remove_node(node, allow_graceful=False)
            self.pending_nodes.append(now)
        due = [t for t in self.pending_nodes if t <= now]
        for t in due:
            self.pending_nodes.remove(t)
            node = self.cluster.add_node(num_cpus=4, resources={"RBLN": self.devices})
            self.new_nodes.append((node, time.monotonic()))

    def resume_stopped(self) -> None:
        for pid in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def capacity_back(url: str, replicas_wanted: int) -> bool:
    import httpx

    if running_replicas() < replicas_wanted:
        return False
    body = {"model": MODEL, "prompt": "y = ", "max_tokens": 2}
    try:
        return httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="6 minutes, a fault every 50 s")
    p.add_argument("--seconds", type=float, default=1200)
    p.add_argument("--fault-every", type=float, default=60)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--devices-per-node", type=int, default=3)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--shape", default="llama-3-8b", help="timing mode's modelled model")
    p.add_argument(
        "--step-deadline", type=float, default=30, help="VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
    )
    p.add_argument("--request-deadline", type=float, default=240)
    p.add_argument("--node-back-after", type=float, default=20)
    p.add_argument(
        "--adversaries",
        action="store_true",
        help="no faults: ordinary load alone, then with adversarial clients",
    )
    p.add_argument(
        "--baseline-seconds",
        type=float,
        default=300,
        help="--adversaries: ordinary load alone for this long first",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.fault_every = 360, 50
        args.baseline_seconds = min(args.baseline_seconds, 120)
    if args.adversaries:
        args.fault_every = 0  # the phases compare load with and without attackers only

    from tests.helpers import compiled_model  # the tiny Llama, compiled on the emulator

    compiled = compiled_model("llama")
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from tqdm import tqdm

    from rbln_ray.serve.config import RequestLimits
    from rbln_ray.serve.proxy_guard import proxy_env

    common.emulator_env("timing", args.shape)
    os.environ.update(proxy_env(RequestLimits()))
    os.environ["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = str(int(args.step_deadline))
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"RBLN": 0}}
    )
    for _ in range(args.nodes):
        cluster.add_node(num_cpus=4, resources={"RBLN": args.devices_per_node})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    chaos = Chaos(cluster, args.devices_per_node, args.node_back_after)
    results: list[dict] = []
    faults: list[dict[str, Any]] = []
    stop = threading.Event()
    try:
        port = common.free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        routing = {"routing": "cache_aware"} if args.adversaries else {}
        url = common.deploy_serve_app(
            compiled, args.replicas, port, app_extra=routing, placement_strategy="SPREAD"
        )
        attack = Adversaries(url, MODEL) if args.adversaries else None
        health: list[dict[str, Any]] = []
        load = threading.Thread(
            target=lambda: asyncio.run(
                clients(url, args.concurrency, args.request_deadline, stop, results)
            ),
            daemon=True,
        )
        t0 = time.monotonic()
        load.start()
        next_fault = t0 + args.fault_every
        baseline = args.baseline_seconds if attack else 0.0
        total = baseline + args.seconds
        with tqdm(total=int(total), desc="chaos soak", unit="s") as bar:
            while (now := time.monotonic()) < t0 + total:
                bar.n = int(now - t0)
                bar.set_postfix(requests=len(results), faults=len(faults))
                bar.refresh()
                if attack and attack.started_at is None and now >= t0 + baseline:
                    attack.start()
                if attack and int(now - t0) % 10 == 0:
                    health.append({"t_s": now - t0, "status": health_status(url)})
                chaos.replace_nodes(t0)
                open_faults = [f for f in faults if f["back_s"] is None]
                if open_faults and capacity_back(url, args.replicas):
                    for f in open_faults:
                        f["back_s"] = time.monotonic() - t0 - f["at_s"]
                if args.fault_every and now >= next_fault and not open_faults:
                    fault = chaos.inject()
                    if fault is not None:
                        faults.append({**fault, "at_s": now - t0, "back_s": None})
                    next_fault = now + args.fault_every
                time.sleep(1.0)  # the pacing of this control loop (faults, recovery checks)
        stop.set()
        attacked = attack.stop() if attack else {}
        load.join(timeout=args.request_deadline + 60)
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        if attack and attack.started_at is not None and not attacked:
            attack.stop()
        chaos.resume_stopped()
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()

    outcomes = {
        k: sum(r["outcome"] == k for r in results) for k in ("ok", "error", "connection", "hung")
    }
    data = {
        "config": vars(args),
        "seconds": elapsed,
        "requests": len(results),
        "outcomes": outcomes,
        "faults": faults,
        "faults_by_kind": {k: sum(f["kind"] == k for f in faults) for k in FAULTS},
        "recovery_s": common.summary([f["back_s"] for f in faults if f["back_s"] is not None]),
        "not_recovered": [f for f in faults if f["back_s"] is None],
        "replacement_raylets_died": chaos.replacements_died,
        "error_examples": [r["detail"] for r in results if r["outcome"] != "ok"][:30],
        "latency_s": common.summary([r["end"] - r["start"] for r in results]),
    }
    if attack:
        data["adversaries"] = adversary_summary(results, t0, attack, attacked, health)
    name = "chaos_soak_adversaries" if attack else "chaos_soak"
    common.save(name, data, args.quick)
    plot(results, faults, t0, args.quick, name, attack.started_at - t0 if attack else None)
    print(
        f"chaos soak: {len(results)} requests in {elapsed:.0f} s: {json.dumps(outcomes)}; "
        f"{len(faults)} faults {data['faults_by_kind']}; capacity back after "
        f"{[round(f['back_s'] or -1) for f in faults]} s"
    )
    if attack:
        print(f"adversaries: {json.dumps(data['adversaries'], default=str)[:2000]}")
        ordinary = data["adversaries"]["attack"]
        return 0 if outcomes["hung"] == 0 and ordinary["failed"] == 0 else 1
    return 0 if outcomes["hung"] == 0 else 1


def health_status(url: str) -> int | str:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=10).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


def adversary_summary(
    results: list[dict], t0: float, attack: Adversaries, counts: dict, health: list[dict]
) -> dict[str, Any]:
    """The ordinary requests of each phase (outcomes, latency), the p99 ratio, what the
    attackers got, and /health during the soak."""
    start = attack.started_at
    during = [start is not None and r["start"] >= start for r in results]
    phases = {
        "baseline": [r for r, d in zip(results, during, strict=True) if not d],
        "attack": [r for r, d in zip(results, during, strict=True) if d],
    }
    out: dict[str, Any] = {}
    for phase, rows in phases.items():
        latency = common.summary([r["end"] - r["start"] for r in rows])
        out[phase] = {
            "requests": len(rows),
            "failed": sum(r["outcome"] != "ok" for r in rows),
            "latency_s": latency,
            "seconds": (
                max((r["end"] for r in rows), default=t0)
                - min((r["start"] for r in rows), default=t0)
            ),  # fmt: skip
        }
    base, hit = out["baseline"]["latency_s"]["p99"], out["attack"]["latency_s"]["p99"]
    out["p99_ratio"] = hit / base if base and hit else None
    out["attackers"] = {kind: {"source": src, "loops": n, "outcomes": counts.get(kind, {})}
                        for kind, (src, n) in KINDS.items()}  # fmt: skip
    out["health"] = health
    return out


def plot(
    results: list[dict],
    faults: list[dict],
    t0: float,
    quick: bool,
    name: str = "chaos_soak",
    attack_at: float | None = None,
) -> Path:
    plt = common.pyplot()
    bucket = 10.0
    n = int(max((r["end"] - t0 for r in results), default=0) // bucket) + 1
    series = {k: [0] * n for k in ("ok", "error", "connection", "hung")}
    for r in results:
        series[r["outcome"]][int((r["end"] - t0) // bucket)] += 1
    fig, ax = plt.subplots(figsize=(10, 4))
    bottom = [0] * n
    for kind, color in (("ok", "tab:green"), ("error", "tab:orange"),
                        ("connection", "tab:purple"), ("hung", "tab:red")):  # fmt: skip
        ax.bar([i * bucket for i in range(n)], series[kind], width=bucket, bottom=bottom,
               align="edge", color=color, label=kind)  # fmt: skip
        bottom = [b + c for b, c in zip(bottom, series[kind], strict=True)]
    for f in faults:
        ax.axvline(f["at_s"], color="black", linestyle="--", linewidth=0.8)
        ax.text(f["at_s"], max(bottom or [1]), f["kind"], rotation=90, fontsize=7, va="top")
    if attack_at is not None:
        ax.axvline(attack_at, color="tab:red", linewidth=1.5)
        ax.text(attack_at, max(bottom or [1]), " adversaries join", color="tab:red", va="top")
        ax2 = ax.twinx()
        done = sorted(results, key=lambda r: r["end"])
        ax2.plot([r["end"] - t0 for r in done], [r["end"] - r["start"] for r in done], ".",
                 markersize=2, color="black", alpha=0.4)  # fmt: skip
        ax2.set_ylabel("ordinary request latency, s (dots)")
    ax.set_xlabel("seconds (dashed: a fault)")
    ax.set_ylabel(f"requests ended per {bucket:g} s")
    ax.legend(loc="lower right")
    ax.set_title("Chaos soak: outcomes over time")
    path = common.plot_path(name, quick)
    fig.tight_layout()
    fig.savefig(path)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
