"""The pieces that keep ``ray up``/``ray down`` off other Ray clusters on a shared host.

``rbln-ray stop-node`` against real process trees (marked, unmarked, daemonised, children),
and the provider's SSH command runner: the exact ``ssh`` argv it hands to the process runner
for Ray's hard-coded ``ray stop`` and ``shutdown``, with the SSH port.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rbln_ray.cluster import node_stop
from rbln_ray.cluster.provider import SharedHostProvider, for_shared_host
from tests.cluster.ray_up_cluster import remove_ssh_control_dir

STOP = 'rbln-ray stop-node --ray-tmpdir "$HOME/rbln-ray/127.0.0.11"'

# A "node": a parent that daemonises a grandchild (reparented away, like `ray start`'s
# raylet) and keeps a child of its own, all started with the marker in their environment.
NODE = r"""
import os, subprocess, sys, time
if os.fork() == 0:                       # daemonise: the grandchild's parent exits
    if os.fork() == 0:
        open(sys.argv[1], "a").write(f"{os.getpid()}\n"); time.sleep(300)
    os._exit(0)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
open(sys.argv[1], "a").write(f"{os.getpid()}\n{child.pid}\n")
time.sleep(300)
"""


def start_node(tmp: Path, marker: str | None) -> tuple[subprocess.Popen, Path]:
    pids = tmp / f"pids-{Path(marker).name if marker else 'none'}-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if k != node_stop.MARKER_ENV}
    if marker is not None:
        env[node_stop.MARKER_ENV] = marker
    proc = subprocess.Popen([sys.executable, "-c", NODE, str(pids)], env=env)
    deadline = time.monotonic() + 30
    while not (pids.exists() and len(pids.read_text().split()) == 3):
        assert time.monotonic() < deadline, "test node did not start"
        time.sleep(0.05)  # polling the pid file with a deadline
    return proc, pids


def alive(pid: int) -> bool:
    info = node_stop._stat(pid)
    return info is not None and info[1] != "Z"


def test_stop_node_stops_exactly_the_marked_node(tmp_path: Path):
    mine, mine_pids = start_node(tmp_path, str(tmp_path / "a"))
    other, other_pids = start_node(tmp_path, str(tmp_path / "b"))  # another cluster's node
    unmarked, unmarked_pids = start_node(tmp_path, None)  # anything else on the host
    try:
        targets = [int(p) for p in mine_pids.read_text().split()]
        assert sorted(node_stop.node_pids(tmp_path / "a")) == sorted(targets)
        assert node_stop.stop_node(tmp_path / "a", grace_s=5) == []
        mine.wait(timeout=10)
        assert not [p for p in targets if alive(p)]
        survivors = [int(p) for f in (other_pids, unmarked_pids) for p in f.read_text().split()]
        assert all(alive(p) for p in survivors)
        assert node_stop.node_pids(tmp_path / "a") == []
        assert node_stop.stop_node(tmp_path / "a") == []  # nothing left: a no-op
    finally:
        for f in (mine_pids, other_pids, unmarked_pids):
            for p in f.read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(p), signal.SIGKILL)
        for proc in (mine, other, unmarked):
            proc.wait(timeout=10)


def test_stop_node_spares_itself_and_its_ancestors(tmp_path: Path, monkeypatch):
    # The stop run from a shell that carries the marker (e.g. an operator's) must not kill
    # that shell or itself.
    monkeypatch.setenv(node_stop.MARKER_ENV, str(tmp_path))
    code = (
        "from rbln_ray.cluster import node_stop; import sys; "
        f"sys.exit(len(node_stop.node_pids({str(tmp_path)!r})))"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ))
    assert proc.returncode == 0


def test_for_shared_host_replaces_only_rays_own_commands():
    assert for_shared_host("ray stop", STOP) == STOP
    stop_exec = "; ".join(
        [
            "python job.py",
            "ray stop",
            "ray teardown ~/ray_bootstrap_config.yaml --yes --workers-only",
            "sudo shutdown -h now",
        ]
    )  # fmt: skip  (commands.exec_cluster with --stop)
    assert for_shared_host(stop_exec, STOP) == (
        f"python job.py; {STOP}; ray teardown ~/ray_bootstrap_config.yaml --yes --workers-only"
    )
    for untouched in ("uptime", "ray status", "echo 'ray stop'", "ray stop --force"):
        assert for_shared_host(untouched, STOP) == untouched
    assert for_shared_host(None, STOP) is None


class Recorder:
    """A process runner (what Ray's command runner calls) that records argv."""

    DEVNULL = subprocess.DEVNULL

    def __init__(self):
        self.calls: list[list[str]] = []

    def check_call(self, cmd, *args, **kwargs):
        self.calls.append(list(cmd))
        return 0

    def check_output(self, cmd, *args, **kwargs):
        self.calls.append(list(cmd))
        return b""


@pytest.fixture
def provider(tmp_path: Path, monkeypatch) -> Iterator[SharedHostProvider]:
    """A provider whose state file (under RAY_TMPDIR) and SSH control dir are this test's."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    config = {
        "type": "external",
        "module": "rbln_ray.cluster.provider.SharedHostProvider",
        "head_ip": "127.0.0.10",
        "worker_ips": ["127.0.0.11", "127.0.0.12"],
        "ssh_port": 2222,
        "node_stop_command": STOP,
        "_rbln_auth": {"ssh_user": "rbln", "ssh_private_key": "~/key"},
    }
    p = SharedHostProvider(config, f"unit-{tmp_path.name}")
    yield p
    remove_ssh_control_dir(p.cluster_name)  # the runner creates /tmp/ray_ssh_<user>/<cluster>


def test_runner_uses_the_port_and_runs_the_scoped_stop(provider: SharedHostProvider):
    p = provider
    rec = Recorder()
    auth = {"ssh_user": "rbln", "ssh_private_key": "~/key"}
    runner = p.get_command_runner("w: ", "127.0.0.11", auth, p.cluster_name, rec, True)
    runner.run("ray stop", ssh_options_override_ssh_key="~/key")
    (argv,) = rec.calls
    assert argv[0] == "ssh" and "Port=2222" in argv
    assert argv[argv.index("-i") + 1] == os.path.expanduser("~/key")  # $HOME, as Ray's ~ means
    assert "rbln@127.0.0.11" in argv
    assert STOP in argv[-1] and "&& (ray stop)" not in argv[-1]
    assert "shutdown" not in argv[-1]


def test_ray_stop_on_the_head_stops_the_workers_first(provider: SharedHostProvider, monkeypatch):
    p = provider
    stopped: list[str] = []
    monkeypatch.setattr(p, "_stop_ray_on", lambda node, auth: stopped.append(node))
    rec = Recorder()
    head = p.get_command_runner("h: ", "127.0.0.10", {"ssh_user": "rbln"}, p.cluster_name,
                                rec, True)  # fmt: skip
    head.run("uptime")
    head.run("uptime; sudo shutdown -h now")  # the shutdown is dropped; nothing is stopped
    assert stopped == []
    assert "shutdown" not in rec.calls[-1][-1]
    head.run("ray stop")
    assert stopped == ["127.0.0.11", "127.0.0.12"]
    assert STOP in rec.calls[-1][-1]


def test_provider_requires_a_stop_command(tmp_path: Path):
    with pytest.raises(ValueError, match="node_stop_command"):
        SharedHostProvider({"head_ip": "127.0.0.10", "worker_ips": []}, "x")
