"""RBLN model runner: vLLM scheduler steps → optimum-rbln serving calls → sampled tokens.

Each ``SchedulerOutput`` from :class:`RBLNScheduler` is either one prefill chunk or a batch of
decodes (ARCHITECTURE §4), and carries a :class:`~rbln_ray.vllm_plugin.kv_blocks.KVStepPlan`: the
compiled RBLN KV blocks of every scheduled request, the on-device KV copies a prefix-cache
hit needs, and a scratch block for padding rows.

- prefill: ``model.prefill_decoder(input_ids [1,L], cache_position [1,L], block_tables [nblk])``
  from the first uncached position (a multiple of the compiled ``prefill_chunk_size``) to the
  end of the scheduled chunk; returns the last token's logits, sampled only when the chunk
  completes the prompt. A prompt with images (a vision-language artifact) passes its slice of
  the prompt's embeddings as ``inputs_embeds`` instead (the family module's ``Embedder``,
  :mod:`rbln_ray.families`), and a family's
  extra decoder inputs (Qwen2-VL's M-RoPE ``position_embed``) join prefill and decode calls;
- decode: ``model.decoders[bs](input_ids [bs,1], cache_position [bs,1], block_tables [bs,nblk])``
  where ``bs`` is the smallest compiled decoder batch size that fits the live rows. Padding
  rows (token 0) write to the plan's scratch block at a position that holds no cached KV,
  and only live rows' logits are kept. An artifact with per-sequence state rows
  (``state_slots``: Qwen3.5's linear attention) runs the full batch with each request at its
  pinned slot's row, and its prefill names the slot (``batch_idx``).

- verify (speculative decoding): ``verify_runtimes[bs](input_ids [bs,W], cache_position
  [bs,W], block_tables [bs,nblk])``, the artifact's verify graph
  (:mod:`rbln_ray.compile.spec_graphs`): each row is the last sampled token and its drafts
  at consecutive positions, back-padded to the compiled width ``W`` (near ``max_model_len``
  front-padded instead: the window moves back over tokens already in the cache, which are
  written again unchanged). The logits of each row's real positions go, in vLLM's flat
  layout, to vLLM's ``RejectionSampler``; positions are always the runner's own token counts.
  After every step that samples, the proposer (:mod:`rbln_ray.vllm_plugin.spec.proposers`)
  drafts for the next step; the engine takes them with ``take_draft_token_ids``.

KV copies go through the runtime (``rebel.Runtime._copy_kv_cache``), never through host
tensors, so the same code runs on an ATOM. Sampling runs on the host with vLLM's own
``Sampler`` and ``InputBatch``, so every ``SamplingParams`` feature (seeds, top-p/k,
penalties, logprobs, logits processors) behaves as in vLLM.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.sampling_params import SamplingType
from vllm.v1.core.sched.output import GrammarOutput, NewRequestData, SchedulerOutput
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from rbln_ray.common import envs
from rbln_ray.compile.artifact import CompiledArtifact
from rbln_ray.families.registry import VISION
from rbln_ray.families.vision_base import PromptEmbedder
from rbln_ray.upstream import rebel_internals, vllm_internals
from rbln_ray.vllm_plugin.host_transfer import HostTransfer
from rbln_ray.vllm_plugin.kv_blocks import NO_BLOCK, BlockLayout, HostSave, KVCopy, KVStepPlan
from rbln_ray.vllm_plugin.lora import LoRARows
from rbln_ray.vllm_plugin.spec import verify
from rbln_ray.vllm_plugin.spec.policy import SpecStepInfo
from rbln_ray.vllm_plugin.spec.verify import Speculator, VerifyStep

logger = logging.getLogger(__name__)

# A pipeline rank's source of the previous rank's hidden states for the step (None: token ids).
Receive = Callable[[], torch.Tensor] | None


@dataclass
class StepStats:
    """Counters the tests and benchmarks read: what ran, and time spent inside the device."""

    prefill_steps: int = 0  # prefill calls (one per scheduled chunk)
    prefill_requests: int = 0  # prompts whose prefill completed
    prefill_tokens: int = 0  # tokens the prefill calls computed
    prefix_reused_tokens: int = 0  # prompt tokens served from cached KV instead
    # vLLM prefix hits no device block held any more, computed again (0 while vLLM's prefix
    # cache and the RBLN blocks agree)
    prefix_recomputed_tokens: int = 0
    kv_copies: int = 0  # on-device KV block copies (prefix hits in another request's block)
    kv_copy_tokens: int = 0
    # host KV tier (host_transfer): blocks saved before reuse, entries loaded for prefix hits
    host_saves: int = 0
    host_save_tokens: int = 0
    host_loads: int = 0
    host_load_tokens: int = 0
    host_load_failures: int = 0  # entries gone or unreadable: those tokens were computed
    host_seconds: float = 0.0
    decode_steps: int = 0
    decode_inputs_ahead: int = 0  # decode steps whose inputs were built ahead (decode_ahead)
    decode_rows: int = 0
    padded_rows: int = 0
    device_seconds: float = 0.0
    # speculative decoding
    verify_steps: int = 0  # verify calls (decode steps that checked drafts)
    verify_rows: int = 0  # live rows in them
    spec_draft_tokens: int = 0  # drafts verified
    spec_accepted_tokens: int = 0  # of which accepted
    draft_calls: int = 0  # draft-model device calls
    draft_seconds: float = 0.0
    spec_host_seconds: float = 0.0  # rejection sampling and proposing
    # (step index, kind, request ids) of the last steps, for continuous-batching checks.
    history: list[tuple[int, str, tuple[str, ...]]] = field(default_factory=list)

    def record(self, kind: str, req_ids: list[str]) -> None:
        self.history.append((self.prefill_steps + self.decode_steps, kind, tuple(req_ids)))
        del self.history[:-4096]


@dataclass
class _PrefillStep:
    """A prefill chunk as :meth:`RBLNModelRunner.prepare` left it (its inputs are built at
    launch: whether the plan's KV copies succeed decides where it starts)."""

    so: SchedulerOutput
    plan: KVStepPlan
    req_id: str
    state: CachedRequestState
    computed: int  # the request's computed tokens before this chunk
    end: int  # the chunk's end position
    tokens: list[int]  # the prompt (and any outputs: a resumed request) at prepare time
    starting: bool  # its first chunk (new or resumed): earlier tokens came from the cache


@dataclass
class _DecodeStep:
    """A decode step's device inputs: all but the token ids ``x`` follow from the scheduler
    output alone (positions, block tables, padding rows), so they may be built ahead
    (:meth:`RBLNModelRunner.decode_ahead`); ``x`` needs the previous step's tokens."""

    so: SchedulerOutput
    req_ids: list[str]  # live rows: the input batch's order, or the scheduler's (pipeline)
    bs: int  # the compiled decode batch that runs it
    # device row -> index into req_ids, None for a padding row: live rows first (sorted by
    # length for NPU kernels that need it), or each at its state slot (state_slots artifacts)
    layout: list[int | None]
    positions: list[int]  # each live row's position (where its new token goes), req_ids order
    cache_pos: torch.Tensor
    inputs: dict[str, torch.Tensor | None]
    x: torch.Tensor | None = None  # token ids (first pipeline rank); else the previous
    # rank's hidden states, received at launch


# What prepare() hands launch(): a step to run, or an output at once (nothing scheduled).
PreparedStep = _PrefillStep | _DecodeStep | VerifyStep | ModelRunnerOutput | None


@dataclass
class RBLNRunnerOutput(ModelRunnerOutput):
    """vLLM's step output plus what speculative decoding adds: the step's costs for the
    scheduler's policy and the drafts for the next step (the engine takes them with
    ``take_draft_token_ids``; the Ray executor from here, without a call to the worker)."""

    rbln_spec: SpecStepInfo | None = None
    rbln_drafts: DraftTokenIds | None = None


def new_request_state(new: NewRequestData) -> CachedRequestState:
    """vLLM's per-request state of a newly scheduled request, as its GPU runner builds it
    (a seeded generator when the sampling parameters carry a seed)."""
    params = new.sampling_params
    generator = None
    if params is not None and params.sampling_type == SamplingType.RANDOM_SEED:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(params.seed)
    return CachedRequestState(
        req_id=new.req_id,
        prompt_token_ids=new.prompt_token_ids,
        mm_features=list(new.mm_features or []),
        sampling_params=params,
        generator=generator,
        block_ids=tuple(list(ids) for ids in new.block_ids),
        num_computed_tokens=new.num_computed_tokens,
        output_token_ids=[],
        lora_request=new.lora_request,
    )


def take_blocks(state: CachedRequestState, new_blocks: Any, resumed: bool) -> None:
    """A running request's KV blocks after a step's schedule: a resumed (preempted) request
    gets its whole list anew, a running one the blocks appended this step."""
    if resumed:
        state.block_ids = tuple(list(ids) for ids in new_blocks)
    elif new_blocks is not None:
        for ids, extra in zip(state.block_ids, new_blocks, strict=True):
            ids.extend(extra)


class RBLNModelRunner:
    """Drives one loaded optimum-rbln decoder model for a vLLM engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        artifact: CompiledArtifact,
        model: Any,
        layout: BlockLayout,
        *,
        first_stage: bool = True,
        last_stage: bool = True,
        speculator: Speculator | None = None,
    ) -> None:
        self.vllm_config = vllm_config
        # Pipeline ranks: the first embeds token ids, later ones take the previous stage's
        # hidden states; only the last returns logits and samples.
        self.first_stage, self.last_stage = first_stage, last_stage
        self.artifact = artifact
        # A vision-language model: its images become prompt embeddings (its family's
        # Embedder); its language model is the decoder every prefill and decode call runs.
        self.embedder: PromptEmbedder | None = None
        if artifact.is_multimodal:
            self.embedder = VISION[artifact.vision_family].code().Embedder(model)
            model = self.embedder.language_model
        # Not ``model``: vLLM 0.30's in-process engine walks ``model_runner.model.modules()``
        # at exit (LLMEngine._cleanup_instance_caches); an optimum-rbln model is no nn.Module.
        self.rbln_model = model
        self.layout = layout
        self.device = torch.device("cpu")
        model_config = vllm_config.model_config
        block_size = layout.inner_size  # vLLM's blocks; the RBLN ones come with each step
        self.input_batch = InputBatch(
            max_num_reqs=vllm_config.scheduler_config.max_num_seqs,
            max_model_len=model_config.max_model_len,
            max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            device=self.device,
            vocab_size=model_config.get_vocab_size(),
            block_sizes=[block_size],
            kernel_block_sizes=[block_size],
            max_num_blocks_per_req=[-(-model_config.max_model_len // block_size)],
            # vLLM's built-in processors plus the engine's --logits-processors, as vLLM's
            # own runners build them (custom ones see each request's output token ids).
            logitsprocs=build_logitsprocs(
                vllm_config, self.device, False, False, model_config.logits_processors or ()
            ),
            num_spec_tokens=self.num_spec_tokens(vllm_config),
            is_pooling_model=False,
        )
        self.sampler = Sampler(logprobs_mode=model_config.logprobs_mode)
        # Speculative decoding (None without a speculative_config)
        self.spec = speculator
        self.rejection_sampler = None
        self._drafts: DraftTokenIds | None = None  # for the engine's take_draft_token_ids
        if speculator is not None:
            from rbln_ray.vllm_plugin.spec.sampling import rejection_sampler

            spec_config = vllm_config.speculative_config
            self.rejection_sampler = rejection_sampler(spec_config, model_config.logprobs_mode)
        self._fault_token = envs.get("RBLN_RAY_TEST_STEP_FAULT")  # tests only
        self.requests: dict[str, CachedRequestState] = {}
        self.lora = LoRARows(artifact)  # each row's compiled LoRA adapter id
        self.stats = StepStats()
        self._last_decode_s = 0.0
        # The rows of the last step prepared (the sampling rank's guess of the next decode
        # step's row order, decode_ahead); replaced, never mutated, so the reader thread may
        # read it while the loop thread prepares.
        self._last_rows: list[str] = []
        # What the next sample_tokens returns: a step's logits to sample, or the output of a
        # prompt chunk (nothing to sample).
        self._pending: tuple[SchedulerOutput, torch.Tensor] | ModelRunnerOutput | None = None
        # Called once a prefill or decode step's inputs are built, before its device call (and
        # before waiting for a previous pipeline rank's hidden states): the step loop hands the
        # previous step's output to the engine then, so that work overlaps the device.
        self.before_device: Callable[[], None] | None = None
        # The node's host KV tier, when vLLM's kv_transfer_config switches it on (the worker
        # sets it up: rbln_ray.vllm_plugin.host_transfer).
        self.host: HostTransfer | None = None

    @staticmethod
    def num_spec_tokens(vllm_config: VllmConfig) -> int:
        spec = vllm_config.speculative_config
        return spec.num_speculative_tokens if spec is not None else 0

    # ----------------------------------------------------------------- request state
    def _update_states(self, so: SchedulerOutput) -> None:
        """Mirror the scheduler's view of requests into ``requests`` and, on the rank that
        samples, vLLM's input batch (the sampler's state). Pipeline ranks before the last
        never sample, so they skip the batch: with S micro-batches taking turns, it would
        drop and re-add every request at every step (BENCHMARKS §10)."""
        if not self.last_stage:
            self._update_requests(so, None)
            return
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            batch.remove_request(req_id)
        for req_id in list(batch.req_id_to_index):
            if req_id not in so.num_scheduled_tokens:
                batch.remove_request(req_id)
        self._update_requests(so, batch)
        batch.condense()
        batch.refresh_metadata()

    def _update_requests(self, so: SchedulerOutput, batch: InputBatch | None) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self.lora.forget(req_id)
            if self.embedder is not None:
                self.embedder.forget(req_id)
        if self.spec is not None and so.finished_req_ids:
            forget = getattr(self.spec.drafter, "forget", None)
            if forget is not None:
                forget(so.finished_req_ids)
        for new in so.scheduled_new_reqs:
            state = new_request_state(new)
            self.requests[new.req_id] = state
            self.lora.admit(new.req_id, new.lora_request)
            if batch is not None:
                batch.add_request(state)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            if not self.last_stage and cached.new_token_ids:
                # Pipeline ranks before the last learn sampled tokens from the scheduler
                # (vLLM sends each step's input tokens to every rank when PP > 1).
                tokens = cached.new_token_ids[i]
                unseen = state.num_computed_tokens + len(tokens) - state.num_tokens
                if unseen > 0:
                    state.output_token_ids.extend(tokens[-unseen:])
            take_blocks(state, cached.new_block_ids[i], req_id in cached.resumed_req_ids)
            if batch is not None and req_id not in batch.req_id_to_index:
                batch.add_request(state)

    def table_row(self, blocks: list[int]) -> list[int]:
        """A request's RBLN blocks as one row of a compiled block table (padded)."""
        return self._table_row(blocks)

    def _table_row(self, blocks: list[int]) -> list[int]:
        width = self.layout.segments_per_seq
        if len(blocks) > width:
            raise RuntimeError(f"request spans {len(blocks)} KV blocks, compiled maximum {width}")
        return blocks + [NO_BLOCK] * (width - len(blocks))

    def _block_inputs(
        self, table: torch.Tensor, slots: list[int | None], prefill: bool
    ) -> dict[str, torch.Tensor | None]:
        """The block-table inputs the compiled graphs take: ``block_tables`` for paged layers,
        ``local_block_tables`` (the pinned sliding-window slots: ``[1]`` in prefill, ``[B,1]``
        in decode) for sliding ones. An input the artifact lacks is passed as None, which
        optimum's runtime wrapper drops."""
        art = self.artifact
        local = None
        if art.uses_local_cache:
            if any(s is None for s in slots):
                raise RuntimeError(
                    "sliding-window artifact but the step plan has no cache slot for a row: "
                    "the scheduler must assign slots (RBLNScheduler with kv_slots.SlotManager)"
                )
            local = torch.tensor(slots, dtype=torch.int16)
            local = local if prefill else local.view(-1, 1)
        return {
            "block_tables": table if art.uses_global_cache else None,
            "local_block_tables": local,
        }

    def _copy_kv(self, copies: list[KVCopy]) -> bool:
        """Run the plan's on-device KV copies; False if the runtime cannot copy."""
        if not copies:
            return True
        copy = getattr(self.rbln_model, "copy_kv_blocks", None)
        try:
            if copy is not None:  # a pipeline: every stage copies its own layers
                copy([(c.src, c.dst, c.tokens) for c in copies])
            else:
                runtime = self.rbln_model.prefill_decoder.runtime
                for c in copies:
                    rebel_internals.copy_kv_cache(runtime, c.src, c.dst, c.tokens)
        except Exception:  # noqa: BLE001 - a failed copy costs a recompute, never the engine
            logger.warning(
                "on-device KV copy failed; prefilling the cached prefix again", exc_info=True
            )
            return False
        self.stats.kv_copies += len(copies)
        self.stats.kv_copy_tokens += sum(c.tokens for c in copies)
        drafter = self.spec.drafter if self.spec is not None else None
        if drafter is not None and hasattr(drafter, "copy"):  # the draft model's KV too
            drafter.copy(copies)
        return True

    # ----------------------------------------------------------------- step preparation
    def prepare(self, so: SchedulerOutput, ahead: _DecodeStep | None = None) -> PreparedStep:
        """Everything of a step that needs no device and no earlier step's device results:
        request state from the scheduler output, then (decode) every input of the device
        call. :meth:`launch` runs it. On the rank that samples this must follow the previous
        step's sampling (its tokens are the inputs); a pipeline rank before the last may
        prepare a step while its previous one is still on the device.

        ``ahead``: this step's inputs from :meth:`decode_ahead`, used if its rows are the
        ones this step runs (else the inputs are built here)."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT if self.last_stage else None
        plan: KVStepPlan | None = getattr(so, "rbln_plan", None)
        if plan is None:
            raise RuntimeError(
                "scheduler output without an RBLN block plan: the engine must run "
                "rbln_ray.vllm_plugin.scheduler.RBLNScheduler (set by the RBLN platform)"
            )
        # Device rows in the input batch's order, which the sampler's rows follow; across
        # pipeline ranks in the scheduler's order, the same on every rank (only the last keeps
        # an input batch: its logits are put in batch order, _in_batch_order).
        if self.first_stage and self.last_stage:
            req_ids = list(self.input_batch.req_ids)
        else:
            req_ids = list(so.num_scheduled_tokens)
        self._last_rows = req_ids
        if plan.kind == "verify":
            return verify.prepare_verify(self, so, plan, req_ids)
        if plan.kind != "prefill":
            if ahead is None or ahead.so is not so or ahead.req_ids != req_ids:
                positions = [self.requests[r].num_computed_tokens for r in req_ids]
                ahead = self._prepare_decode(so, plan, req_ids, positions)
            else:
                self.stats.decode_inputs_ahead += 1
            if self.first_stage:
                ahead.x = self._token_ids(ahead)
            return ahead
        if len(req_ids) != 1:
            raise RuntimeError(
                f"prefill step schedules {req_ids}; the RBLN scheduler must schedule one "
                "prefill per step, never mixed with decodes"
            )
        req_id = req_ids[0]
        state = self.requests[req_id]
        computed = state.num_computed_tokens
        cached = so.scheduled_cached_reqs
        return _PrefillStep(
            so=so,
            plan=plan,
            req_id=req_id,
            state=state,
            computed=computed,
            end=computed + so.num_scheduled_tokens[req_id],
            tokens=state.prompt_token_ids + state.output_token_ids,
            starting=req_id in cached.resumed_req_ids
            or any(n.req_id == req_id for n in so.scheduled_new_reqs),
        )

    def decode_ahead(self, so: SchedulerOutput) -> _DecodeStep | None:
        """A decode step's inputs but its token ids, built from its scheduler output alone:
        on the sampling rank's step-loop reader thread, while the previous step is still on
        the device, so that only sampling and the token ids stay between two device calls.

        The rows must be in the order :meth:`prepare` will run them. On a pipeline's last
        rank that is the scheduler's order; on a single worker the input batch's, which
        only this step's update makes: it is guessed as the last step's rows when the step
        runs the same requests and none starts, resumes or finishes (a decode run's steady
        state), and :meth:`prepare` builds the inputs itself when the guess was wrong.
        None: nothing to build ahead (a prefill, a changed batch, a vision-language model)."""
        plan: KVStepPlan | None = getattr(so, "rbln_plan", None)
        if plan is None or plan.kind in ("prefill", "verify") or self.embedder is not None:
            return None  # a verify step's positions depend on the previous step's acceptance
        cached = so.scheduled_cached_reqs
        if so.scheduled_new_reqs or so.finished_req_ids or cached.resumed_req_ids:
            return None
        if self.first_stage and self.last_stage:  # prepare() runs the input batch's order
            req_ids = self._last_rows
            if len(req_ids) != len(so.num_scheduled_tokens) or not all(
                r in so.num_scheduled_tokens for r in req_ids
            ):
                return None
        else:
            req_ids = list(so.num_scheduled_tokens)
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        if not all(r in computed for r in req_ids):
            return None
        return self._prepare_decode(so, plan, req_ids, [computed[r] for r in req_ids])

    def _prepare_decode(
        self, so: SchedulerOutput, plan: KVStepPlan, req_ids: list[str], positions: list[int]
    ) -> _DecodeStep:
        """A decode step's inputs but its token ids (:meth:`_token_ids`); ``positions``: each
        row's computed tokens, the position its new token is written at."""
        sizes = self.artifact.decoder_batch_sizes
        idx = bisect.bisect_left(sizes, len(req_ids))
        if idx == len(sizes):
            raise RuntimeError(f"{len(req_ids)} decode rows exceed the compiled batch {sizes[-1]}")
        bs = sizes[idx]
        if self.artifact.state_slots:
            # Per-sequence state rows: the full compiled batch, each request at its slot's row
            # (padding rows at free slots, whose state no request holds).
            bs = self.artifact.batch_size
            rows = [plan.slots[r] for r in req_ids]
        else:
            order = list(range(len(req_ids)))
            if self.artifact.requires_batch_sort:  # NPU kernels that need length-sorted rows
                order.sort(key=lambda i: -positions[i])
            rows = [0] * len(req_ids)
            for row, i in enumerate(order):
                rows[i] = row
        layout: list[int | None] = [None] * bs
        for i, row in enumerate(rows):
            layout[row] = i
        # Inputs are built as lists and converted once: per-row tensor writes cost ~10 us
        # each, a measurable share of the host time per step at batch 8.
        live = [(i, req_ids[i]) if i is not None else None for i in layout]
        pos = [positions[x[0]] if x else plan.scratch_position for x in live]
        cache_pos = torch.tensor(pos, dtype=torch.int32).view(bs, 1)
        scratch = self._table_row([plan.scratch_block])
        table = torch.tensor(
            [self._table_row(plan.tables[x[1]]) if x else scratch for x in live], dtype=torch.int16
        )
        slots = [plan.slots.get(x[1]) if x else plan.scratch_slot for x in live]
        inputs = self._block_inputs(table, slots, prefill=False)
        inputs.update(self.lora.decode([x[1] if x else None for x in live]))
        if self.artifact.use_attention_mask:
            # optimum's own decoder mask buffer is sized for the full batch; pass ours per call.
            span = torch.arange(self.artifact.max_seq_len)
            mask = (span.view(1, -1) <= cache_pos.view(-1, 1)).float()
            # with position ids the mask is [B, S], else [B, 1, 1, S] (get_input_info)
            inputs["attention_mask"] = (
                mask if self.artifact.use_position_ids else mask.view(bs, 1, 1, -1)
            )
        if self.artifact.use_position_ids:
            inputs["position_ids"] = cache_pos
        if self.embedder is not None:  # e.g. Qwen2-VL's M-RoPE position embeddings
            states = [self.requests[x[1]] if x else None for x in live]
            inputs.update(self.embedder.decode_inputs(states, cache_pos))
        return _DecodeStep(so, req_ids, bs, layout, list(positions), cache_pos, inputs)

    def _token_ids(self, step: _DecodeStep) -> torch.Tensor:
        """The step's input token ids, ``[bs, 1]``: each row's token at its position (the
        last sampled one), 0 in padding rows."""
        tokens = [
            0 if i is None else self.requests[step.req_ids[i]].get_token_id(step.positions[i])
            for i in step.layout
        ]
        return torch.tensor(tokens, dtype=torch.long).view(-1, 1)

    # ----------------------------------------------------------------- device calls
    def launch(
        self, step: PreparedStep, receive: Receive = None
    ) -> ModelRunnerOutput | torch.Tensor | None:
        """Run a prepared step on the device; :meth:`sample_tokens` then returns its output.

        A pipeline rank after the first gets the previous rank's hidden states from
        ``receive``, called once every other input of the step is ready (they may still be on
        their way); a rank before the last returns its own hidden states for the next rank.
        """
        if step is None or isinstance(step, ModelRunnerOutput):
            return step  # nothing scheduled
        self._save_to_host(getattr(step.so, "rbln_plan", None))
        if not self.first_stage and receive is None:
            raise RuntimeError("pipeline rank without the previous stage's hidden states")
        if isinstance(step, VerifyStep):
            self._pending = verify.run_verify(self, step)
            return None
        if isinstance(step, _PrefillStep):
            logits = self._prefill(step, receive)
            self._save(step.plan.host_exports)  # before the first token leaves the engine
            if not self.last_stage:
                return logits
            if step.end < len(step.tokens):
                # A chunk of a longer prompt: nothing to sample (vLLM expects no token).
                req_id = step.req_id
                self._pending = ModelRunnerOutput(
                    req_ids=[req_id], req_id_to_index={req_id: 0}, sampled_token_ids=[[]]
                )
                return None
        else:
            logits = self._decode(step, receive)
            if not self.last_stage:
                return logits
            logits = self._in_batch_order(logits, step.req_ids)
        self._pending = (step.so, logits.float())
        return None

    # ----------------------------------------------------------------- speculative decoding
    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts proposed after the last step (vLLM's engine takes them once)."""
        drafts, self._drafts = self._drafts, None
        return drafts

    def _save_to_host(self, plan: KVStepPlan | None) -> None:
        """The step's host tier saves, before anything of the step writes those blocks."""
        if plan is not None:
            self._save(plan.host_saves)

    def _save(self, saves: list[HostSave]) -> None:
        if not saves or self.host is None:
            return
        for save in saves:
            if self.host.save(save):
                self.stats.host_saves += 1
                self.stats.host_save_tokens += save.tokens
        self.stats.host_seconds = self.host.seconds

    def _load_from_host(self, plan: KVStepPlan, req_id: str, start: int) -> int:
        """Load ``req_id``'s host tier entries; where one fails, its tokens are computed:
        the position the prefill must then start at."""
        for load in plan.host_loads:
            if load.req_id != req_id:
                continue
            if self.host is not None and self.host.load(load):
                self.stats.host_loads += 1
                self.stats.host_load_tokens += load.tokens
            else:
                self.stats.host_load_failures += 1
                start = min(start, load.start)
        if self.host is not None:
            self.stats.host_seconds = self.host.seconds
        return start

    def _prefill(self, step: _PrefillStep, receive: Receive) -> torch.Tensor:
        req_id, plan, tokens, end = step.req_id, step.plan, step.tokens, step.end
        start = plan.prefill_start.get(req_id, step.computed)
        if not self._copy_kv(plan.copies):
            start = 0
        if plan.host_loads:
            start = self._load_from_host(plan, req_id, start)
        chunk = self.artifact.prefill_chunk_size
        if start % chunk:
            raise RuntimeError(
                f"request {req_id}: prefill from position {start}; the compiled prefill resumes "
                f"only at a multiple of prefill_chunk_size={chunk}"
            )
        state = step.state
        inputs: dict[str, torch.Tensor | None] = {}
        if self.embedder is not None and self.embedder.has_images(state.mm_features):
            embeds = self.embedder.embeds(req_id, tokens, state.mm_features, start)
            inputs["inputs_embeds"] = embeds[start:end].unsqueeze(0)
        elif receive is None:
            inputs["input_ids"] = torch.tensor([tokens[start:end]], dtype=torch.long)
        positions = torch.arange(start, end, dtype=torch.int32).unsqueeze(0)
        table = torch.tensor(self._table_row(plan.tables[req_id]), dtype=torch.int16)
        inputs.update(self._block_inputs(table, [plan.slots.get(req_id)], prefill=True))
        inputs.update(self.lora.prefill(req_id))
        if self.artifact.state_slots:  # the state row this prompt's prefill writes
            inputs["batch_idx"] = plan.slots[req_id]
        if self.embedder is not None:
            # e.g. Qwen2-VL's M-RoPE position embeddings, Qwen3-VL's deepstack features (kept
            # with the prompt's embeddings until its last chunk: later steps decode token ids)
            inputs.update(self.embedder.prefill_inputs(state, start, end))
            if end == len(tokens):
                self.embedder.forget(req_id)
        if self.before_device is not None:
            self.before_device()
        if receive is not None:  # the previous stage's hidden states, the last input to come
            inputs["input_ids"] = receive()
        if self._fault_token is not None and self._fault_token in tokens[start:end]:
            raise RuntimeError(f"injected step fault (RBLN_RAY_TEST_STEP_FAULT) in {req_id}")
        start_t = time.perf_counter()
        out = self.rbln_model.prefill_decoder(cache_position=positions, **inputs)
        self.stats.device_seconds += time.perf_counter() - start_t
        drafter = self.spec.drafter if self.spec is not None else None
        if drafter is not None and hasattr(drafter, "prefill"):  # a draft model follows
            drafter.prefill(req_id, inputs["input_ids"], positions, inputs["block_tables"])
        self.stats.prefill_steps += 1
        self.stats.prefill_tokens += end - start
        if step.starting:  # its first chunk: tokens before it came from the cache
            self.stats.prefix_reused_tokens += start
            self.stats.prefix_recomputed_tokens += step.computed - start
        if end == len(tokens):
            self.stats.prefill_requests += 1
        self.stats.record("prefill", [req_id])
        return out.logits[:, -1, :] if self.last_stage else out.logits

    def _decode(self, step: _DecodeStep, receive: Receive) -> torch.Tensor:
        x, bs, rows = step.x, step.bs, len(step.req_ids)
        if self.before_device is not None:
            self.before_device()
        if receive is not None:  # the previous stage's rows, in this same order (every rank
            x = receive()  # sorts alike), the last input to come
        start_t = time.perf_counter()
        out = self.rbln_model.decoders[bs](
            input_ids=x, cache_position=step.cache_pos, **step.inputs
        )
        self._last_decode_s = time.perf_counter() - start_t
        self.stats.device_seconds += self._last_decode_s
        self.stats.decode_steps += 1
        self.stats.decode_rows += rows
        self.stats.padded_rows += bs - rows
        self.stats.record("decode", step.req_ids)
        if not self.last_stage:
            return out.logits  # hidden states of every row, padding included
        if step.layout[:rows] == list(range(rows)):  # live rows first, in req_ids order
            return out.logits[:rows, -1, :]
        device_row = [0] * rows
        for row, i in enumerate(step.layout):
            if i is not None:
                device_row[i] = row
        return out.logits[torch.tensor(device_row), -1, :]

    # ----------------------------------------------------------------- vLLM entry points
    def execute_model(
        self, so: SchedulerOutput, receive: Receive = None
    ) -> ModelRunnerOutput | torch.Tensor | None:
        """Run the device for this step; :meth:`sample_tokens` then returns its output.

        vLLM's engine always follows a step's ``execute_model`` with ``sample_tokens`` (with the
        grammar bitmask of the step's structured-output requests), synchronously or, with
        async scheduling, while it already schedules the next step. The RBLN Ray executor
        sends both as one step to the worker's step loop (``RBLNWorker.run_step``).
        """
        return self.launch(self.prepare(so), receive)

    def _in_batch_order(self, logits: torch.Tensor, req_ids: list[str]) -> torch.Tensor:
        """Rows of ``logits`` (in ``req_ids`` order) reordered to the input batch's order."""
        batch_ids = self.input_batch.req_ids
        if batch_ids == req_ids:
            return logits
        row = {req_id: i for i, req_id in enumerate(req_ids)}
        return logits[torch.tensor([row[req_id] for req_id in batch_ids])]

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample on the host with vLLM's sampler and record the new tokens."""
        return self.sample(grammar_output)()

    def sample(self, grammar_output: GrammarOutput | None) -> Callable[[], ModelRunnerOutput]:
        """Sample now and record the new tokens; build the step's ``ModelRunnerOutput`` later.

        Split because the next step's device call needs only the tokens, and on the Ray
        executor's step loop everything else (the output object, its logprob lists) waits
        until that call is under way (:attr:`before_device`)."""
        if self._pending is None:
            return lambda: EMPTY_MODEL_RUNNER_OUTPUT
        if isinstance(self._pending, ModelRunnerOutput):  # a prompt chunk: nothing sampled
            chunk, self._pending = self._pending, None
            return lambda: chunk
        pending, self._pending = self._pending, None
        batch = self.input_batch
        req_ids = list(batch.req_ids)
        index = dict(batch.req_id_to_index)
        if len(pending) == 4:  # a verify step
            host_t = time.perf_counter()
            so, info = pending[0], pending[3]
            token_ids, logprob_lists = verify.sample_verify(self, pending, grammar_output)
            for req_id, tokens in zip(req_ids, token_ids, strict=True):
                for token in tokens:
                    self._append_token(req_id, token)
        else:
            so, logits = pending
            if grammar_output is not None:
                from vllm.v1.structured_output.utils import apply_grammar_bitmask

                apply_grammar_bitmask(so, grammar_output, batch, logits)
            sampled = self.sampler(logits, batch.sampling_metadata)
            token_ids = sampled.sampled_token_ids.tolist()
            for req_id, (token,) in zip(req_ids, token_ids, strict=True):
                self._append_token(req_id, token)
            logprobs = sampled.logprobs_tensors
            if self.spec is None:
                return lambda: ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index=index,
                    sampled_token_ids=token_ids,
                    logprobs=logprobs.tolists() if logprobs is not None else None,
                )
            host_t = time.perf_counter()
            info = self._step_info(so)
            logprob_lists = logprobs.tolists() if logprobs is not None else None
        drafter_t, calls_before = self._drafter_time()
        drafts = verify.propose(self, so, req_ids, token_ids)
        drafter_after, calls_after = self._drafter_time()
        info.draft_s, info.draft_calls = drafter_after - drafter_t, calls_after - calls_before
        info.host_s = time.perf_counter() - host_t - info.draft_s
        self.stats.draft_calls += info.draft_calls
        self.stats.draft_seconds += info.draft_s
        self.stats.spec_host_seconds += info.host_s
        self._drafts = drafts
        return lambda: RBLNRunnerOutput(
            req_ids=req_ids,
            req_id_to_index=index,
            sampled_token_ids=token_ids,
            logprobs=logprob_lists,
            rbln_spec=info,
            rbln_drafts=drafts,
        )

    def _drafter_time(self) -> tuple[float, int]:
        drafter = self.spec.drafter if self.spec is not None else None
        return getattr(drafter, "seconds", 0.0), getattr(drafter, "calls", 0)

    def _step_info(self, so: SchedulerOutput) -> SpecStepInfo:
        """The plain step just run, for the scheduler's speculation policy."""
        plan: KVStepPlan = so.rbln_plan
        if plan.kind != "decode":
            return SpecStepInfo("prefill", 0, 0, 0.0)
        rows = len(so.num_scheduled_tokens)
        sizes = self.artifact.decoder_batch_sizes
        bs = sizes[bisect.bisect_left(sizes, rows)]
        context = sum(self.requests[r].num_computed_tokens for r in so.num_scheduled_tokens)
        if any(so.scheduled_spec_decode_tokens.values()):
            raise RuntimeError("a decode step with drafts must be a verify step")
        return SpecStepInfo("decode", bs, context // max(1, rows), self._last_decode_s)

    def _append_token(self, req_id: str, token: int) -> None:
        """Record a sampled token where vLLM's sampler state (penalties, min_tokens) sees it."""
        self.requests[req_id].output_token_ids.append(token)  # the logits processors' list
        vllm_internals.record_sampled_token(self.input_batch, req_id, token)
