"""RBLN model runner: vLLM scheduler steps → optimum-rbln serving calls → sampled tokens.

Each ``SchedulerOutput`` from :class:`RBLNScheduler` is either one prefill or a batch of
decodes (DESIGN §4):
- prefill: ``model.prefill_decoder(input_ids [1,L], cache_position [1,L], block_tables [nblk])``
  returns the last token's logits;
- decode: ``model.decoders[bs](input_ids [bs,1], cache_position [bs,1], block_tables [bs,nblk])``
  where ``bs`` is the smallest compiled decoder batch size that fits the live rows. Padding
  rows (token 0, position 0) point at KV blocks no live request owns, so their writes are
  harmless, and only live rows' logits are kept.

vLLM numbers KV blocks from 1 (block 0 is its null block); RBLN blocks start at 0, hence the
``- 1`` shift. Sampling runs on the host with vLLM's own ``Sampler`` and ``InputBatch``, so every
``SamplingParams`` feature (seeds, top-p/k, penalties, logprobs, logits processors) behaves as
in vLLM.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.sampling_params import SamplingType
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from rbln_ray.vllm_plugin.artifact import CompiledArtifact

logger = logging.getLogger(__name__)

NO_BLOCK = -1  # "no block" for the runtime: used only when no free scratch block exists


@dataclass
class StepStats:
    """Counters the tests and benchmarks read: what ran, and time spent inside the device."""

    prefill_steps: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    padded_rows: int = 0
    device_seconds: float = 0.0
    # (step index, kind, request ids) of the last steps, for continuous-batching checks.
    history: list[tuple[int, str, tuple[str, ...]]] = field(default_factory=list)

    def record(self, kind: str, req_ids: list[str]) -> None:
        self.history.append((self.prefill_steps + self.decode_steps, kind, tuple(req_ids)))
        del self.history[:-4096]


class RBLNModelRunner:
    """Drives one loaded optimum-rbln decoder model for a vLLM engine."""

    def __init__(self, vllm_config: VllmConfig, artifact: CompiledArtifact, model: Any) -> None:
        self.vllm_config = vllm_config
        self.artifact = artifact
        self.model = model
        self.device = torch.device("cpu")
        model_config = vllm_config.model_config
        block_size = artifact.kvcache_block_size
        self.input_batch = InputBatch(
            max_num_reqs=vllm_config.scheduler_config.max_num_seqs,
            max_model_len=model_config.max_model_len,
            max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            device=self.device,
            vocab_size=model_config.get_vocab_size(),
            block_sizes=[block_size],
            kernel_block_sizes=[block_size],
            max_num_blocks_per_req=[artifact.blocks_per_seq],
            logitsprocs=build_logitsprocs(vllm_config, self.device, False, False, ()),
            is_pooling_model=False,
        )
        self.sampler = Sampler(logprobs_mode=model_config.logprobs_mode)
        self.requests: dict[str, CachedRequestState] = {}
        self.stats = StepStats()
        self._pending: tuple[SchedulerOutput, torch.Tensor] | None = None

    # ----------------------------------------------------------------- request state
    def _update_states(self, so: SchedulerOutput) -> None:
        """Mirror the scheduler's view of requests into ``requests`` and the input batch."""
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
        for req_id in list(batch.req_id_to_index):
            if req_id not in so.num_scheduled_tokens:
                batch.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params is not None and params.sampling_type == SamplingType.RANDOM_SEED:
                generator = torch.Generator(device="cpu")
                generator.manual_seed(params.seed)
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                mm_features=[],
                sampling_params=params,
                generator=generator,
                block_ids=tuple(list(ids) for ids in new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=[],
            )
            self.requests[new.req_id] = state
            batch.add_request(state)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = tuple(list(ids) for ids in new_blocks)
            elif new_blocks is not None:
                for ids, extra in zip(state.block_ids, new_blocks, strict=True):
                    ids.extend(extra)
            if req_id not in batch.req_id_to_index:
                batch.add_request(state)
        batch.condense()
        batch.refresh_metadata()

    def _rbln_blocks(self, state: CachedRequestState) -> list[int]:
        return [b - 1 for b in state.block_ids[0]]

    def _free_blocks(self) -> list[int]:
        """RBLN blocks no tracked request holds: safe targets for padding writes."""
        used = {b for s in self.requests.values() for b in self._rbln_blocks(s)}
        return [b for b in range(self.artifact.kvcache_num_blocks) if b not in used]

    def _block_row(self, blocks: list[int], pad: int) -> list[int]:
        width = self.artifact.blocks_per_seq
        if len(blocks) > width:
            raise RuntimeError(f"request spans {len(blocks)} KV blocks, compiled maximum {width}")
        return blocks + [pad] * (width - len(blocks))

    # ----------------------------------------------------------------- device calls
    def _prefill(self, req_id: str, num_tokens: int) -> torch.Tensor:
        state = self.requests[req_id]
        start = state.num_computed_tokens
        if start != 0:
            raise RuntimeError(
                f"request {req_id}: prefill from position {start}; RBLN prefill starts at 0 "
                "(prefix caching and chunked prefill are disabled by the platform)"
            )
        tokens = state.prompt_token_ids + state.output_token_ids
        ids = torch.tensor([tokens[:num_tokens]], dtype=torch.long)
        positions = torch.arange(num_tokens, dtype=torch.int32).unsqueeze(0)
        free = self._free_blocks()
        table = torch.tensor(
            self._block_row(self._rbln_blocks(state), free[0] if free else NO_BLOCK),
            dtype=torch.int16,
        )
        start_t = time.perf_counter()
        out = self.model.prefill_decoder(
            input_ids=ids, cache_position=positions, block_tables=table
        )
        self.stats.device_seconds += time.perf_counter() - start_t
        self.stats.prefill_steps += 1
        self.stats.record("prefill", [req_id])
        return out.logits[:, -1, :]

    def _decode(self, req_ids: list[str]) -> torch.Tensor:
        sizes = self.artifact.decoder_batch_sizes
        idx = bisect.bisect_left(sizes, len(req_ids))
        if idx == len(sizes):
            raise RuntimeError(f"{len(req_ids)} decode rows exceed the compiled batch {sizes[-1]}")
        bs = sizes[idx]
        order = list(range(len(req_ids)))
        positions = [self.requests[r].num_computed_tokens for r in req_ids]
        if self.artifact.requires_batch_sort:  # NPU kernels that need length-sorted rows
            order.sort(key=lambda i: -positions[i])
        free = self._free_blocks()
        pad_block = free[0] if free else NO_BLOCK
        # Inputs are built as lists and converted once: per-row tensor writes cost ~10 us
        # each, a measurable share of the host time per step at batch 8.
        pos = [positions[i] for i in order]
        states = [self.requests[req_ids[i]] for i in order]
        padding = bs - len(req_ids)
        ids = torch.tensor(
            [s.get_token_id(p) for s, p in zip(states, pos, strict=True)] + [0] * padding,
            dtype=torch.long,
        ).view(bs, 1)
        cache_pos = torch.tensor(pos + [0] * padding, dtype=torch.int32).view(bs, 1)
        rows = [self._block_row(self._rbln_blocks(s), pad_block) for s in states]
        for k in range(padding):  # padding rows: each its own scratch block
            rows.append(self._block_row([free[k] if k < len(free) else NO_BLOCK], pad_block))
        table = torch.tensor(rows, dtype=torch.int16)
        mask = None
        if self.artifact.use_attention_mask:
            # optimum's own decoder mask buffer is sized for the full batch; pass ours per call.
            span = torch.arange(self.artifact.max_seq_len)
            mask = (span.view(1, -1) <= cache_pos.view(-1, 1)).float().view(bs, 1, 1, -1)
        start_t = time.perf_counter()
        out = self.model.decoders[bs](
            input_ids=ids, cache_position=cache_pos, block_tables=table, attention_mask=mask
        )
        self.stats.device_seconds += time.perf_counter() - start_t
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(req_ids)
        self.stats.padded_rows += bs - len(req_ids)
        self.stats.record("decode", req_ids)
        logits = out.logits[: len(req_ids), -1, :]
        if order == sorted(order):
            return logits
        inverse = [0] * len(order)
        for row, i in enumerate(order):
            inverse[i] = row
        return logits[torch.tensor(inverse)]

    # ----------------------------------------------------------------- vLLM entry points
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run the device for this step, and sample too unless a grammar must mask the logits.

        vLLM's engine calls :meth:`sample_tokens` only when this returns None. Sampling here
        when no request uses structured output saves the engine a second call per step, which
        with the Ray executor is a second actor round trip.
        """
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        req_ids = list(self.input_batch.req_ids)
        prefills = [
            r
            for r in req_ids
            if self.requests[r].num_computed_tokens == 0 or so.num_scheduled_tokens[r] > 1
        ]
        if prefills:
            if len(req_ids) != 1:
                raise RuntimeError(
                    f"step mixes prefill {prefills} with other requests {req_ids}; the RBLN "
                    "scheduler must schedule one prefill per step"
                )
            logits = self._prefill(req_ids[0], so.num_scheduled_tokens[req_ids[0]])
        else:
            logits = self._decode(req_ids)
        self._pending = (so, logits.float())
        return None if so.has_structured_output_requests else self.sample_tokens(None)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample on the host with vLLM's sampler and record the new tokens."""
        if self._pending is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        so, logits = self._pending
        self._pending = None
        batch = self.input_batch
        if grammar_output is not None:
            from vllm.v1.structured_output.utils import apply_grammar_bitmask

            apply_grammar_bitmask(so, grammar_output, batch, logits)
        sampled = self.sampler(logits, batch.sampling_metadata)
        token_ids = sampled.sampled_token_ids.tolist()
        for req_id, (token,) in zip(batch.req_ids, token_ids, strict=True):
            self._append_token(req_id, token)
        logprobs = sampled.logprobs_tensors
        return ModelRunnerOutput(
            req_ids=list(batch.req_ids),
            req_id_to_index=dict(batch.req_id_to_index),
            sampled_token_ids=token_ids,
            logprobs=logprobs.tolists() if logprobs is not None else None,
        )

    def _append_token(self, req_id: str, token: int) -> None:
        """Record a sampled token where vLLM's sampler state (penalties, min_tokens) sees it."""
        batch = self.input_batch
        state = self.requests[req_id]
        state.output_token_ids.append(token)  # same list object the logits processors hold
        index = batch.req_id_to_index[req_id]
        end = batch.num_tokens_no_spec[index]
        batch.token_ids_cpu[index, end] = token
        batch.is_token_ids[index, end] = True
        batch.num_tokens_no_spec[index] = end + 1
