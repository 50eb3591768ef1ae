"""The Ray actor that hosts one ``RBLNWorker`` (one pipeline stage / shard group).

Why a thin host instead of vLLM's ``RayWorkerWrapper``: that wrapper pulls in the compiled-DAG
and NCCL machinery our workers never use, and assumes one device per worker. This one:

* pins the emulator's device locks to the Ray node (``RBLN_RAY_NODE_ID`` := Ray node id), so
  several raylets on one machine each own devices 0..N-1, as real hosts would;
* builds the worker through vLLM's ``WorkerWrapperBase`` with ``local_rank=0``: Ray already
  narrowed ``RBLN_DEVICES`` to this actor's devices, and the worker indexes into them;
* runs control calls only (start-up, RPCs); scheduler steps reach the worker's step loop on a
  stream of their own (``rbln_ray.vllm_plugin.step_loop``), not as actor calls;
* exposes ``sentinel()`` in its own concurrency group: it never returns, so its ObjectRef
  completes (with an error) exactly when the actor dies, which the executor's monitor watches.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import ray

logger = logging.getLogger(__name__)

LIVENESS_GROUP = "liveness"


class RBLNWorkerActor:
    """Hosts one vLLM worker; methods run one at a time (default concurrency group of 1)."""

    def __init__(self) -> None:
        # Emulated devices belong to the Ray node, whatever the raylet inherited.
        os.environ["RBLN_RAY_NODE_ID"] = ray.get_runtime_context().get_node_id()
        from rbln_ray.emulator import ensure_runtime

        ensure_runtime()
        self._forever = threading.Event()  # never set
        self._wrapper: Any = None

    def placement(self) -> dict[str, Any]:
        """Where Ray put this actor (logged by the executor, used in error messages)."""
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "rbln_devices": os.environ.get("RBLN_DEVICES"),
            "accelerator_ids": ctx.get_accelerator_ids().get("RBLN", []),
        }

    def init_worker(self, vllm_config: Any, rank: int, is_driver_worker: bool) -> None:
        from vllm.v1.worker.worker_base import WorkerWrapperBase

        self._wrapper = WorkerWrapperBase(rpc_rank=0, global_rank=rank)
        kwargs = {
            "vllm_config": vllm_config,
            "local_rank": 0,
            "rank": rank,
            "distributed_init_method": "",  # RBLN workers never join a torch.distributed group
            "is_driver_worker": is_driver_worker,
            "shared_worker_lock": threading.Lock(),
        }
        self._wrapper.init_worker(all_kwargs=[kwargs])

    def execute_method(self, method: str | bytes, *args: Any, **kwargs: Any) -> Any:
        """Run a worker method by name, or a cloudpickled ``fn(worker, *args)``."""
        from vllm.v1.serial_utils import run_method

        try:
            return run_method(self._wrapper, method, args, kwargs)
        except Exception:
            logger.exception("RBLN worker method %r failed", method)
            raise

    @ray.method(concurrency_group=LIVENESS_GROUP)
    def sentinel(self) -> None:
        """Never returns while the actor lives: the executor treats this ref completing as the
        actor dying (in its own concurrency group, so it never blocks worker calls)."""
        self._forever.wait()
