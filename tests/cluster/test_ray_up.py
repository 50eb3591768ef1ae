"""``ray up`` of the shipped emulated config, for real: SSH, serve, complete, ``ray down``.

The head and two workers are loopback addresses of this machine, each a real sshd
(:mod:`tests.cluster.loopback_hosts`). The only changes to ``cluster_configs/ray-up-emulated.yaml``
are what this machine needs (:func:`tests.cluster.ray_up_cluster.render_cluster_config`):
cluster name, the SSH user/key/port of those hosts, free head ports, a token and API key of
this run. Every host's ``~/rbln-ray/venv`` links to this checkout's venv (the shared path the
config allows on one machine), so its setup commands install nothing.
"""

from __future__ import annotations

import getpass
import ipaddress
import logging
import secrets
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.cluster import RAYLET_START_TIMEOUT, START_ATTEMPTS
from tests.cluster.loopback_hosts import LoopbackHosts, requirements_problem
from tests.cluster.ray_up_cluster import (
    LOOPBACK,
    ROOT,
    Launcher,
    Ports,
    listening_addresses,
    new_secret_file,
    non_loopback_peers,
    remove_ssh_control_dir,
    render_cluster_config,
    render_serve_config,
)
from tests.helpers import compiled_model

logger = logging.getLogger(__name__)

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

CLUSTER_CONFIG = ROOT / "cluster_configs" / "ray-up-emulated.yaml"
SERVE_CONFIG = ROOT / "cluster_configs" / "serve_config.yaml"
APP = "rbln-ray"
SERVER_CLASS = "ServeReplica:rbln-ray:LLMServer:demo"
WORKER_CLASS = "RBLNWorkerActor"
VENV = Path(sys.executable).parent.parent
STAMP = VENV / ".rbln-ray-installed"  # what the config's setup commands test for


def shipped() -> dict:
    return yaml.safe_load(CLUSTER_CONFIG.read_text())


@pytest.fixture(scope="module")
def hosts(request: pytest.FixtureRequest) -> Iterator[LoopbackHosts]:
    problem = requirements_problem()
    if problem == "needs root (sshd privilege separation and PID namespaces)":
        pytest.skip(f"loopback SSH hosts: {problem}")
    assert problem is None, problem
    assert STAMP.exists(), f"{VENV} was not made by `make setup` (no {STAMP.name})"
    provider = shipped()["provider"]
    ips = [provider["head_ip"], *provider["worker_ips"]]
    assert all(ipaddress.ip_address(ip) in LOOPBACK for ip in ips), ips
    loopback = LoopbackHosts(ips)
    failed_before = request.session.testsfailed
    try:
        loopback.start()
        for host in loopback.hosts.values():  # what each host needs beyond sshd: the venv
            (host.home / "rbln-ray").mkdir()
            (host.home / "rbln-ray" / "venv").symlink_to(VENV)
        yield loopback
    finally:
        left = loopback.stop()
    assert left == [], f"processes outlived the SSH hosts: {left}"
    if request.session.testsfailed == failed_before:
        shutil.rmtree(loopback.base, ignore_errors=True)
    else:
        logger.warning("logs kept in %s (Ray's under <host>/rbln-ray/<address>)", loopback.base)


class Cluster:
    """One ``ray up`` of the shipped config on the loopback hosts; always ``ray down``."""

    def __init__(self, hosts: LoopbackHosts, name: str):
        self.hosts = hosts
        self.name = f"{name}-{secrets.token_hex(3)}"
        self.dir = hosts.base / self.name
        self.dir.mkdir()
        self.ports = Ports()
        self.api_key = secrets.token_urlsafe(24)
        token = new_secret_file(self.dir / "auth_token")
        config = render_cluster_config(
            shipped(),
            cluster_name=self.name,
            ssh_user=getpass.getuser(),
            ssh_key=hosts.key,
            ssh_port=hosts.port,
            ports=self.ports,
            token_file=token,
            api_key_file=new_secret_file(self.dir / "api_key", self.api_key),
        )
        self.config = self.dir / "cluster.yaml"
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))
        self.launcher = Launcher(self.dir, self.config, self.ports, token)
        self.timings: dict[str, float] = {}

    def up(self) -> list[dict]:
        started = time.monotonic()
        args = ("up", "-y", "--no-config-cache", str(self.config))
        proc = self.launcher.ray(*args, timeout=600, check=False)
        for _ in range(START_ATTEMPTS - 1):
            if proc.returncode == 0 or RAYLET_START_TIMEOUT not in proc.stdout + proc.stderr:
                break
            # `ray up` again: it stops that node first (RAYLET_START_TIMEOUT says why)
            logger.warning("ray up: a raylet did not come up; once more")
            proc = self.launcher.ray(*args, timeout=600, check=False)
        assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
        self.timings["ray up"] = time.monotonic() - started
        nodes = self.launcher.wait_nodes(len(self.hosts.ips), timeout_s=300)
        self.timings["3 nodes"] = time.monotonic() - started
        return nodes

    def deploy(
        self, placement_timeout_s: float | None = None, devices_per_worker: int | None = None
    ) -> Path:
        doc = render_serve_config(
            yaml.safe_load(SERVE_CONFIG.read_text()),
            http_port=self.ports.http,
            model_dir=compiled_model("llama"),  # tiny, batch 4, 1 device; a shared path
            placement_timeout_s=placement_timeout_s,
            devices_per_worker=devices_per_worker,
        )
        path = self.dir / "serve_config.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.launcher.serve("deploy", str(path), "-a", self.launcher.dashboard)
        return path

    def down(self) -> dict[str, list[str]]:
        started = time.monotonic()
        self.launcher.ray("down", "-y", str(self.config), timeout=300)
        left = self.hosts.wait_empty(timeout_s=60)
        self.timings["ray down"] = time.monotonic() - started
        remove_ssh_control_dir(self.name)
        return left

    def host_pids(self) -> list[int]:
        return [pid for host in self.hosts.hosts.values() for pid in host.pids()]


def rbln(node: dict) -> float:
    return float(node["resources_total"].get("RBLN", 0))


# Its own waits are bounded (each `ray up`, the nodes, the app); pytest's is the backstop. With
# two more `ray up`s (RAYLET_START_TIMEOUT) one run went past 900 s.
@pytest.mark.timeout(1800)
def test_ray_up_serves_on_workers_and_ray_down_leaves_nothing(hosts: LoopbackHosts):
    cluster = Cluster(hosts, "rbln-up")
    started = time.monotonic()
    try:
        nodes = cluster.up()
        by_ip = {n["node_ip"]: n for n in nodes}
        head_ip, *worker_ips = hosts.ips
        assert set(by_ip) == set(hosts.ips), by_ip.keys()
        assert by_ip[head_ip]["is_head_node"] and rbln(by_ip[head_ip]) == 0
        for ip in worker_ips:
            assert rbln(by_ip[ip]) == 2, by_ip[ip]["resources_total"]
            # Ray's own RBLN detection saw the emulated ATOMs (the config's `rebel` shim).
            assert "accelerator_type:RBLN-CA25" in by_ip[ip]["resources_total"]

        cluster.deploy()
        status, waited = cluster.launcher.wait_app(
            APP, {"RUNNING", "DEPLOY_FAILED", "UNHEALTHY"}, timeout_s=600
        )
        cluster.timings["deploy to RUNNING"] = waited
        assert status["status"] == "RUNNING", status
        shown = cluster.launcher.serve("status", "-a", cluster.launcher.dashboard).stdout
        assert yaml.safe_load(shown)["applications"][APP]["status"] == "RUNNING", shown

        import openai

        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{cluster.ports.http}/v1", api_key=cluster.api_key
        )
        assert [m.id for m in client.models.list().data] == ["demo"]
        completion = client.completions.create(model="demo", prompt="def main(", max_tokens=8)
        assert completion.choices[0].text and completion.usage.completion_tokens == 8

        # Both model replicas, and their RBLN worker actors, on the two worker nodes.
        actors = cluster.launcher.listing("actors", state="ALIVE")
        node_ip = {n["node_id"]: n["node_ip"] for n in nodes}
        servers = sorted(node_ip[a["node_id"]] for a in actors if a["class_name"] == SERVER_CLASS)
        workers = sorted(node_ip[a["node_id"]] for a in actors if a["class_name"] == WORKER_CLASS)
        assert servers == sorted(worker_ips), servers
        assert workers == servers, workers

        # Nothing reaches beyond 127.0.0.0/8: every socket of every process on the hosts is
        # listening or connected to a loopback address.
        pids = cluster.host_pids()
        assert len(pids) > 10
        assert non_loopback_peers(pids) == []
        logger.info("listening on %s", sorted(listening_addresses(pids)))

        # A replica that no node can hold (3 devices per worker; each worker has 2) fails
        # `serve deploy` within its placement timeout, naming what was asked and what each
        # node has, instead of leaving the app DEPLOYING forever (rbln_ray/serve/capacity.py).
        timeout_s = 20.0
        cluster.deploy(placement_timeout_s=timeout_s, devices_per_worker=3)
        status, waited = cluster.launcher.wait_app(
            APP, {"DEPLOY_FAILED", "UNHEALTHY"}, timeout_s=timeout_s + 120
        )
        cluster.timings["deploy to failure"] = waited
        assert status["status"] == "DEPLOY_FAILED", status
        shown = cluster.launcher.serve("status", "-a", cluster.launcher.dashboard).stdout
    finally:
        left = cluster.down()
    assert left == {}, left
    message = yaml.safe_load(shown)["applications"][APP]["message"]
    assert "no node of this cluster can hold a replica's placement group" in message, message
    assert "[{'CPU': 1}, {'RBLN': 3, 'CPU': 1}]" in message, message
    assert f"placement_timeout_s={timeout_s:g}" in message, message
    assert "cluster has 4 RBLN in total" in message, message
    assert f"({head_ip}): 0 RBLN" in message, message
    for ip in worker_ips:
        assert f"({ip}): 2 RBLN" in message, message
    # Not before the configured wait; how long after it depends on the host's load (the
    # attempt's fresh worker imports the app's builder, vLLM included), and wait_app's
    # deadline above (timeout_s + 120) bounds it.
    assert waited >= timeout_s, waited
    logger.info("timings %s, total %.0f s", cluster.timings, time.monotonic() - started)
    print(f"timings {cluster.timings}, total {time.monotonic() - started:.0f} s")
