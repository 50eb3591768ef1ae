"""One place that makes rbln-ray's log lines visible, in vLLM's format.

Why: rbln-ray runs inside vLLM's processes (driver, spawned engine core, Ray actors), where
nobody configures the ``rbln_ray`` logger; without a handler its INFO lines (compiling,
device pinning, config overrides) would vanish.
"""

from __future__ import annotations

import logging

from rbln_ray.common import envs

FORMAT = "%(levelname)s %(asctime)s [rbln_ray %(filename)s:%(lineno)d] %(message)s"


def setup_logging() -> None:
    """Attach a stderr handler to the ``rbln_ray`` logger once (level ``RBLN_RAY_LOG_LEVEL``)."""
    logger = logging.getLogger("rbln_ray")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(envs.get("RBLN_RAY_LOG_LEVEL"))
    logger.propagate = False
