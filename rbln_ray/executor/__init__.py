"""Ray executor for vLLM on RBLN devices: one Ray actor per worker, pinned by Ray to its ATOMs.

Use it as ``LLM(model=compiled_dir, distributed_executor_backend="ray")`` (the RBLN platform
maps ``"ray"`` to this executor), or pass the class ``RBLNRayExecutor`` or its qualname
``"rbln_ray.executor.RBLNRayExecutor"``.

What it does:

* connects vLLM's engine-core process to the driver's Ray cluster (see
  :mod:`rbln_ray.executor.cluster`), starting a local Ray instance only when there is none;
* reserves one placement-group bundle ``{"RBLN": num_devices, "CPU": 1}`` per worker, where
  ``num_devices`` is the compiled artifact's (a shard group runs in one process); reuses
  ``parallel_config.placement_group`` or the caller's current placement group when set (a Serve
  replica); waits at most ``additional_config["rbln_placement_timeout_s"]`` and otherwise
  fails naming what was asked and what the cluster has; the strategy is
  ``additional_config["rbln_placement_strategy"]`` (defaults and choices:
  :class:`~rbln_ray.vllm_plugin.options.PlacementSettings`);
* starts one actor per bundle running ``RBLNWorker``; Ray sets ``RBLN_DEVICES`` for it and the
  worker opens its devices as indices into that list (``local_rank=0``);
* fails fast: a dead actor makes in-flight steps raise and fires vLLM's failure callback;
* ``shutdown`` kills the actors and removes the placement group, and returns only after the
  actors are gone, so the devices are immediately free for a new engine.

**Compiled-artifact location rule.** Workers load the compiled model from the path in the
engine config (``EngineDecisions.compiled_dir``, i.e. the ``model`` directory or the compile
cache entry), on whatever node Ray placed them. That directory must therefore exist at
the same absolute path on every node that has RBLN devices (a shared filesystem, or the same
copy on each host), or be shipped to the workers with ``parallel_config.ray_runtime_env`` and
referenced by the path it gets there. The executor does not copy artifacts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rbln_ray.executor.placement import PlacementError, PlacementPlan, num_workers

if TYPE_CHECKING:
    from rbln_ray.executor.ray_executor import RBLNRayExecutor, RBLNWorkerDiedError

__all__ = [
    "PlacementError",
    "PlacementPlan",
    "RBLNRayExecutor",
    "RBLNWorkerDiedError",
    "num_workers",
]


def __getattr__(name: str) -> Any:
    # The executor imports Ray and vLLM: only when asked for.
    if name in ("RBLNRayExecutor", "RBLNWorkerDiedError"):
        from rbln_ray.executor import ray_executor

        return getattr(ray_executor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
