"""RBLN speech runner: vLLM scheduler steps of an encoder-decoder (Whisper) → optimum-rbln's
compiled encoder and decoder → tokens sampled with vLLM's sampler.

The compiled graphs (:mod:`rbln_ray.compile.speech`) decide the shape of a step:

- the **encoder** runs once per request, in the step vLLM schedules its audio
  (``scheduled_encoder_inputs``: a new request, or one resumed from scratch), on one 30-second
  window of log-mel features, and writes the request's cross-attention keys and values into
  the slot of its row;
- the **decoder** takes all ``batch_size`` rows in every call, one token each, each row at its
  own position. A request's row is fixed for its life: its vLLM block id minus one (block 0
  is vLLM's null block), which is also its self-attention block and its cross-attention slot,
  because optimum's decoder reads row *i*'s cross-attention from slot *i*. A row no request
  scheduled in a call writes the scratch block at position 0 and its output is dropped.

A step may hold new requests (their decoder prompt, e.g. ``<|startoftranscript|><|en|>
<|transcribe|><|notimestamps|>``, k tokens) and decoding ones (one token each): it takes
``max k`` decoder calls; call *j* carries every request's *j*-th token, so decoding rows join
the first call and prompts share the calls. Every scheduled request samples from the logits
of its last token (vLLM schedules an encoder-decoder prompt whole: no chunked prefill), with
vLLM's own ``Sampler`` and ``InputBatch``, so ``allowed_token_ids`` (language detection) and
logprobs (``verbose_json`` segments) behave as in vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from rbln_ray.compile.speech import SpeechArtifact
from rbln_ray.upstream import vllm_internals
from rbln_ray.vllm_plugin.model_runner import StepStats, new_request_state, take_blocks

logger = logging.getLogger(__name__)


@dataclass
class SpeechStepStats(StepStats):
    """:class:`StepStats` plus the encoder's calls (one per request started)."""

    encoder_calls: int = 0
    # Decoder calls that ran several requests' rows at once (continuous batching).
    shared_calls: int = 0


class RBLNSpeechRunner:
    """Drives one loaded optimum-rbln Whisper model for a vLLM engine."""

    def __init__(self, vllm_config: VllmConfig, artifact: SpeechArtifact, model: Any) -> None:
        self.artifact = artifact
        # Not ``model``: vLLM's in-process engine walks ``model_runner.model.modules()``.
        self.rbln_model = model
        self.dtype = getattr(torch, artifact.dtype)
        self.device = torch.device("cpu")
        model_config = vllm_config.model_config
        sched = vllm_config.scheduler_config
        block = artifact.kvcache_block_size
        self.input_batch = InputBatch(
            max_num_reqs=sched.max_num_seqs,
            max_model_len=model_config.max_model_len,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            device=self.device,
            vocab_size=model_config.get_vocab_size(),
            block_sizes=[block],
            kernel_block_sizes=[block],
            max_num_blocks_per_req=[1],
            logitsprocs=build_logitsprocs(vllm_config, self.device, False, False, ()),
            is_pooling_model=False,
        )
        self.sampler = Sampler(logprobs_mode=model_config.logprobs_mode)
        self.requests: dict[str, CachedRequestState] = {}
        self.stats = SpeechStepStats()
        self._pending: tuple[SchedulerOutput, torch.Tensor] | None = None
        # Set by the worker's step loop: called once a step's inputs are built, before its
        # first device call (the previous step's output then leaves while the device works).
        self.before_device: Callable[[], None] | None = None

    # ----------------------------------------------------------------- request state
    def _update_states(self, so: SchedulerOutput) -> None:
        """Mirror the scheduler's requests into ``requests`` and vLLM's input batch."""
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
        for req_id in list(batch.req_id_to_index):
            if req_id not in so.num_scheduled_tokens:
                batch.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            state = new_request_state(new)
            self.requests[new.req_id] = state
            batch.add_request(state)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            take_blocks(state, cached.new_block_ids[i], req_id in cached.resumed_req_ids)
            if req_id not in batch.req_id_to_index:
                batch.add_request(state)
        batch.condense()
        batch.refresh_metadata()

    def row_of(self, req_id: str) -> int:
        """The request's decoder row, self-attention block and cross-attention slot."""
        blocks = self.requests[req_id].block_ids[0]
        row = blocks[0] - 1 if len(blocks) == 1 else -1
        if not 0 <= row < self.artifact.batch_size:
            raise RuntimeError(
                f"request {req_id} holds vLLM blocks {blocks}; a speech request holds one of "
                f"1..{self.artifact.batch_size} (the platform sizes vLLM's pool so)"
            )
        return row

    # ----------------------------------------------------------------- device calls
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run the step's encoder and decoder calls; :meth:`sample_tokens` returns its
        output."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        req_ids = list(self.input_batch.req_ids)  # the sampler's row order
        rows = {r: self.row_of(r) for r in req_ids}
        if len(set(rows.values())) != len(rows):
            raise RuntimeError(f"two requests share a decoder row: {rows}")
        feeds: dict[str, tuple[int, list[int]]] = {}
        for r in req_ids:
            state = self.requests[r]
            start, n = state.num_computed_tokens, so.num_scheduled_tokens[r]
            tokens = (state.prompt_token_ids or []) + state.output_token_ids
            if start + n != len(tokens):
                raise RuntimeError(
                    f"request {r}: tokens {start}..{start + n} of {len(tokens)} scheduled; "
                    "an encoder-decoder's prompt is scheduled whole"
                )
            feeds[r] = (start, tokens[start:])
        if self.before_device is not None:
            self.before_device()
        for r in so.scheduled_encoder_inputs:
            self._encode(r, rows[r])
        last = self._decode(rows, feeds)
        self._pending = (so, torch.stack([last[r] for r in req_ids]).float())
        return None

    def _encode(self, req_id: str, row: int) -> None:
        """The request's audio window through the compiled encoder, into its row's slot."""
        features = self.requests[req_id].mm_features
        if len(features) != 1 or features[0].data is None:
            raise RuntimeError(f"request {req_id}: expected one audio input, got {features}")
        mel = features[0].data.get_data()["input_features"]
        mel = mel.to(self.dtype).reshape(1, *mel.shape[-2:]).contiguous()
        started = time.perf_counter()
        self.rbln_model.encoder(
            input_features=mel, block_tables=torch.tensor([row], dtype=torch.int16)
        )
        self.stats.device_seconds += time.perf_counter() - started
        self.stats.encoder_calls += 1

    def _decode(
        self, rows: dict[str, int], feeds: dict[str, tuple[int, list[int]]]
    ) -> dict[str, torch.Tensor]:
        """The decoder calls of a step: call *j* carries each request's *j*-th token in its
        row. Returns each request's logits after its last token."""
        art = self.artifact
        width = art.batch_size
        last: dict[str, torch.Tensor] = {}
        for j in range(max(len(tokens) for _, tokens in feeds.values())):
            ids = [0] * width
            positions = [0] * width
            blocks = [art.scratch_block] * width
            live = []
            for r, (start, tokens) in feeds.items():
                if j < len(tokens):
                    row = rows[r]
                    ids[row], positions[row], blocks[row] = tokens[j], start + j, row
                    live.append(r)
            inputs: dict[str, Any] = {
                "decoder_input_ids": torch.tensor(ids, dtype=torch.long).view(width, 1),
                "cache_position": torch.tensor(positions, dtype=torch.int32).view(width, 1),
                "block_tables": torch.tensor(blocks, dtype=torch.int16).view(width, 1),
            }
            if art.use_attention_mask:  # optimum's runtime fills each row's mask in place
                inputs["decoder_attention_mask"] = torch.zeros(
                    width, art.max_seq_len, dtype=self.dtype
                )
            started = time.perf_counter()
            logits = self.rbln_model.decoder(**inputs).logits
            self.stats.device_seconds += time.perf_counter() - started
            self.stats.decode_steps += 1
            self.stats.decode_rows += len(live)
            self.stats.padded_rows += width - len(live)
            self.stats.shared_calls += len(live) > 1
            self.stats.record("decode", live)
            for r in live:
                if j == len(feeds[r][1]) - 1:
                    last[r] = logits[rows[r], -1]
        return last

    # ----------------------------------------------------------------- sampling
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return self.sample(grammar_output)()

    def sample(self, grammar_output: GrammarOutput | None) -> Callable[[], ModelRunnerOutput]:
        """Sample the step's tokens now (vLLM's sampler), build its output later (the worker's
        step loop sends it once the next step's device calls started)."""
        if self._pending is None:
            return lambda: EMPTY_MODEL_RUNNER_OUTPUT
        so, logits = self._pending
        self._pending = None
        batch = self.input_batch
        if grammar_output is not None:
            from vllm.v1.structured_output.utils import apply_grammar_bitmask

            apply_grammar_bitmask(so, grammar_output, batch, logits)
        sampled = self.sampler(logits, batch.sampling_metadata)
        token_ids = sampled.sampled_token_ids.tolist()
        req_ids = list(batch.req_ids)
        for req_id, (token,) in zip(req_ids, token_ids, strict=True):
            self.requests[req_id].output_token_ids.append(token)
            vllm_internals.record_sampled_token(batch, req_id, token)
        index = dict(batch.req_id_to_index)
        logprobs = sampled.logprobs_tensors
        return lambda: ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index=index,
            sampled_token_ids=token_ids,
            logprobs=logprobs.tolists() if logprobs is not None else None,
        )
