"""Ray 2.60 internals rbln-ray relies on: where Serve binds a replica's gRPC server, and the
autoscaler's SSH command runner and local node provider.

Why internals: Serve starts, in every replica, a gRPC server for inter-deployment calls bound
to ``[::]:0`` (``ray/serve/_private/replica.py``, ``add_port_to_grpc_server(self._server,
"[::]:0")``) and no option moves it; rbln-ray's single-host mode needs it on loopback
(:func:`rewrite_replica_grpc_bind`). ``ray up`` on hosts shared with other Ray clusters needs
Ray's on-prem node provider without its host-wide ``ray stop``; Ray offers external
providers, but the SSH runner and the local provider they would reuse are private
(:func:`ssh_command_runner_base`, :func:`local_node_provider_base`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rbln_ray.upstream.contract import Requirement, Upstream

UPSTREAM = Upstream("Ray", "ray", "2.60.0")
REPLICA = "ray.serve._private.replica"
RUNNER = "ray.autoscaler._private.command_runner:SSHCommandRunner"
LOCAL = "ray.autoscaler._private.local.node_provider:LocalNodeProvider"
BIND_PY = "rbln_ray/serve/replica_bind.py"
PROVIDER_PY = "rbln_ray/cluster/provider.py"
FLEET_PY = "rbln_ray/serve/fleet_router.py"
COMMON = "ray.serve._private.common"

REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement(f"{REPLICA}:add_port_to_grpc_server", BIND_PY, params=("server", "address")),
    Requirement(f"{REPLICA}:add_port_to_grpc_server", BIND_PY, "called by name"),
    Requirement(f"{REPLICA}:Replica._on_initialized", BIND_PY, "source mentions", ("[::]:0",)),
    Requirement(
        f"{RUNNER}.__init__",
        PROVIDER_PY,
        params=(
            "log_prefix",
            "node_id",
            "provider",
            "auth_config",
            "cluster_name",
            "process_runner",
            "use_internal_ip",
        ),
    ),
    Requirement(
        f"{RUNNER}.run",
        PROVIDER_PY,
        params=("cmd", "timeout", "exit_on_fail"),
    ),
    Requirement(
        f"{RUNNER}.run",
        PROVIDER_PY,
        "source mentions",
        ("ssh_options_override_ssh_key", "shutdown_after_run", "; sudo shutdown -h now"),
    ),
    Requirement(f"{RUNNER}.ssh_options", PROVIDER_PY, "instance attribute"),
    Requirement(
        "ray.autoscaler._private.command_runner:SSHOptions.arg_dict",
        PROVIDER_PY,
        "instance attribute",
    ),
    Requirement(
        "ray.autoscaler._private.command_runner:SSHOptions.ssh_key",
        PROVIDER_PY,
        "instance attribute",
    ),
    Requirement(f"{LOCAL}.__init__", PROVIDER_PY, params=("provider_config", "cluster_name")),
    Requirement(
        f"{LOCAL}.get_command_runner",
        PROVIDER_PY,
        params=(
            "log_prefix",
            "node_id",
            "auth_config",
            "cluster_name",
            "process_runner",
            "use_internal_ip",
            "docker_config",
        ),
    ),
    Requirement(f"{LOCAL}.terminate_node", PROVIDER_PY, params=("node_id",)),
    Requirement(f"{LOCAL}.bootstrap_config", PROVIDER_PY, params=("cluster_config",)),
    Requirement(f"{LOCAL}.prepare_for_head_node", PROVIDER_PY, params=("cluster_config",)),
    # a request router built outside Serve (the fleet simulation): its constructor's ids
    Requirement(f"{COMMON}:DeploymentID", FLEET_PY, params=("name", "app_name")),
    Requirement(f"{COMMON}:DeploymentHandleSource.UNKNOWN", FLEET_PY, "attribute"),
    Requirement(
        "ray.autoscaler._private.commands:exec_cluster",
        f"{PROVIDER_PY} (for_shared_host)",
        "source mentions",
        ('"; ".join', '"ray stop"'),
    ),
)


def rewrite_replica_grpc_bind(rewrite: Callable[[str], str]) -> bool:
    """Make Serve replicas started in this process bind their inter-deployment gRPC server to
    ``rewrite(address)``; False (nothing changed) if Serve's module no longer has the function.
    Idempotent: a second call keeps the first rewrite."""
    from ray.serve._private import replica

    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None:
        return False
    if getattr(original, "rbln_ray_rewrite", False):
        return True

    def add_port_to_grpc_server(server: Any, address: str) -> int:
        return original(server, rewrite(address))

    add_port_to_grpc_server.rbln_ray_rewrite = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = add_port_to_grpc_server
    return True


def router_identity(name: str, app: str) -> tuple[Any, Any]:
    """(deployment id, handle source) a ``RequestRouter`` is constructed with, for a router
    built outside Serve (``rbln_ray.serve.fleet_router``): Serve's own types, private."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    return DeploymentID(name=name, app_name=app), DeploymentHandleSource.UNKNOWN


def ssh_command_runner_base() -> type:
    """Ray's SSH command runner, the base of rbln-ray's shared-host runner."""
    from ray.autoscaler._private.command_runner import SSHCommandRunner

    return SSHCommandRunner


def local_node_provider_base() -> type:
    """Ray's on-prem (fixed hosts) node provider, the base of rbln-ray's shared-host one."""
    from ray.autoscaler._private.local.node_provider import LocalNodeProvider

    return LocalNodeProvider
