"""The Ray instance ``rbln-ray serve`` starts on this host: every socket on 127.0.0.1.

Why: a plain ``ray.init()`` on Linux listens on all interfaces with GCS, raylet, object
manager, every core worker (driver and each actor), the dashboard agent and the metrics
exporters (docs/OPERATIONS.md, "Ports"), so anyone who can reach the host could join
the cluster and run code in it. Serve's HTTP port on 127.0.0.1 does not help.

What decides it in Ray 2.60:

* The C++ servers (GCS, raylet, object manager, core workers) bind 127.0.0.1 only when the
  node's IP *is* 127.0.0.1, else the wildcard address; the dashboard, its agent, the runtime
  env agent and the metrics exporters bind the node IP. So everything follows the node IP.
* ``ray.init(_node_ip_address="127.0.0.1")`` alone does not give that node IP: Ray rewrites
  a loopback address to the host's routable one (``services.resolve_ip_for_localhost``),
  except in Ray's single-host mode, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (its default on
  macOS and Windows, where Ray keeps to loopback to avoid firewall prompts). Ray reads that
  variable once, when ``ray`` is imported, in every process; the raylet passes the
  environment on to every worker and agent, and vLLM's engine-core processes inherit it from
  their replica, so the whole process tree agrees on 127.0.0.1.
* The dashboard's HTTP server follows ``dashboard_host`` (127.0.0.1 here as well).

The price: no other host can reach, hence join, this instance. Multi-host clusters are
started with ``ray up`` or KubeRay (``cluster_configs/``, with Ray's token authentication)
and joined with ``--address``.

Ray 2.60 also turns its token authentication on for every new local instance unless
``RAY_AUTH_MODE`` says otherwise (token in ``~/.ray/auth_token``), but a driver given an
explicit address does not turn it on by itself; so the record of the embedded default says
which mode it runs in and :func:`prepare_to_join` puts a joining driver in the same one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# Ray's metrics export of the embedded default (Ray's documented `ray start` example port).
METRICS_EXPORT_PORT = 8080
SINGLE_HOST_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
AUTH_MODE_ENV = "RAY_AUTH_MODE"  # Ray reads both when it is imported
AUTH_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"


EMBEDDED_FILE = "embedded-ray.json"  # in rbln-ray's cache dir: the running embedded default


class LoopbackError(RuntimeError):
    """The local Ray instance could not be kept on the loopback interface."""


def embedded_record_path() -> Path:
    from rbln_ray.common.paths import cache_dir

    return cache_dir() / EMBEDDED_FILE


def record_embedded(gcs_address: str) -> Path:
    """Say where this host's embedded default runs (its GCS address and this process), so a
    driver started later on the host (``RBLNClient``) joins it without being told."""
    path = embedded_record_path()
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    record = {
        "gcs_address": gcs_address,
        "pid": os.getpid(),
        # where the token is, never the token itself
        "auth_mode": os.environ.get(AUTH_MODE_ENV, "disabled"),
        "token_path": os.environ.get(AUTH_TOKEN_PATH_ENV),
    }
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    return path


def forget_embedded() -> None:
    path = embedded_record_path()
    with contextlib.suppress(FileNotFoundError, ValueError, OSError):
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


def embedded_record() -> dict | None:
    """The record of this host's running embedded default, or None."""
    try:
        found = json.loads(embedded_record_path().read_text())
        os.kill(int(found["pid"]), 0)  # still running
        str(found["gcs_address"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return found


def embedded_address() -> str | None:
    """The GCS address of this host's running embedded default, or None."""
    found = embedded_record()
    return str(found["gcs_address"]) if found else None


def prepare_to_join(address: str) -> None:
    """Before this process joins the Ray instance at ``address``: a loopback address is an
    embedded default in single-host mode, which a driver reaches only in that mode too (Ray
    reads it when imported; without it the driver looks for a routable address and hangs),
    and with the embedded default's authentication mode."""
    if address.split(":")[0] != LOOPBACK:
        return
    prepare_loopback()
    found = embedded_record()
    if found and found["gcs_address"] == address and AUTH_MODE_ENV not in os.environ:
        if "ray" in sys.modules and found.get("auth_mode") != "disabled":
            raise LoopbackError(
                "ray was imported before rbln-ray could select the embedded default's "
                f"authentication; set {AUTH_MODE_ENV}={found['auth_mode']} in the environment"
            )
        os.environ[AUTH_MODE_ENV] = str(found.get("auth_mode", "disabled"))
        if found.get("token_path"):
            os.environ.setdefault(AUTH_TOKEN_PATH_ENV, str(found["token_path"]))


def prepare_loopback() -> None:
    """Put this process (and every process it starts) in Ray's single-host mode.

    Must run before ``ray`` is imported here: Ray reads the variable at import.
    """
    if "ray" in sys.modules and os.environ.get(SINGLE_HOST_ENV) != "0":
        raise LoopbackError(
            "ray was imported before rbln-ray could select Ray's single-host mode; "
            f"set {SINGLE_HOST_ENV}=0 in the environment"
        )
    os.environ[SINGLE_HOST_ENV] = "0"


def start_loopback_ray(
    num_cpus: int, resources: dict[str, float] | None, metrics_port: int | None = None
) -> None:
    """Start a new local Ray instance whose every listening socket is on 127.0.0.1; its
    metrics export (Prometheus text of every process's Ray metrics: vLLM's engine metrics,
    rbln-ray's device counters) on ``metrics_port`` (None: a free port Ray picks)."""
    prepare_loopback()
    import ray

    ray.init(
        address="local",
        num_cpus=num_cpus,
        resources=resources,
        _node_ip_address=LOOPBACK,
        dashboard_host=LOOPBACK,
        _metrics_export_port=metrics_port,
    )
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:  # the checks above make this unreachable; never serve exposed
        ray.shutdown()
        raise LoopbackError(f"the local Ray node came up on {node_ip}, not {LOOPBACK}")
    gcs = ray.get_runtime_context().gcs_address
    logger.info("local Ray instance listening on %s only (GCS %s)", LOOPBACK, gcs)
