"""Drive a shipped ``ray up`` config end to end on loopback hosts: render it, run the CLIs.

Everything a user types is run as a subprocess (``ray up``, ``serve deploy``, ``serve status``,
``ray list``, ``ray down``) with the environment a user would have: Ray token authentication
on, the token in a file, rbln-ray importable (the config's node provider lives in it).
"""

from __future__ import annotations

import copy
import ipaddress
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers import free_port

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


def set_flag(cmd: str, flag: str, value: object) -> str:
    """``cmd`` with ``--flag=<old>`` replaced by ``--flag=<value>``; the flag must be there."""
    new, n = re.subn(rf"({re.escape(flag)}=)\S+", rf"\g<1>{value}", cmd)
    if n == 0:
        raise AssertionError(f"{flag}= not in the shipped command: {cmd}")
    return new


@dataclass
class Ports:
    """The head's fixed ports, picked free so the cluster runs beside any other Ray."""

    gcs: int = field(default_factory=free_port)
    dashboard: int = field(default_factory=free_port)
    client: int = field(default_factory=free_port)
    http: int = field(default_factory=free_port)


def render_cluster_config(
    shipped: dict[str, Any],
    *,
    cluster_name: str,
    ssh_user: str,
    ssh_key: Path,
    ssh_port: int,
    ports: Ports,
    token_file: Path,
    api_key_file: Path,
) -> dict[str, Any]:
    """The shipped config with only what this machine needs changed.

    Cluster name, the SSH user/key/port of the loopback hosts, the head's ports, the local
    token and API key files.
    """
    cfg = copy.deepcopy(shipped)
    cfg["cluster_name"] = cluster_name
    cfg["auth"] = {"ssh_user": ssh_user, "ssh_private_key": str(ssh_key)}
    cfg["provider"]["ssh_port"] = ssh_port
    mounts = cfg["file_mounts"]
    assert {"~/.ray/auth_token", "~/.rbln-ray/api_key"} <= set(mounts), mounts
    mounts["~/.ray/auth_token"] = str(token_file)
    mounts["~/.rbln-ray/api_key"] = str(api_key_file)

    head = cfg["head_start_ray_commands"]
    start = [i for i, c in enumerate(head) if "ray start --head" in c]
    assert len(start) == 1, head
    cmd = head[start[0]]
    cmd = set_flag(cmd, "--port", ports.gcs)
    cmd = set_flag(cmd, "--dashboard-port", ports.dashboard)
    cmd = set_flag(cmd, "--ray-client-server-port", ports.client)
    head[start[0]] = cmd

    workers = cfg["worker_start_ray_commands"]
    start = [i for i, c in enumerate(workers) if "ray start --address" in c]
    assert len(start) == 1, workers
    cmd = workers[start[0]].replace("$RAY_HEAD_IP:6379", f"$RAY_HEAD_IP:{ports.gcs}")
    assert f":{ports.gcs}" in cmd, cmd
    workers[start[0]] = cmd
    return cfg


def render_serve_config(
    shipped: dict[str, Any],
    *,
    http_port: int,
    model_dir: Path,
    placement_timeout_s: float | None,
    devices_per_worker: int | None = None,
) -> dict[str, Any]:
    """The shipped Serve config with the HTTP port and model path (and, optionally, the
    placement timeout and the devices per worker) changed."""
    doc = copy.deepcopy(shipped)
    doc["http_options"]["port"] = http_port
    for m in doc["applications"][0]["args"]["models"]:
        m["model"] = str(model_dir)
        m.pop("compile", None)
        if placement_timeout_s is not None:
            m["placement_timeout_s"] = placement_timeout_s
        if devices_per_worker is not None:
            m["devices_per_worker"] = devices_per_worker
    return doc


class CommandFailed(AssertionError):
    pass


@dataclass
class Launcher:
    """Where ``ray up`` runs: this checkout, its venv, a token file, a private RAY_TMPDIR."""

    base: Path
    config: Path
    ports: Ports
    token_file: Path
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.base / "launcher.log"
        for d in ("launcher-ray", "launcher-tmp"):
            (self.base / d).mkdir(exist_ok=True)

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.ports.dashboard}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(
            PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
            PYTHONPATH=str(ROOT),  # the provider module of the config, from this checkout
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=str(self.token_file),
            # Ray's launcher state (cluster-<name>.state) and config cache stay in our dir.
            RAY_TMPDIR=str(self.base / "launcher-ray"),
            TMPDIR=str(self.base / "launcher-tmp"),
            RAY_USAGE_STATS_ENABLED="0",
        )
        return env

    def run(self, *cmd: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess:
        started = time.monotonic()
        proc = subprocess.run(
            list(cmd), cwd=ROOT, env=self.env(), capture_output=True, text=True,
            timeout=timeout, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        took = time.monotonic() - started
        with self.log.open("a") as f:
            f.write(f"$ {' '.join(cmd)}  # rc {proc.returncode}, {took:.1f} s\n")
            f.write(f"{proc.stdout}\n{proc.stderr}\n")
        if check and proc.returncode != 0:
            raise CommandFailed(
                f"{' '.join(cmd[:3])} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                f"{proc.stderr[-3000:]}"
            )
        return proc

    def ray(self, *args: str, timeout: float = 600, check: bool = True):
        return self.run(str(BIN / "ray"), *args, timeout=timeout, check=check)

    def serve(self, *args: str, timeout: float = 120, check: bool = True):
        return self.run(str(BIN / "serve"), *args, timeout=timeout, check=check)

    def get(self, path: str, timeout: float = 30) -> Any:
        """GET the head's dashboard API with the token, as Ray's CLIs do (polling through the
        CLIs would cost seconds of CPU per call on this machine)."""
        token = self.token_file.read_text().strip()
        req = urllib.request.Request(
            self.dashboard + path, headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def listing(self, resource: str, **filters: str) -> list[dict[str, Any]]:
        """``ray list <resource> --detail`` through the state API."""
        query = [("detail", "true"), ("limit", "1000")]
        for key, value in filters.items():
            query += [("filter_keys", key), ("filter_predicates", "="), ("filter_values", value)]
        body = self.get(f"/api/v0/{resource}?{urllib.parse.urlencode(query)}")
        if not body.get("result"):
            raise CommandFailed(f"state API {resource}: {body.get('msg')}")
        return body["data"]["result"]["result"]

    def wait_nodes(self, count: int, timeout_s: float) -> list[dict[str, Any]]:
        """Poll until ``count`` nodes are alive (the head's autoscaler starts the workers
        after ``ray up`` returns)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                nodes = self.listing("nodes", state="ALIVE")
            except (OSError, CommandFailed, ValueError) as e:  # dashboard still starting
                nodes, last = [], repr(e)[-300:]
            else:
                last = f"{len(nodes)} alive"
            if len(nodes) >= count:
                return nodes
            if time.monotonic() > deadline:
                raise AssertionError(f"{count} nodes not alive in {timeout_s:g} s ({last})")
            time.sleep(1)  # polling the cluster's node list with a deadline

    def app_status(self, app: str) -> dict[str, Any]:
        """What ``serve status`` shows for ``app`` (Serve's REST API behind it)."""
        return self.get("/api/serve/applications/").get("applications", {}).get(app, {})

    def wait_app(self, app: str, until: set[str], timeout_s: float) -> tuple[dict, float]:
        """Poll the app's status until it is in ``until``; return (status, seconds waited)."""
        started = time.monotonic()
        while True:
            status = self.app_status(app)
            if status.get("status") in until:
                return status, time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise AssertionError(f"{app} not in {until} after {timeout_s:g} s: {status}")
            time.sleep(1)  # polling the application status with a deadline


def new_secret_file(path: Path, value: str | None = None) -> Path:
    path.write_text(value or secrets.token_hex(32))
    path.chmod(0o600)
    return path


def remove_ssh_control_dir(cluster_name: str) -> None:
    """Ray's SSH runner keeps ControlMaster sockets in /tmp/ray_ssh_<user>/<cluster>/."""
    import getpass
    import hashlib

    user = hashlib.sha256(getpass.getuser().encode()).hexdigest()[:10]
    cluster = hashlib.sha256(cluster_name.encode()).hexdigest()[:10]
    shutil.rmtree(f"/tmp/ray_ssh_{user}/{cluster}", ignore_errors=True)


# --------------------------------------------------------------------------- sockets


def _hex_addr(text: str) -> tuple[ipaddress._BaseAddress, int]:
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    # /proc/net/* prints addresses as native-endian 32-bit words.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(words)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    return addr, int(port, 16)


def _socket_table() -> dict[int, tuple[str, str, int, str, int, str]]:
    """socket inode -> (proto, local addr, local port, remote addr, remote port, state)."""
    out = {}
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        try:
            lines = Path(f"/proc/net/{proto}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            (la, lp), (ra, rp) = _hex_addr(f[1]), _hex_addr(f[2])
            out[int(f[9])] = (proto, str(la), lp, str(ra), rp, f[3])
    return out


def sockets_of(pids: list[int]) -> list[tuple[int, tuple]]:
    """(pid, socket row) for every inet socket the processes hold."""
    table = _socket_table()
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                row = table.get(int(target[8:-1]))
                if row:
                    found.append((pid, row))
    return found


def non_loopback_peers(pids: list[int]) -> list[str]:
    """Sockets of ``pids`` connected (or connecting) to an address outside 127.0.0.0/8."""
    bad = []
    for pid, (proto, la, lp, ra, rp, _state) in sockets_of(pids):
        remote = ipaddress.ip_address(ra)
        if remote.is_unspecified:  # listening, or an unconnected UDP socket
            continue
        if remote not in LOOPBACK and remote != ipaddress.ip_address("::1"):
            bad.append(f"pid {pid} {proto} {la}:{lp} -> {ra}:{rp}")
    return bad


def listening_addresses(pids: list[int]) -> set[str]:
    return {
        la for _pid, (proto, la, _lp, ra, _rp, st) in sockets_of(pids)
        if proto.startswith("tcp") and st == "0A"
    }  # fmt: skip
