#!/usr/bin/env python3
"""Bring up a multi-node rbln-ray cluster on one machine, serve on it, test it, tear it down.

    .venv/bin/python scripts/cluster_up.py                       # demo model, 2 replicas
    .venv/bin/python scripts/cluster_up.py --model /path/to/compiled --hold   # keep it up

What it does (every step is a plain Ray/Serve CLI call, printed as it runs):

1. ``ray start --head`` (no RBLN devices; GCS, dashboard, Serve controller and HTTP proxy) and
   ``--workers`` x ``ray start --address ... --resources '{"RBLN": N}'``: separate raylets, each
   with its own emulated ATOM devices 0..N-1 (``RBLN_RAY_DEVICE=emulated`` in their env). All
   ports are picked free, every node has its own ``--temp-dir`` under one private directory,
   the dashboard and HTTP bind 127.0.0.1 and Ray token auth uses a token private to this run,
   so it runs beside other Ray clusters on the machine.
2. Copies the Serve config (default ``cluster_configs/serve_config.yaml``) with only the HTTP
   port and, when asked, the model path changed; resolves ``demo``/HF-dir models to compiled
   artifacts first (``rbln-ray serve`` does the same) so replicas start from artifacts; then
   ``serve deploy`` to the head's dashboard and polls ``serve status`` until RUNNING.
3. Smoke test: ``GET /v1/models`` and a ``POST /v1/completions`` over HTTP (with the API key);
   reports which raylet each replica and RBLN worker actor landed on.
4. Tears everything down (also on failure, Ctrl-C or SIGTERM): ``serve shutdown``, then
   SIGTERM/SIGKILL to exactly the processes of this cluster. This script makes itself a child
   subreaper, so every process ``ray start`` daemonises stays its descendant; processes whose
   command line names this cluster's temp dir are included too. It never runs ``ray stop``
   (that would kill every Ray process on the machine, other clusters included).

The last line of output is ``CLUSTER_RESULT <json>`` (nodes, replica placement, completion,
teardown leftovers); ``--json FILE`` writes the same. Exit status 0 only if the completion was
answered, the placement requirement (``--min-replica-nodes``) held and nothing was left behind.

CPU numbers are Ray accounting, not cores: a replica takes ``1 + pipeline_stages`` CPUs of
bundles, so ``--cpus-per-worker 2`` (default) lets each worker raylet host exactly one
single-stage replica, which spreads two replicas over two raylets deterministically.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from rbln_ray.common.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SERVE_CONFIG = ROOT / "cluster_configs" / "serve_config.yaml"
BIN = Path(sys.executable).parent
PR_SET_CHILD_SUBREAPER = 36
REPLICA_PREFIX = "ServeReplica:"
SERVER_MARK = ":LLMServer:"
WORKER_CLASS = "RBLNWorkerActor"


def log(msg: str) -> None:
    print(f"[cluster_up] {msg}", flush=True)


class Interrupted(Exception):
    """SIGTERM/SIGINT/SIGHUP arrived: unwind into the teardown."""


def _on_signal(signum: int, _frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


# --------------------------------------------------------------------------- processes


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, state) for every process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # comm may contain spaces/parens: fields after the last ')' are fixed.
        rest = stat[stat.rfind(")") + 2 :].split()
        table[int(entry)] = (int(rest[1]), rest[0])
    return table


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        return raw.replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def cluster_pids(marker: str) -> list[int]:
    """Live (non-zombie) processes of this cluster: our descendants + cmdlines naming ``marker``."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = set(), [os.getpid()]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    for pid in table:
        if pid not in found and pid != os.getpid() and marker in _cmdline(pid):
            found.add(pid)
    return sorted(p for p in found if table.get(p, (0, "Z"))[1] != "Z")


def reap_zombies() -> None:
    """Collect exited children (we are a subreaper, so orphaned Ray processes are ours)."""
    for pid, (ppid, state) in _proc_table().items():
        if ppid == os.getpid() and state == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def kill_cluster(marker: str, grace_s: float = 10.0) -> list[int]:
    """SIGTERM, then SIGKILL, this cluster's processes; return any still alive."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        pids = cluster_pids(marker)
        if not pids:
            return []
        names = sorted({_cmdline(p)[:60] for p in pids}) if sig == signal.SIGKILL else []
        log(f"sending {sig.name} to {len(pids)} process(es) of this cluster {names or ''}")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            reap_zombies()
            if not cluster_pids(marker):
                return []
            time.sleep(0.2)
    reap_zombies()
    return cluster_pids(marker)


def run(
    cmd: list[str], env: dict[str, str], log_file: Path, timeout: float = 180, quiet=False
) -> str:
    if not quiet:
        log("$ " + " ".join(cmd))
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    if not quiet or proc.returncode != 0:
        with log_file.open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}\n")
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[:3])} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
            f"{proc.stderr[-3000:]}"
        )
    return proc.stdout


# --------------------------------------------------------------------------- config


def serve_config_copy(args: argparse.Namespace, http_port: int) -> tuple[dict, dict]:
    """The Serve config with only the HTTP port and model paths changed; and its app args."""
    from rbln_ray.serve.config import load_config

    doc = yaml.safe_load(Path(args.serve_config).read_text())
    doc.setdefault("http_options", {})["port"] = http_port
    app = doc["applications"][0]
    app_args = app.setdefault("args", {})
    if args.model:
        for m in app_args["models"]:
            m["model"], m["compile"] = str(Path(args.model).resolve()), {}
    config = load_config(app_args)  # fail here, not inside the controller
    if not args.model:
        from rbln_ray.cli.serve_cmd import prepare_models

        log("resolving models to compiled artifacts (the demo model trains once, then cached)")
        prepared = prepare_models(config)
        for m, p in zip(app_args["models"], prepared.models, strict=True):
            m["model"], m["compile"] = p.model, {}
    if args.replicas is not None:
        for m in app_args["models"]:
            m.pop("autoscaling_config", None)
            m["num_replicas"] = args.replicas
    return doc, app_args


# --------------------------------------------------------------------------- checks


def http(url: str, body: dict | None = None, key: str | None = None, timeout=120) -> Any:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_nodes(dashboard: str, expected: int, deadline: float) -> list[dict]:
    from ray.util.state import list_nodes

    while True:
        try:
            nodes = [n for n in list_nodes(address=dashboard, limit=100) if n.state == "ALIVE"]
            if len(nodes) >= expected:
                return [
                    {
                        "node_id": n.node_id,
                        "is_head": n.is_head_node,
                        "ip": n.node_ip,
                        "rbln": n.resources_total.get("RBLN", 0),
                        "cpu": n.resources_total.get("CPU", 0),
                        "accelerator_type": next(
                            (
                                r.split(":", 1)[1]
                                for r in n.resources_total
                                if r.startswith("accelerator_type:")
                            ),
                            None,
                        ),
                    }
                    for n in nodes
                ]
        except Exception as e:  # noqa: BLE001 - the dashboard may still be starting
            last = e
        else:
            last = f"{len(nodes)}/{expected} nodes alive"
        if time.monotonic() > deadline:
            raise TimeoutError(f"cluster did not reach {expected} nodes: {last}")
        time.sleep(1)


def wait_app(dashboard: str, env: dict, log_file: Path, app: str, deadline: float) -> None:
    log(f"waiting for application {app} (serve status -a {dashboard})")
    while True:
        out = run([str(BIN / "serve"), "status", "-a", dashboard], env, log_file, 60, quiet=True)
        status = (yaml.safe_load(out) or {}).get("applications", {}).get(app, {})
        state = status.get("status")
        if state == "RUNNING":
            return
        if state in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"application {app} is {state}: {status.get('message')}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"application {app} not RUNNING in time (last: {state}):\n{out}")
        time.sleep(2)


def placement(dashboard: str) -> dict[str, list[str]]:
    """Node id of every live Serve replica and RBLN worker actor."""
    from ray.util.state import list_actors

    actors = list_actors(address=dashboard, filters=[("state", "=", "ALIVE")], limit=1000)
    out: dict[str, list[str]] = {}
    for a in actors:
        if a.class_name.startswith(REPLICA_PREFIX) or a.class_name == WORKER_CLASS:
            out.setdefault(a.class_name, []).append(a.node_id)
    return out


# --------------------------------------------------------------------------- main


def bring_up(args: argparse.Namespace, base: Path, env: dict, result: dict) -> None:
    deadline = time.monotonic() + args.timeout
    log_file = base / "cluster_up.log"
    gcs_port, dash_port, client_port, http_port = (free_port() for _ in range(4))
    dashboard = f"http://127.0.0.1:{dash_port}"
    gcs = f"127.0.0.1:{gcs_port}"
    result.update(
        temp_dir=str(base), gcs_address=gcs, dashboard=dashboard, serve_config=args.serve_config
    )

    doc, app_args = serve_config_copy(args, http_port)
    app_name = doc["applications"][0]["name"]
    key_env = app_args.get("api_key_env")
    api_key = app_args.get("api_key")
    if key_env:
        api_key = env.setdefault(key_env, os.environ.get(key_env) or secrets.token_urlsafe(24))
    config_path = base / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    log(f"serve config for this cluster: {config_path}")

    common = [
        "--node-ip-address=127.0.0.1",
        f"--object-store-memory={args.object_store_mb * 2**20}",
        "--disable-usage-stats",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--metrics-export-port={free_port()}",
    ]
    ray = str(BIN / "ray")
    # Head: no RBLN devices, so replicas and workers land on the worker raylets.
    run(
        [ray, "start", "--head", f"--port={gcs_port}", f"--temp-dir={base / 'head'}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}",
         f"--ray-client-server-port={client_port}", f"--num-cpus={args.head_cpus}",
         "--resources", json.dumps({"RBLN": 0}), *common],
        env, log_file,
    )  # fmt: skip
    for i in range(args.workers):
        common[-2:] = [f"--dashboard-agent-listen-port={free_port()}",
                       f"--metrics-export-port={free_port()}"]  # fmt: skip
        run(
            [ray, "start", f"--address={gcs}", f"--temp-dir={base / f'worker{i}'}",
             f"--num-cpus={args.cpus_per_worker}",
             "--resources", json.dumps({"RBLN": args.rbln_per_worker}), *common],
            env, log_file,
        )  # fmt: skip
    result["nodes"] = wait_nodes(dashboard, 1 + args.workers, deadline)
    log(f"{len(result['nodes'])} raylets alive: {result['nodes']}")

    serve = str(BIN / "serve")
    run([serve, "deploy", str(config_path), "-a", dashboard], env, log_file)
    result["deployed"] = True
    wait_app(dashboard, env, log_file, app_name, deadline)
    url = f"http://127.0.0.1:{http_port}"
    result["url"] = url
    log(f"application {app_name} RUNNING at {url}")

    model = app_args["models"][0]["name"]
    models = http(f"{url}/v1/models", key=api_key)
    result["models"] = [m["id"] for m in models["data"]]
    body = {"model": model, "prompt": args.prompt, "max_tokens": args.max_tokens}
    completion = http(f"{url}/v1/completions", body, key=api_key)
    result["completion"] = completion["choices"][0]["text"]
    result["usage"] = completion.get("usage")
    log(f"completion: {result['completion']!r}")

    where = placement(dashboard)
    result["placement"] = where
    # Model server replicas (not the ingress): ServeReplica:<app>:LLMServer:<model>.
    replica_nodes = {n for cls, ns in where.items() if SERVER_MARK in cls for n in ns}
    result["replica_nodes"] = sorted(replica_nodes)
    result["worker_nodes"] = sorted(set(where.get(WORKER_CLASS, [])))
    log(f"replicas on {len(replica_nodes)} raylet(s), RBLN workers on "
        f"{len(result['worker_nodes'])} raylet(s)")  # fmt: skip
    if len(replica_nodes) < args.min_replica_nodes:
        raise RuntimeError(
            f"replicas on {len(replica_nodes)} raylet(s), expected >= {args.min_replica_nodes}"
        )
    result["ok"] = True

    if args.hold:
        token_file = base / "auth_token"
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # never readable
        with os.fdopen(fd, "w") as f:  # by others, not even before a chmod
            f.write(os.environ["RAY_AUTH_TOKEN"])
        log(f"cluster is up: {url}/v1  (dashboard {dashboard}, RAY_ADDRESS={gcs}, "
            f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token_file})")  # fmt: skip
        if api_key:
            log(f"API key: {api_key}")
        log("Ctrl-C to tear it down")
        while True:
            time.sleep(3600)


def teardown(base: Path, env: dict, result: dict) -> None:
    if result.get("deployed"):
        try:
            run([str(BIN / "serve"), "shutdown", "-a", result["dashboard"], "-y"], env,
                base / "cluster_up.log", timeout=90)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - killing the processes below is what matters
            log(f"serve shutdown failed ({e}); killing the cluster anyway")
    leftovers = kill_cluster(str(base))
    result["leftover_pids"] = leftovers
    if leftovers:
        result["ok"] = False
        log(f"processes of this cluster still alive: {leftovers}")
    else:
        log("torn down: no processes of this cluster left")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve-config", default=str(DEFAULT_SERVE_CONFIG))
    p.add_argument("--model", help="compiled model dir replacing every model in the config")
    p.add_argument("--replicas", type=int, help="override num_replicas of every model")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rbln-per-worker", type=int, default=2)
    p.add_argument("--cpus-per-worker", type=int, default=2)
    p.add_argument("--head-cpus", type=int, default=1)
    p.add_argument("--object-store-mb", type=int, default=128)
    p.add_argument("--min-replica-nodes", type=int, default=1)
    p.add_argument("--prompt", default="def main(")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=900, help="bring-up deadline (s)")
    p.add_argument("--hold", action="store_true", help="keep the cluster up until Ctrl-C")
    p.add_argument("--keep-logs", action="store_true", help="keep the temp dir on success")
    p.add_argument("--json", help="also write the result JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not sys.platform.startswith("linux"):
        raise SystemExit("cluster_up.py needs Linux (/proc, child subreaper)")
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit("prctl(PR_SET_CHILD_SUBREAPER) failed")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)

    os.environ["RBLN_RAY_DEVICE"] = "emulated"  # this process compiles the demo model if needed
    # Ray token authentication with a token private to this cluster (this process's own state
    # API calls and the ray/serve CLIs it runs read it from the environment too).
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    base = Path(tempfile.mkdtemp(prefix="rbln-cl-", dir="/tmp"))  # short: Unix socket paths
    from rbln_ray.emulator.switch import SHIM_DIR

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        RBLN_RAY_DEVICE="emulated",
        # The emulator's `rebel` shim: Ray's own RBLN detection in `ray start` then reports the
        # accelerator type (RBLN-CA25) as on hardware, and every process finds the emulator.
        PYTHONPATH=os.pathsep.join(p for p in (SHIM_DIR, os.environ.get("PYTHONPATH")) if p),
        RBLN_RAY_EMULATED_DEVICES=str(args.rbln_per_worker),
        RAY_USAGE_STATS_ENABLED="0",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        TOKENIZERS_PARALLELISM="false",
    )
    # every node's Serve proxy caps request bodies (rbln_ray/serve/proxy_guard.py)
    from rbln_ray.serve.config import RequestLimits
    from rbln_ray.serve.proxy_guard import proxy_env

    env.update(proxy_env(RequestLimits()))
    result: dict[str, Any] = {"ok": False}
    started = time.monotonic()
    try:
        bring_up(args, base, env, result)
    except Interrupted as e:
        log(f"interrupted by {e}")
        if not (args.hold and result["ok"]):  # --hold ends with Ctrl-C by design
            result.update(ok=False, error=f"interrupted by {e}")
    except Exception as e:  # noqa: BLE001 - report, tear down, exit non-zero
        log(f"FAILED: {type(e).__name__}: {e}")
        result["error"] = f"{type(e).__name__}: {e}"
        result["ok"] = False
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the teardown finish
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        result["bring_up_s"] = round(time.monotonic() - started, 1)
        teardown(base, env, result)
        result["total_s"] = round(time.monotonic() - started, 1)
        if result["ok"] and not args.keep_logs:
            shutil.rmtree(base, ignore_errors=True)
        else:
            log(f"logs kept in {base} (ray logs: {base}/*/session_latest/logs)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print("CLUSTER_RESULT " + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
