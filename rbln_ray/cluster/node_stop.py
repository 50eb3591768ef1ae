"""Stop one Ray node of one cluster on this host and leave every other Ray process alone.

Why: ``ray stop`` kills every process on the host whose name looks like Ray's (raylet,
gcs_server, dashboard, ...), whoever started it. On a host that also runs other Ray clusters
(a shared server, or several "hosts" of a test cluster on one machine) that takes them all
down. rbln-ray's ``ray up`` configs start every node with ``RAY_TMPDIR=<dir>`` exported in the
environment of ``ray start``; every process of that node inherits it (raylet, GCS, dashboard
and its agents, the Ray client server, every worker and the vLLM engine processes they spawn).
This module stops exactly the processes whose environment carries that value, plus their
descendants, never itself or its ancestors.

    rbln-ray stop-node --ray-tmpdir ~/rbln-ray/10.0.0.11
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path

logger = logging.getLogger(__name__)

MARKER_ENV = "RAY_TMPDIR"
POLL_S = 0.2


def _stat(pid: int) -> tuple[int, str] | None:
    """(ppid, state) of ``pid``, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = stat[stat.rfind(")") + 2 :].split()  # comm may contain spaces and parentheses
    return int(rest[1]), rest[0]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _environ_value(pid: int, name: str) -> str | None:
    """``name`` in the environment ``pid`` was started with (None if unreadable or unset)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or another user's process: not ours to stop
        return None
    prefix = name.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    return None


def _live_pids() -> dict[int, int]:
    """pid -> ppid of every live (non-zombie) process."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _stat(int(entry))) and info[1] != "Z":
            table[int(entry)] = info[0]
    return table


def _ancestors(pid: int) -> set[int]:
    out = set()
    while pid > 1 and (info := _stat(pid)):
        out.add(pid)
        pid = info[0]
    return out


def _marked(ray_tmpdir: str | os.PathLike, table: dict[int, int]) -> set[int]:
    want = os.path.normpath(os.path.expanduser(str(ray_tmpdir)))
    return {
        pid
        for pid in table
        if (value := _environ_value(pid, MARKER_ENV)) and os.path.normpath(value) == want
    }


def node_pids(ray_tmpdir: str | os.PathLike) -> list[int]:
    """Live processes started with ``RAY_TMPDIR=ray_tmpdir``, and all their descendants."""
    table = _live_pids()
    children: dict[int, list[int]] = {}
    for pid, ppid in table.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = set(), list(_marked(ray_tmpdir, table))
    while stack:
        pid = stack.pop()
        if pid in found:
            continue
        found.add(pid)
        stack.extend(children.get(pid, []))
    return sorted(found - _ancestors(os.getpid()))


def _daemons(pids: list[int]) -> list[list[int]]:
    """The processes ``ray start`` left running (those whose parent is not one of ``pids``),
    in ``ray stop``'s order: raylet first (it ends its workers and agents), then the others,
    the GCS last (the others report to it while they exit)."""
    table = _live_pids()
    roots = [p for p in pids if table.get(p) not in pids]
    first = [p for p in roots if _comm(p) == "raylet"]
    last = [p for p in roots if _comm(p) == "gcs_server"]
    rest = [p for p in roots if p not in first and p not in last]
    return [b for b in (first, rest, last) if b]


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if (info := _stat(p)) and info[1] != "Z"]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(POLL_S)  # polling the processes' state, with a deadline


def stop_node(ray_tmpdir: str | os.PathLike, grace_s: float = 15.0) -> list[int]:
    """Stop the node as ``ray stop`` would, then whatever outlived it; return survivors.

    SIGTERM to the node's daemons bucket by bucket (each bucket waited for up to ``grace_s``),
    then SIGTERM and, after a few seconds, SIGKILL to any process of the node still alive
    (e.g. a vLLM engine whose replica died). Survivors outlived SIGKILL too.
    """
    pids = node_pids(ray_tmpdir)
    if not pids:
        logger.info("no Ray process with %s=%s on this host", MARKER_ENV, ray_tmpdir)
        return []
    logger.info("stopping %d process(es) with %s=%s", len(pids), MARKER_ENV, ray_tmpdir)
    for bucket in _daemons(pids):
        _signal_all(bucket, signal.SIGTERM)
        if left := _wait_gone(bucket, grace_s):
            logger.info("SIGKILL to %s after %g s", sorted({_comm(p) for p in left}), grace_s)
            _signal_all(left, signal.SIGKILL)
    # Children that did not go with their parents, and any started while we waited.
    alive = node_pids(ray_tmpdir)
    if alive:
        _signal_all(alive, signal.SIGTERM)
        alive = _wait_gone(alive, min(grace_s, 5.0))
    if alive:
        logger.info("SIGKILL to %d leftover process(es): %s", len(alive),
                    sorted({_comm(p) for p in alive}))  # fmt: skip
        _signal_all(alive, signal.SIGKILL)
        alive = _wait_gone(alive, 10.0)
    if alive:
        logger.warning("still alive after SIGKILL: %s", alive)
    return alive


def add_arguments(parser) -> None:
    parser.add_argument(
        "--ray-tmpdir",
        required=True,
        help=f"the {MARKER_ENV} this node's `ray start` ran with (e.g. ~/rbln-ray/10.0.0.11)",
    )
    parser.add_argument(
        "--grace-period", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL"
    )


def run(args) -> int:
    """CLI: exit 0 when nothing of the node is left, 1 otherwise."""
    return 1 if stop_node(args.ray_tmpdir, args.grace_period) else 0
