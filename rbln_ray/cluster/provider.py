"""Ray's on-prem ``local`` node provider for hosts that may also run other Ray clusters.

In a ``ray up`` config (see ``cluster_configs/ray-up-*.yaml``)::

    provider:
      type: external
      module: rbln_ray.cluster.provider.SharedHostProvider
      head_ip: 10.0.0.10
      worker_ips: [10.0.0.11, 10.0.0.12]
      ssh_port: 22                               # optional (default 22)
      node_stop_command: rbln-ray stop-node --ray-tmpdir "$HOME/rbln-ray/<address>"

Everything else is Ray's ``LocalNodeProvider`` (fixed hosts, one raylet each, no cloud API).
What it changes, and why (read from Ray 2.60's ``autoscaler/_private``):

* **No host-wide ``ray stop``.** ``ray down`` runs ``ray stop`` on the head
  (``commands.teardown_cluster``), ``ray kill-random-node`` on a node, ``ray exec --stop``
  appends ``ray stop`` and ``sudo shutdown -h now``. ``ray stop`` kills every Ray process on
  the host, other clusters' included. This provider's command runner runs
  ``node_stop_command`` in its place (which must stop only this cluster's node on the host) and
  drops the shutdown.
* **Workers are stopped on ``ray down``.** The stock provider's ``terminate_node`` only marks a
  node terminated in its state file, so worker raylets keep running until they lose the GCS.
  Here ``terminate_node`` first runs ``node_stop_command`` on the node over SSH (a failure is
  logged and the node is still marked terminated), and a Ray-issued ``ray stop`` on the head
  first stops every worker: a raylet stops within a second while its GCS is up but hangs on
  SIGTERM once the GCS is gone, and a GCS waits for the raylets still attached (BENCHMARKS
  §10).
* **SSH port.** Ray's SSH runner has no port setting, and ``auth.ssh_proxy_command`` is dropped
  from the config the head uses to reach the workers (``commands._set_up_config_for_head_node``),
  so a proxy command cannot carry one; ``ssh_port`` is passed as ``-o Port=...`` on every
  ``ssh`` and ``rsync`` Ray runs, from the launcher and from the head.

With ``type: external`` the node types and a few defaults ``type: local`` fills in itself are
written out in the config (``available_node_types``, ``cluster_synced_files``, ...).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from typing import Any

from rbln_ray.upstream.ray_internals import local_node_provider_base, ssh_command_runner_base

logger = logging.getLogger(__name__)
# Ray's private on-prem classes (rbln_ray.upstream.ray_internals guards what is used of them).
SSHCommandRunner = ssh_command_runner_base()
LocalNodeProvider = local_node_provider_base()

RAY_STOP = "ray stop"
SHUTDOWN = "sudo shutdown -h now"
AUTH_KEY = "_rbln_auth"  # the cluster's `auth` section, copied in by bootstrap_config
REQUIRED = ("head_ip", "worker_ips", "node_stop_command")


def for_shared_host(cmd: str | None, node_stop_command: str) -> str | None:
    """``cmd`` with Ray's hard-coded host-wide commands replaced (see module docstring).

    Ray joins the commands it adds with ``"; "`` (``exec_cluster``, ``shutdown_after_run``),
    so each ``"; "``-separated part equal to ``ray stop`` becomes ``node_stop_command`` and
    each ``sudo shutdown -h now`` is dropped; anything else is left as it is.
    """
    if cmd is None:
        return None
    parts = []
    for part in cmd.split("; "):
        if part.strip() == RAY_STOP:
            logger.info("running the cluster-scoped %r instead of `ray stop`", node_stop_command)
            parts.append(node_stop_command)
        elif part.strip() == SHUTDOWN:
            logger.warning("not shutting down a host other Ray clusters may share")
        else:
            parts.append(part)
    return "; ".join(parts)


class SharedHostSSHCommandRunner(SSHCommandRunner):
    """Ray's SSH runner with a port and the command rewriting of :func:`for_shared_host`."""

    def __init__(
        self,
        ssh_port: int,
        node_stop_command: str,
        before_stop: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.before_stop = before_stop
        # SSHOptions renders every arg_dict entry as `-o key=value` for ssh and rsync's --rsh.
        self.ssh_options.arg_dict["Port"] = int(ssh_port)
        # ssh expands `~` in `-i` from the passwd entry, not $HOME; Ray's head config names
        # its key `~/ray_bootstrap_key.pem`, written under $HOME. Same path wherever they agree.
        if self.ssh_options.ssh_key:
            self.ssh_options.ssh_key = os.path.expanduser(self.ssh_options.ssh_key)
        self.node_stop_command = node_stop_command

    def run(self, cmd: str | None = None, *args: Any, **kwargs: Any) -> Any:
        # Ray passes the config's own key again for initialization_commands; honouring it would
        # build fresh SSHOptions without the port. It is the key self.ssh_options already uses.
        kwargs.pop("ssh_options_override_ssh_key", None)
        if kwargs.pop("shutdown_after_run", False):
            logger.warning("not shutting down a host other Ray clusters may share")
        stops = cmd is not None and RAY_STOP in (p.strip() for p in cmd.split("; "))
        if stops and self.before_stop is not None:
            self.before_stop()
        return super().run(for_shared_host(cmd, self.node_stop_command), *args, **kwargs)


class SharedHostProvider(LocalNodeProvider):
    """``LocalNodeProvider`` plus ``ssh_port`` and ``node_stop_command`` (module docstring)."""

    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        if not provider_config.get("node_stop_command"):
            raise ValueError(
                "provider.node_stop_command is required: the command that stops this "
                "cluster's Ray node on a host (e.g. rbln-ray stop-node --ray-tmpdir DIR)"
            )
        super().__init__(provider_config, cluster_name)

    @property
    def ssh_port(self) -> int:
        return int(self.provider_config.get("ssh_port", 22))

    @property
    def node_stop_command(self) -> str:
        return str(self.provider_config["node_stop_command"])

    def get_command_runner(
        self,
        log_prefix: str,
        node_id: str,
        auth_config: dict[str, Any],
        cluster_name: str,
        process_runner: Any,
        use_internal_ip: bool,
        docker_config: dict[str, Any] | None = None,
    ) -> SharedHostSSHCommandRunner:
        if docker_config and docker_config.get("container_name"):
            raise ValueError(f"{type(self).__name__} does not run nodes in Docker containers")
        is_head = node_id == self.provider_config.get("head_ip")
        return SharedHostSSHCommandRunner(
            ssh_port=self.ssh_port,
            node_stop_command=self.node_stop_command,
            before_stop=self.stop_workers if is_head else None,
            log_prefix=log_prefix,
            node_id=node_id,
            provider=self,
            auth_config=auth_config,
            cluster_name=cluster_name,
            process_runner=process_runner,
            use_internal_ip=use_internal_ip,
        )

    def stop_workers(self) -> None:
        """Stop this cluster's Ray on every worker: what stopping the head (its GCS) ends
        anyway, done first because a raylet stops within a second while its GCS is up and
        hangs on SIGTERM once it is gone (and a GCS waits for raylets still attached)."""
        auth = self.provider_config.get(AUTH_KEY)
        if auth is None:
            logger.warning("no auth config to reach the workers; stopping the head only")
            return
        for worker in self.provider_config.get("worker_ips", []):
            self._stop_ray_on(worker, auth)

    def terminate_node(self, node_id: str) -> None:
        """Stop this cluster's Ray on the node, then mark it terminated (as Ray's provider)."""
        auth = self.provider_config.get(AUTH_KEY)
        if auth is None:
            logger.warning("no auth config to reach %s; only marking it terminated", node_id)
        else:
            self._stop_ray_on(node_id, auth)
        super().terminate_node(node_id)

    def _stop_ray_on(self, node_id: str, auth: dict[str, Any]) -> None:
        import subprocess

        runner = self.get_command_runner(
            log_prefix=f"{node_id}: ",
            node_id=node_id,
            auth_config=auth,
            cluster_name=self.cluster_name,
            process_runner=subprocess,
            use_internal_ip=True,
        )
        try:
            runner.run(self.node_stop_command, timeout=60, exit_on_fail=False)
        except Exception as e:  # noqa: BLE001 - teardown goes on; the node may be gone already
            logger.warning("could not stop Ray on %s (%s); marking it terminated", node_id, e)

    @staticmethod
    def bootstrap_config(cluster_config: dict[str, Any]) -> dict[str, Any]:
        """Check the provider section (``ray up`` calls this before touching any host) and keep
        a copy of ``auth`` with it: ``terminate_node`` needs SSH."""
        provider = cluster_config.get("provider", {})
        missing = [k for k in REQUIRED if not provider.get(k)]
        if missing:
            raise ValueError(f"provider ({provider.get('module')}) needs {', '.join(missing)}")
        config = copy.deepcopy(LocalNodeProvider.bootstrap_config(cluster_config))
        config["provider"][AUTH_KEY] = copy.deepcopy(config.get("auth", {}))
        return config

    def prepare_for_head_node(self, cluster_config: dict[str, Any]) -> dict[str, Any]:
        """The head reaches workers with the key ``ray up`` copied there: keep the copy in step."""
        config = copy.deepcopy(super().prepare_for_head_node(cluster_config))
        config["provider"][AUTH_KEY] = copy.deepcopy(config.get("auth", {}))
        return config
