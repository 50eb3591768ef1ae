"""Finding the Ray cluster from vLLM's engine-core process.

Why: vLLM builds its config in the driver and then starts the engine core (where the executor
lives) in a fresh process. A Ray connection is per process and is not inherited, and plain
``ray.init()`` in the engine core would connect to whatever ``/tmp/ray/ray_current_cluster``
names or start a private Ray instance with no RBLN nodes. So the driver records the address of
the cluster it is connected to (``remember_driver_cluster``, called by the platform's config
hook before the engine core starts) and the executor connects to exactly that one.

Resolution order in the engine core (``connect``):

1. Ray already initialised in this process (in-process engine core, or a Serve replica): use it.
2. ``additional_config["rbln_ray_address"]``: recorded by the driver.
3. ``RAY_ADDRESS``: set by the user, or exported by vLLM when the driver is a Ray actor.
4. ``ray.init()``'s own discovery: a cluster started with ``ray start`` on this machine, else a
   new local Ray instance (a single-machine deployment needs no cluster set up first).

This module imports nothing heavy, so the platform hook can call it cheaply.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

RAY_ADDRESS_KEY = "rbln_ray_address"
DRIVER_PID_KEY = "rbln_ray_driver_pid"
# Env vars a worker actor needs to select and configure the same RBLN runtime as the driver.
FORWARDED_ENV = (
    "RBLN_RAY_DEVICE",
    "RBLN_RAY_EMULATED_DEVICES",
    "RBLN_RAY_CACHE",
    "PYTHONPATH",
    "OMP_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",
)


def _extra(vllm_config: VllmConfig) -> dict[str, Any]:
    extra = vllm_config.additional_config
    if not isinstance(extra, dict):
        raise ValueError("additional_config must be a dict for the RBLN Ray executor")
    return extra


def remember_driver_cluster(vllm_config: VllmConfig) -> None:
    """Record the driver's Ray address in the config, before vLLM starts its engine core.

    Idempotent and a no-op when this process has no Ray connection (the engine core then
    falls back to ``RAY_ADDRESS`` / discovery). Does not import Ray.

    Also makes vLLM *spawn* its engine core: a forked child inherits a Ray client whose
    connections belong to the parent (``ray.is_initialized()`` is true there, but calls hang).
    """
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    extra = _extra(vllm_config)
    if RAY_ADDRESS_KEY not in extra:
        extra[RAY_ADDRESS_KEY] = ray.get_runtime_context().gcs_address
        extra[DRIVER_PID_KEY] = os.getpid()
        logger.info("RBLN Ray executor will use the driver's cluster %s", extra[RAY_ADDRESS_KEY])
    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") != "spawn":
        logger.info("VLLM_WORKER_MULTIPROC_METHOD=spawn: this driver is connected to Ray")
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"


def connect(vllm_config: VllmConfig) -> None:
    """Connect this process to the cluster (see the module docstring for the order)."""
    import ray

    extra = _extra(vllm_config)
    if ray.is_initialized():
        driver_pid = extra.get(DRIVER_PID_KEY)
        if driver_pid is not None and driver_pid != os.getpid() and RAY_ADDRESS_KEY in extra:
            raise RuntimeError(
                f"this engine process ({os.getpid()}) was forked from the Ray driver "
                f"({driver_pid}) and inherited its unusable Ray client; set "
                "VLLM_WORKER_MULTIPROC_METHOD=spawn"
            )
        return
    address = extra.get(RAY_ADDRESS_KEY) or os.environ.get("RAY_ADDRESS")
    runtime_env = vllm_config.parallel_config.ray_runtime_env
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    logger.info("connecting to Ray at %s", address or "<auto-detected or new local instance>")
    ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)


def worker_env() -> dict[str, str]:
    """Env vars for worker actors so the RBLN runtime (or its emulator) activates in them."""
    return {name: os.environ[name] for name in FORWARDED_ENV if name in os.environ}
