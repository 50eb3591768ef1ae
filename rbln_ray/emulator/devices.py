"""Emulated RBLN devices: visibility, per-node ownership locks and a DRAM ledger.

Why: pinning bugs (two engines on one NPU, a worker using a device Ray didn't give it) must
surface in CPU-only tests the way they would on hardware.

Device ids given to ``Runtime(device=...)`` are *logical*: indexes into the devices this
process sees. Without ``RBLN_DEVICES``/``RBLN_VISIBLE_DEVICES`` logical == physical. With
``RBLN_DEVICES=2,3`` (what Ray sets for a worker holding two RBLN), device 0 is physical 2.
This matches Ray's CUDA-style convention and optimum's default ``device=None`` ->
``range(num_devices)``, so an unmodified optimum load inside a Ray worker lands on the
devices Ray assigned. A logical id >= the number of visible devices is an error.

Ownership: one lock file per (node, physical device) under
``<rbln-ray cache>/device-locks/<node>/<id>.lock``, held with ``fcntl.flock``
(released by the kernel when the holder dies) and containing the holder's pid and memory use.
A process may open many runtimes on a device it holds; another live process may not.

Memory: each device has the DRAM budget of its kind (:mod:`rbln_ray.npu.kinds`:
ATOM 16 GiB - 288 MiB; REBEL 4 chiplets x (36 GiB - 1 GiB)). Charges are split evenly over a
device's chiplets and each chiplet is checked against its own budget, as optimum-rbln does
when it sizes the KV cache.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from rbln_ray.common import envs
from rbln_ray.common.paths import cache_root
from rbln_ray.npu import kinds

logger = logging.getLogger(__name__)

VISIBLE_ENVS = ("RBLN_DEVICES", "RBLN_VISIBLE_DEVICES")


class DeviceError(RuntimeError):
    """A device is not visible, does not exist, or is held by another process."""


def physical_count() -> int:
    """Emulated devices per node (``RBLN_RAY_EMULATED_DEVICES``, default 4)."""
    return int(envs.get("RBLN_RAY_EMULATED_DEVICES"))


def node_id() -> str:
    """The node the emulated devices belong to: the Ray node, else env, else ``local``.

    Ray's node id comes first: several raylets on one machine (multi-node tests) each own
    devices 0..N-1, and their worker processes may all inherit one ``RBLN_RAY_NODE_ID``.
    """
    ray = sys.modules.get("ray")
    if ray is not None:
        try:
            if ray.is_initialized():
                return str(ray.get_runtime_context().get_node_id())
        except Exception:  # noqa: BLE001 - a half-initialised Ray must not break device lookup
            logger.debug("could not read the Ray node id", exc_info=True)
    return envs.get("RBLN_RAY_NODE_ID") or "local"


def _visible_spec() -> tuple[str, str] | None:
    for env in VISIBLE_ENVS:
        value = os.environ.get(env)
        if value is not None:
            return env, value
    return None


def visible_physical_ids() -> list[int]:
    """Physical ids this process may use, in logical order."""
    total = physical_count()
    spec = _visible_spec()
    if spec is None:
        return list(range(total))
    env, value = spec
    ids = []
    for item in (s.strip() for s in value.split(",")):
        if not item:
            continue
        if not re.fullmatch(r"\d+", item) or int(item) >= total:
            logger.warning(
                "%s lists %r, which is not an emulated device (0..%d)", env, item, total - 1
            )
            continue
        ids.append(int(item))
    return ids


def to_physical(logical: int) -> int:
    """Map a logical device id to a physical one, or raise naming the visible set."""
    visible = visible_physical_ids()
    if 0 <= logical < len(visible):
        return visible[logical]
    spec = _visible_spec()
    emulated = f"{physical_count()} emulated devices (RBLN_RAY_EMULATED_DEVICES)"
    why = f"{spec[0]}={spec[1]!r} of {emulated}" if spec else emulated
    raise DeviceError(
        f"RBLN device {logical} is not visible to process {os.getpid()} on node {node_id()!r}: "
        f"{why} -> visible physical devices {visible}"
    )


def lock_dir(node: str | None = None) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", node or node_id())
    return cache_root() / "device-locks" / safe


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class _Held:
    fd: int
    pid: int
    refs: int
    used: dict[str, list[int]]  # owner -> bytes per chiplet
    kind: kinds.DeviceKind

    def chiplet_use(self) -> list[int]:
        return [sum(per[i] for per in self.used.values()) for i in range(self.kind.chiplets)]

    def total(self) -> int:
        return sum(sum(per) for per in self.used.values())


class _Ledger:
    """This process's device locks and memory use, keyed by (node, physical id)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[str, int], _Held] = {}

    def acquire(self, physical: int) -> tuple[str, int]:
        key = (node_id(), physical)
        with self._lock:
            held = self._held.get(key)
            if held is not None and held.pid == os.getpid():
                held.refs += 1
                return key
            path = lock_dir(key[0]) / f"{physical}.lock"
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_info(path).get("pid", "unknown")
                os.close(fd)
                raise DeviceError(
                    f"RBLN device {physical} on node {key[0]!r} is held by process {owner}; "
                    f"process {os.getpid()} cannot open a runtime on it (one process per device)"
                ) from None
            self._held[key] = _Held(fd=fd, pid=os.getpid(), refs=1, used={}, kind=kinds.current())
            self._write(key)
            return key

    def release(self, key: tuple[str, int], owner: str | None = None) -> None:
        with self._lock:
            held = self._held.get(key)
            if held is None or held.pid != os.getpid():
                return
            if owner is not None:
                held.used.pop(owner, None)
            held.refs -= 1
            if held.refs > 0:
                self._write(key)
                return
            del self._held[key]
            try:
                os.ftruncate(held.fd, 0)
                fcntl.flock(held.fd, fcntl.LOCK_UN)
            finally:
                os.close(held.fd)

    def held_devices(self) -> list[tuple[str, int]]:
        """(node, physical id) of the devices this process holds now."""
        with self._lock:
            return [key for key, held in self._held.items() if held.pid == os.getpid()]

    def charge(self, key: tuple[str, int], owner: str, nbytes: int, what: str) -> None:
        """Charge ``nbytes`` to ``owner`` on a held device, split evenly over its chiplets;
        fail like the NPU when a chiplet's DRAM runs out."""
        with self._lock:
            held = self._held[key]
            kind = held.kind
            share = -(-nbytes // kind.chiplets)
            for chiplet, used in enumerate(held.chiplet_use()):
                if used + share > kind.chiplet_budget:
                    where = f", chiplet {chiplet}" if kind.chiplets > 1 else ""
                    free_mib = (kind.chiplet_budget - used) / 2**20
                    raise RuntimeError(
                        f"Lack of device memory: {what} needs {share / 2**20:.1f} MiB on RBLN "
                        f"device {key[1]} ({kind.npu_name}, node {key[0]!r}{where}) but only "
                        f"{free_mib:.1f} MiB of {kind.chiplet_budget / 2**20:.0f} MiB is free"
                    )
            per = held.used.setdefault(owner, [0] * kind.chiplets)
            for chiplet in range(kind.chiplets):
                per[chiplet] += share
            self._write(key)

    def _write(self, key: tuple[str, int]) -> None:
        held = self._held[key]
        info = {
            "pid": held.pid,
            "node": key[0],
            "device": key[1],
            "npu": held.kind.npu_name,
            "used": held.total(),
        }
        data = json.dumps(info).encode()
        os.ftruncate(held.fd, 0)
        os.pwrite(held.fd, data, 0)


LEDGER = _Ledger()


def _read_info(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _is_locked(path: Path) -> bool:
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops our probe lock too
    return False


@dataclass(frozen=True)
class DeviceInfo:
    """One row of ``rbln-ray devices``."""

    id: int
    name: str
    memory_used: int
    memory_total: int
    pid: int | None
    node: str
    visible: bool


def list_devices(node: str | None = None) -> list[DeviceInfo]:
    """Every emulated device of ``node`` (default: this node) with its holder and memory use.

    Devices are of this process's kind (``RBLN_RAY_EMULATED_NPU``); the kind a holder
    reported in its lock file wins for a device in use.
    """
    node = node or node_id()
    visible = set(visible_physical_ids())
    kind = kinds.current()
    rows = []
    for physical in range(physical_count()):
        path = lock_dir(node) / f"{physical}.lock"
        held = LEDGER._held.get((node, physical))
        name, total = kind.npu_name, kind.dram_total
        if held is not None and held.pid == os.getpid():
            pid, used = held.pid, held.total()
            name, total = held.kind.npu_name, held.kind.dram_total
        elif _is_locked(path):
            info = _read_info(path)
            pid, used = info.get("pid"), int(info.get("used", 0))
            pid = pid if isinstance(pid, int) and _pid_alive(pid) else None
            if info.get("npu"):
                held_kind = kinds.kind_by_name(str(info["npu"]))
                name, total = held_kind.npu_name, held_kind.dram_total
        else:
            pid, used = None, 0
        rows.append(DeviceInfo(physical, name, used, total, pid, node, physical in visible))
    return rows
