"""vLLM scheduler for compiled RBLN graphs: each step is one prefill chunk, or decodes only.

Why: optimum-rbln compiles a prefill graph for one sequence (run in ``prefill_chunk_size``
chunks) and decode graphs for fixed batch sizes; a step can run exactly one of them. vLLM's
``Scheduler.schedule`` schedules the requests in ``self.running`` and admits waiting ones
only while ``len(running) < max_num_running_reqs``, so choosing what it sees per step
(through the public ``scheduler_cls`` hook) yields the RBLN step shapes without rewriting it:

- **prefill step**: it sees only the request being prefilled (or none, and may admit one);
  the token budget is one chunk, so a long prompt is prefilled one chunk per step;
- **decode step**: it sees only the decoding requests and may admit nothing.

A waiting request starts its prefill as soon as a compiled batch slot is free (continuous
batching, as before chunking), unless a prompt being prefilled has yet to compute blocks of a
prefix the two share: that prompt's chunks go first, so the waiting request finds the whole
prefix in the cache instead of computing part of it again. Between two chunks of a longer
prompt at least ``decode_steps_between_chunks`` decode steps run while requests are decoding
(:class:`~rbln_ray.vllm_plugin.options.RBLNOptions`), so a long prompt delays each decode by at
most one chunk, every few tokens, instead of stalling the batch for its whole prefill. With
several prompts in prefill, the one closest to its first token goes first.

vLLM's KV cache manager (its prefix cache included) works on small vLLM blocks; after each
step :class:`~rbln_ray.vllm_plugin.kv_blocks.OuterBlockManager` maps them onto the compiled
RBLN blocks and the step's :class:`~rbln_ray.vllm_plugin.kv_blocks.KVStepPlan` (block tables,
on-device KV copies, scratch block) travels to the workers in :class:`RBLNSchedulerOutput`.
Sliding-window artifacts also get each request's pinned cache slot there
(:class:`~rbln_ray.vllm_plugin.kv_slots.SlotManager`).

Speculative decoding: vLLM's scheduler schedules a decoding request's drafts with its next
token (``1 + n`` tokens, ``scheduled_spec_decode_tokens``) and rolls ``num_computed_tokens``
back by the rejected ones when the step's output comes. A decode step with drafts is a
``verify`` step here: its plan covers every position the compiled verify graph writes
(``width`` tokens per row, plus a draft model's lookahead), and before vLLM schedules it the
step's :class:`~rbln_ray.vllm_plugin.spec.policy.SpecPolicy` decides whether verifying the
drafts pays; if not they are set aside (shadow drafts, checked against the tokens the plain
decode steps produce) and the step decodes.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass, field, fields
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from rbln_ray.upstream import vllm_internals
from rbln_ray.vllm_plugin.kv_blocks import (
    BlockLayout,
    KVStepPlan,
    OuterBlockManager,
    block_layout,
    shares_uncomputed_blocks,
)
from rbln_ray.vllm_plugin.kv_slots import SlotManager
from rbln_ray.vllm_plugin.lora import LoRAGate, refuse_unknown
from rbln_ray.vllm_plugin.options import engine_options
from rbln_ray.vllm_plugin.spec.policy import SpecPolicy, accepted_prefix

logger = logging.getLogger(__name__)


@dataclass
class RBLNSchedulerOutput(SchedulerOutput):
    """vLLM's step output plus where the step's KV lives on the RBLN device."""

    rbln_plan: KVStepPlan = field(default_factory=lambda: KVStepPlan("idle"))

    @classmethod
    def wrap(cls, output: SchedulerOutput, plan: KVStepPlan) -> RBLNSchedulerOutput:
        values = {f.name: getattr(output, f.name) for f in fields(SchedulerOutput)}
        return cls(**values, rbln_plan=plan)


class _RBLNScheduling:
    """ARCHITECTURE §2 step shapes, chunked prefill interleaved with decodes, RBLN block mapping.

    A mixin over vLLM's ``Scheduler`` (:class:`RBLNScheduler`) or ``AsyncScheduler``
    (:class:`RBLNAsyncScheduler`, with async scheduling: vLLM's own placeholder bookkeeping
    for tokens still in flight, which the runner fills from its own sampled tokens).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from rbln_ray.vllm_plugin.platform import compiled_artifact

        artifact = compiled_artifact(self.vllm_config)
        self.layout: BlockLayout = block_layout(artifact)
        self.decode_batch = artifact.batch_size  # rows of the largest compiled decode graph
        # Tokens one prefill step computes: a compiled chunk, or a whole prompt when the user
        # turned chunked prefill off.
        sched = self.scheduler_config
        self.step_tokens = sched.long_prefill_token_threshold or sched.max_num_batched_tokens
        self.options = engine_options(self.vllm_config)
        self.lora_gate = LoRAGate.for_artifact(artifact) if artifact.lora is not None else None
        self.outer_blocks = OuterBlockManager(self.layout, self._evict_hashes, self._host_tier())
        kv = self.vllm_config.kv_transfer_config
        self._producer = kv is not None and kv.kv_role == "kv_producer"
        self._write_through = self.connector is not None and self.connector.write_through
        # Sliding-window layers, per-sequence state rows: one pinned cache slot per running
        # request (kv_slots).
        pinned = artifact.uses_local_cache or artifact.state_slots
        self.slots = SlotManager(artifact.batch_size) if pinned else None
        self._decodes_since_prefill = self.options.decode_steps_between_chunks
        # The last prefill attempt scheduled nothing while requests were decoding: run the
        # decodes next instead of retrying the prefill in a loop.
        self._prefill_stalled = False
        self.decode_sizes = artifact.decoder_batch_sizes
        self._running_count = 0
        # Speculative decoding: tokens per verify row, positions a draft model writes past
        # them, the per-step policy, and drafts set aside (request -> position, drafts).
        spec = self.vllm_config.speculative_config
        self.spec_width, self.spec_lookahead = 1, 0
        self.spec_policy: SpecPolicy | None = None
        self._shadow: dict[str, tuple[int, list[int]]] = {}
        if spec is not None:
            from rbln_ray.vllm_plugin.spec.costs import cost_prior

            k = spec.num_speculative_tokens
            self.spec_width = k + 1
            self.spec_lookahead = k if spec.method == "draft_model" else 0
            self.spec_policy = SpecPolicy(
                k=k,
                width=self.spec_width,
                prior=cost_prior(artifact),
                mode=self.options.spec_policy,
                min_gain=self.options.spec_min_gain,
                probe_steps=self.options.spec_probe_steps,
                draft_model=spec.method == "draft_model",
            )

    def _host_tier(self) -> Any:
        """The node's host KV tier when vLLM's connector is the RBLN host tier's (the
        connector answers vLLM's external-hit queries, the block plan moves the KV)."""
        from rbln_ray.vllm_plugin.host_kv_connector import RBLNHostKVConnector

        connector = self.connector
        if connector is None:
            return None
        if not isinstance(connector, RBLNHostKVConnector):
            raise ValueError(
                f"kv_transfer_config.kv_connector={type(connector).__name__}: the RBLN "
                "platform serves RBLNHostKVConnector only (its KV lives in the compiled runtime)"
            )
        connector.set_layout(self.layout.outer_size, self.layout.per_outer)
        return connector.tier

    # ------------------------------------------------------------------ step choice
    def _prefill_can_start(self) -> bool:
        """A waiting request may start its prefill: a free slot, vLLM blocks for its first
        chunk, and RBLN blocks for the rest of every prompt being prefilled plus its own (so
        concurrent prefills can always finish without waiting on each other)."""
        if not vllm_internals.has_waiting(self):
            return False
        if len(self.running) >= self.max_num_running_reqs:
            return False
        request = vllm_internals.next_waiting(self)
        needed = sum(
            self.outer_blocks.new_blocks_needed(r.request_id, self._reach(r.num_tokens))
            for r in self.running
            if r.is_prefill_chunk
        ) + self.layout.segments_for(self._reach(request.num_tokens))
        if self.outer_blocks.free_count() < needed:
            return False
        first = -(-min(request.num_tokens, self.step_tokens) // self.block_size)
        return self.kv_cache_manager.block_pool.get_num_free_blocks() >= first

    def _next_chunk(self, prefilling: list[Request], sharer: Request | None) -> Request | None:
        """The prefilling request to advance: ``sharer`` (:meth:`_prefix_in_flight`), else the
        one closest to its first token."""
        request = sharer or min(prefilling, key=lambda r: r.num_tokens - r.num_computed_tokens)
        end = self._reach(min(request.num_computed_tokens + self.step_tokens, request.num_tokens))
        needed = self.outer_blocks.new_blocks_needed(request.request_id, end)
        return request if self.outer_blocks.free_count() >= needed else None

    def _prefix_in_flight(self, prefilling: list[Request]) -> Request | None:
        """A prompt being prefilled whose next blocks the next waiting request shares.

        vLLM caches a block once it is scheduled, so a request admitted now finds only the
        blocks of a shared prefix scheduled so far and computes the rest itself (one more
        prefill chunk for every such request, e.g. when a batch of prompts with one system
        prompt arrives at once). Advancing that prompt's chunk first lets the waiting request
        find the whole prefix. vLLM's own scheduler admits at once (a GPU step computes
        several prompts' chunks together; an RBLN prefill step computes one)."""
        if not self.cache_config.enable_prefix_caching or not vllm_internals.has_waiting(self):
            return None
        waiting = vllm_internals.next_waiting(self).block_hashes
        return next(
            (
                request
                for request in prefilling
                if shares_uncomputed_blocks(
                    waiting, request.block_hashes, request.num_computed_tokens, self.block_size
                )
            ),
            None,
        )

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        """One step: start a waiting request's prefill when a slot is free (unless it shares
        blocks a prompt being prefilled has yet to compute), else the next chunk of a prompt
        being prefilled once enough decode steps ran since the last chunk, else decode every
        decoding request."""
        self.outer_blocks.tick()
        self._release_missing()
        prefilling = [r for r in self.running if r.is_prefill_chunk]
        decoding = [r for r in self.running if not r.is_prefill_chunk]
        self._running_count = len(self.running)  # what scheduler_view hides from vLLM
        gap = self.options.decode_steps_between_chunks
        chunk_due = not decoding or self._decodes_since_prefill >= gap
        sharer = self._prefix_in_flight(prefilling) if prefilling else None
        chunk = self._next_chunk(prefilling, sharer) if prefilling and chunk_due else None
        # A waiting request that shares blocks still to be prefilled waits for them.
        if sharer is None and not self._prefill_stalled and self._prefill_can_start():
            kind, visible, limit = "prefill", [], 1
        elif chunk is not None and not self._prefill_stalled:
            kind, visible, limit = "prefill", [chunk], 1
        else:
            kind = "decode"
            self._make_room_for_decodes(decoding)
            visible = self._decode_rows([r for r in self.running if not r.is_prefill_chunk])
            limit = len(visible)
            if self.spec_policy is not None:
                self._choose_drafts(visible)
        with vllm_internals.scheduler_view(self, visible, limit):
            output = super().schedule(throttle_prefills)
        scheduled = bool(output.num_scheduled_tokens)
        if kind == "decode" and output.scheduled_spec_decode_tokens:
            kind = "verify"
        if kind == "prefill":
            # Nothing scheduled (e.g. a grammar still compiling): decode next, then retry.
            self._prefill_stalled = not scheduled and bool(decoding)
            if scheduled:
                self._decodes_since_prefill = 0
        elif scheduled:
            self._decodes_since_prefill += 1
            self._prefill_stalled = False
        plan = self._plan(output, kind if scheduled else "idle")
        return RBLNSchedulerOutput.wrap(output, plan)

    def add_request(self, request: Request) -> None:
        """vLLM's, except a request naming a LoRA adapter that is not compiled in: finished
        with an error, never scheduled (vllm_plugin/lora.py)."""
        if not refuse_unknown(self, self.lora_gate, request):
            super().add_request(request)

    def has_requests(self) -> bool:
        return super().has_requests() or vllm_internals.has_pending_errors(self)

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: Any):
        """vLLM's, plus the requests of a step whose device call raised (the Ray executor's
        ``FailedStepOutput``): finished with an error, so each gets a terminal error answer
        from this replica rather than a retry that would fail another replica too."""
        failed = getattr(model_runner_output, "failed_req_ids", None)
        if failed:
            vllm_internals.finish_with_error(self, failed)
        if self.spec_policy is not None:
            self._observe_spec(scheduler_output, model_runner_output)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._shadow:
            self._resolve_shadows()
        return outputs

    # ------------------------------------------------------------------ speculative decoding
    def _reach(self, end: int) -> int:
        """The end of the positions a step computing up to ``end`` writes: a draft model
        proposing for the next step writes ``lookahead`` more."""
        return min(end + self.spec_lookahead, self.layout.max_seq_len)

    def _decode_batch(self, rows: int) -> int:
        return next((b for b in self.decode_sizes if b >= rows), self.decode_sizes[-1])

    def _choose_drafts(self, visible: list[Request]) -> None:
        """Verify this step's drafts only if the policy expects it to pay; else set them
        aside as shadow drafts (their acceptance is still measured) and decode."""
        policy = self.spec_policy
        assert policy is not None
        drafts = [len(r.spec_token_ids) for r in visible]
        if not any(drafts):
            return
        context = sum(r.num_computed_tokens for r in visible) // max(1, len(visible))
        if policy.verify_pays(drafts, self._decode_batch(len(visible)), context):
            return
        for r in visible:
            if r.spec_token_ids and r.request_id not in self._shadow:
                self._shadow[r.request_id] = (r.num_tokens, list(r.spec_token_ids))
            r.spec_token_ids = []

    def _observe_spec(self, so: SchedulerOutput, mro: Any) -> None:
        policy = self.spec_policy
        assert policy is not None
        info = getattr(mro, "rbln_spec", None)
        if info is not None:
            policy.observe_step(info)
        drafts = so.scheduled_spec_decode_tokens
        if not drafts or not mro.sampled_token_ids:
            return
        for req_id, ids in drafts.items():
            index = mro.req_id_to_index.get(req_id)
            if index is not None and mro.sampled_token_ids[index]:
                policy.observe(len(ids), len(mro.sampled_token_ids[index]) - 1)

    def _resolve_shadows(self) -> None:
        """Shadow drafts whose positions have all been decoded: how many would have been
        accepted (the tokens the steps produced, compared with the drafts)."""
        policy = self.spec_policy
        assert policy is not None
        for req_id, (start, drafts) in list(self._shadow.items()):
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                del self._shadow[req_id]
                continue
            if request.num_tokens < start + len(drafts):
                continue
            produced = request.all_token_ids[start : start + len(drafts)]
            policy.observe(len(drafts), accepted_prefix(drafts, produced))
            del self._shadow[req_id]

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """vLLM's, after choosing how many drafts the workers propose for the next step:
        ``k`` for the n-gram proposer (host work only; the next step decides whether to
        verify them), the policy's choice for a draft model (its device time is spent
        proposing)."""
        policy = self.spec_policy
        if policy is not None and policy.draft_model:
            rows = [
                self.requests[r]
                for r in scheduler_output.num_scheduled_tokens
                if r in self.requests
            ]
            context = sum(r.num_computed_tokens for r in rows) // max(1, len(rows))
            running = max(1, self._running_count)
            wanted = policy.wants_drafts(running, self._decode_batch(running), context)
            scheduler_output.num_spec_tokens_to_schedule = policy.k if wanted else 0
        super()._update_after_schedule(scheduler_output)

    def _decode_rows(self, decoding: list[Request]) -> list[Request]:
        """The requests one decode step runs: those with a token to compute now (a pipeline's
        other micro-batches are still in flight), at most the compiled decode batch."""
        ready = [
            r
            for r in decoding
            if r.num_tokens_with_spec + r.num_output_placeholders > r.num_computed_tokens
        ]
        return ready[: self.decode_batch]

    def _make_room_for_decodes(self, decoding: list[Request]) -> None:
        """Preempt the newest decoding requests while the others' next tokens need more new
        RBLN blocks than are free (only artifacts with fewer blocks than ``batch x
        max_seq_len`` can get here; vLLM's own block accounting cannot see RBLN blocks)."""

        def needed(reqs: list[Request]) -> int:
            return sum(
                self.outer_blocks.new_blocks_needed(
                    r.request_id,
                    self._reach(
                        r.num_computed_tokens + (self.spec_width if r.spec_token_ids else 1)
                    ),
                )
                for r in reqs
            )

        victims = list(decoding)
        while victims and needed(victims) > self.outer_blocks.free_count():
            victim = victims.pop()
            vllm_internals.preempt(self, victim)
            self._release_missing()
            logger.info("preempted %s: no free RBLN KV block", victim.request_id)

    # ------------------------------------------------------------------ block plan
    def _plan(self, output: SchedulerOutput, kind: str) -> KVStepPlan:
        plan = KVStepPlan(kind)
        manager = self.outer_blocks
        # Requests vLLM preempted in this very step give their RBLN blocks back first.
        self._release_missing()
        starts = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in cached.resumed_req_ids:
                starts[req_id] = cached.num_computed_tokens[i]
        if kind == "verify":
            plan.width, plan.lookahead = self.spec_width, self.spec_lookahead
        for req_id, scheduled in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            hit = starts.get(req_id)
            end = request.num_computed_tokens  # already advanced past this step's tokens
            if kind == "verify":  # the verify window: width tokens from the last sampled one
                end += self.spec_width - scheduled
            end = self._reach(end)
            if hit is not None and not manager.owns(req_id):
                copies, start = manager.admit(req_id, request.block_hashes, hit, end)
                plan.copies.extend(copies)
                if start < hit:
                    plan.prefill_start[req_id] = start
                    logger.debug("%s: prefix hit %d, recomputing from %d", req_id, hit, start)
            else:
                manager.extend(req_id, request.block_hashes, end)
            plan.tables[req_id] = manager.table(req_id)
            if self.slots is not None:
                plan.slots[req_id] = self.slots.slot(req_id)
            handover = kind == "prefill" and self._hands_over(request)
            if handover or (kind == "prefill" and self._writes_through(request)):
                exports = manager.export(req_id)  # recorded above: the whole prompt's blocks
                plan.host_exports.extend(exports)
                if handover:
                    self.connector.exported(req_id, sum(e.tokens for e in exports))
        if kind in ("decode", "verify") or (self.spec_lookahead and kind == "prefill"):
            # padding rows (a draft model pads its proposing calls after a prefill too)
            tokens = max(self.spec_width, 2) if self.spec_policy is not None else 1
            plan.scratch_block, plan.scratch_position = manager.scratch(tokens)
            if self.slots is not None:
                plan.scratch_slot = self.slots.scratch()
        plan.host_saves, plan.host_loads = manager.take_host_work()
        manager.flush_evictions()
        return plan

    def _prompt_done(self, request: Request) -> bool:
        """With a host tier on, the step computes the last chunk of ``request``'s prompt."""
        return self.connector is not None and (
            request.num_computed_tokens >= request.num_prompt_tokens
        )

    def _hands_over(self, request: Request) -> bool:
        """Prefill/decode disaggregation: the step computes the last chunk of a prompt whose
        KV a decode engine takes over through the host tier: every prompt of a prefill engine
        (``kv_role: kv_producer``), else a request asking for it as vLLM's P/D proxies do
        (``kv_transfer_params: {"do_remote_decode": true}``)."""
        if not self._prompt_done(request):
            return False
        params = request.kv_transfer_params or {}
        return self._producer or bool(params.get("do_remote_decode"))

    def _writes_through(self, request: Request) -> bool:
        """The tier's write-through mode (``write_through``): every prompt's KV goes to the
        node's tier once computed, so the node's other replicas find it while this device
        still holds it, not only after this device drops it."""
        return self._write_through and self._prompt_done(request)

    def _release_missing(self) -> None:
        """Requests no longer running give back their RBLN blocks and cache slots."""
        live = {r.request_id for r in self.running}
        self.outer_blocks.release_missing(live)
        if self.slots is not None:
            self.slots.release_missing(live)

    def _evict_hashes(self, hashes: list[Hashable]) -> None:
        """Drop from vLLM's prefix cache the blocks whose KV no RBLN block holds any more."""
        vllm_internals.evict_cached_hashes(self, hashes)


class RBLNScheduler(_RBLNScheduling, Scheduler):
    """The RBLN scheduler without async scheduling."""


class RBLNAsyncScheduler(_RBLNScheduling, AsyncScheduler):
    """The RBLN scheduler with async scheduling (the default)."""
