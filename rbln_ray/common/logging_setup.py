"""One place that makes rbln-ray's log lines visible, in vLLM's format, and keeps them quiet.

Why: rbln-ray runs inside vLLM's processes (driver, spawned engine core, Ray actors), where
nobody configures the ``rbln_ray`` logger; without a handler its INFO lines (compiling,
device pinning, config overrides) would vanish. The level travels to every process the project
starts through ``RBLN_RAY_LOG_LEVEL`` (children inherit the environment), so
``rbln-ray serve --log-level warning`` quiets replicas and workers too.
"""

from __future__ import annotations

import logging
import os

from rbln_ray.common import envs

FORMAT = "%(levelname)s %(asctime)s [rbln_ray %(filename)s:%(lineno)d] %(message)s"
LEVEL_ENV = "RBLN_RAY_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")

# Environment defaults for every process rbln-ray starts (children inherit them):
# Hugging Face tokenizers print a warning, and turn their thread pool off, in every process
# forked after the pool was used; vLLM, Ray and multiprocessing fork (or fork+exec) often.
# vLLM logs to stdout by default, which would mix its log lines into a command's output
# (``rbln-ray build-model`` prints the model's path); logs belong on stderr.
PROCESS_ENV_DEFAULTS = {
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}


def apply_process_defaults() -> None:
    """Set :data:`PROCESS_ENV_DEFAULTS` where the user has not chosen otherwise."""
    for name, value in PROCESS_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)


def setup_logging(level: str | None = None) -> None:
    """Attach a stderr handler to the ``rbln_ray`` logger once (level ``RBLN_RAY_LOG_LEVEL``).

    ``level`` (``--log-level``) overrides the environment and is exported for child processes.
    """
    if level is not None:
        envs.export(LEVEL_ENV, level.upper())
    logger = logging.getLogger("rbln_ray")
    logger.setLevel(envs.get(LEVEL_ENV))
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.propagate = False
