"""Finding the Ray cluster from vLLM's engine-core process.

Why: vLLM builds its config in the driver and then starts the engine core (where the executor
lives) in a fresh process. A Ray connection is per process and is not inherited, and plain
``ray.init()`` in the engine core would connect to whatever ``/tmp/ray/ray_current_cluster``
names or start a private Ray instance with no RBLN nodes. So the driver records the address of
the cluster it is connected to (:mod:`rbln_ray.vllm_plugin.driver_cluster`, called by the
platform's config hook before the engine core starts) and the executor connects to exactly
that one.

Resolution order in the engine core (``connect``):

1. Ray already initialised in this process (in-process engine core, or a Serve replica): use it.
2. the driver's cluster, recorded by the driver (``EngineDecisions.ray_address``).
3. ``RAY_ADDRESS``: set by the user, or exported by vLLM when the driver is a Ray actor.
4. ``ray.init()``'s own discovery: a cluster started with ``ray start`` on this machine, else a
   new local Ray instance (a single-machine deployment needs no cluster set up first).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from rbln_ray.common import envs
from rbln_ray.vllm_plugin.options import engine_decisions

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

# Beyond rbln-ray's own (envs.FORWARDED): what a worker's Python and threads need.
FORWARDED_ENV = (*envs.FORWARDED, "PYTHONPATH", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")


def connect(vllm_config: VllmConfig) -> None:
    """Connect this process to the cluster (see the module docstring for the order)."""
    import ray

    decided = engine_decisions(vllm_config)
    if ray.is_initialized():
        driver_pid = decided.driver_pid
        if driver_pid is not None and driver_pid != os.getpid() and decided.ray_address:
            raise RuntimeError(
                f"this engine process ({os.getpid()}) was forked from the Ray driver "
                f"({driver_pid}) and inherited its unusable Ray client; set "
                "VLLM_WORKER_MULTIPROC_METHOD=spawn"
            )
        return
    address = decided.ray_address or os.environ.get("RAY_ADDRESS")
    runtime_env = vllm_config.parallel_config.ray_runtime_env
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    logger.info("connecting to Ray at %s", address or "<auto-detected or new local instance>")
    ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)


def worker_env() -> dict[str, str]:
    """Env vars for worker actors so the RBLN runtime (or its emulator) activates in them."""
    return {name: os.environ[name] for name in FORWARDED_ENV if name in os.environ}
