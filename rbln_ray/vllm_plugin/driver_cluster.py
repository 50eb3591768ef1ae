"""The driver's side of finding the Ray cluster from vLLM's engine-core process.

Why: vLLM builds its config in the driver and then starts the engine core (where the executor
lives) in a fresh process. A Ray connection is per process and is not inherited, so the driver
records the address of the cluster it is connected to in the engine config before the engine
core starts, and the executor (:mod:`rbln_ray.executor.cluster`) connects to exactly that one.
Called from the platform's config hook, so it must stay cheap: it never imports Ray.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

from rbln_ray.vllm_plugin.options import decide, engine_decisions

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


def remember_driver_cluster(vllm_config: VllmConfig) -> None:
    """Record the driver's Ray address in the config, before vLLM starts its engine core.

    Idempotent and a no-op when this process has no Ray connection (the engine core then
    falls back to ``RAY_ADDRESS`` / discovery).

    Also makes vLLM *spawn* its engine core: a forked child inherits a Ray client whose
    connections belong to the parent (``ray.is_initialized()`` is true there, but calls hang).
    """
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    if engine_decisions(vllm_config).ray_address is None:
        address = ray.get_runtime_context().gcs_address
        decide(vllm_config, ray_address=address, driver_pid=os.getpid())
        logger.info("RBLN Ray executor will use the driver's cluster %s", address)
    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") != "spawn":
        logger.info("VLLM_WORKER_MULTIPROC_METHOD=spawn: this driver is connected to Ray")
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
