"""RBLN pooling runner: a vLLM step of whole prompts → one compiled encoder call → vLLM's pooler.

Embedding models and cross-encoder rerankers alike (``EncoderFamily.task``).

Each step holds up to the compiled ``batch_size`` new prompts (vLLM's scheduler, configured by
the platform: no chunking, ``max_num_seqs = batch_size``). They are padded to the compiled
``[batch_size, max_seq_len]`` shape with an attention mask that hides the padding, run in one
device call, and each row's hidden states (its own tokens only) go to vLLM's own pooler, built
from the engine's ``pooler_config`` just as plain vLLM builds it for the same architecture
(CLS, mean, ... and normalisation, a sentence-transformers projector if the model has one). So
the embeddings are plain vLLM's, computed on RBLN.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.pooler import DispatchPooler
from vllm.model_executor.layers.pooler.seqwise import pooler_for_classify
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.pool.metadata import PoolingMetadata, PoolingStates

from rbln_ray.compile.encoders import EncoderArtifact
from rbln_ray.vllm_plugin.model_runner import StepStats

logger = logging.getLogger(__name__)


class RBLNPoolingRunner:
    """Drives one loaded optimum-rbln encoder for a vLLM pooling engine."""

    def __init__(self, vllm_config: VllmConfig, artifact: EncoderArtifact, model: Any) -> None:
        self.artifact = artifact
        # Not ``model``: vLLM 0.30's in-process engine walks ``model_runner.model.modules()``
        # at exit (LLMEngine._cleanup_instance_caches); an optimum-rbln model is no nn.Module.
        self.rbln_model = model
        model_config = vllm_config.model_config
        if model_config.pooler_config is None:
            raise RuntimeError(f"{artifact.path}: the engine has no pooler_config")
        with set_current_vllm_config(vllm_config):  # vLLM's pooler reads it while building
            if artifact.family.task == "classify":
                # The compiled graph ends in the model's sequence classifier: no head left to
                # apply, and no per-token states to classify (so no "token_classify").
                self.pooler = DispatchPooler(
                    {"classify": pooler_for_classify(model_config.pooler_config)}
                )
            else:
                self.pooler = DispatchPooler.for_embedding(model_config.pooler_config)
        self.supported_tasks = tuple(sorted(self.pooler.get_supported_tasks()))
        # Masked out (never attended to, never pooled); the model's own padding id, since
        # RoBERTa numbers its positions from the tokens that are not padding.
        self.pad_id = getattr(model_config.hf_config, "pad_token_id", None) or 0
        self.stats = StepStats()
        # Requests held between steps (the worker's slots-in-use gauge reads it): an encoder
        # finishes every request in the step that schedules it, so none.
        self.requests: dict[str, int] = {}

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Encode and pool every prompt of the step; each request finishes here."""
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        if so.scheduled_cached_reqs.req_ids:
            raise RuntimeError(
                f"requests {so.scheduled_cached_reqs.req_ids} scheduled again: an encoder "
                "request must finish in the step that schedules its whole prompt"
            )
        news = so.scheduled_new_reqs
        art = self.artifact
        if len(news) > art.batch_size:
            raise RuntimeError(f"{len(news)} prompts exceed the compiled batch {art.batch_size}")
        prompts = [list(n.prompt_token_ids or []) for n in news]
        for new, prompt in zip(news, prompts, strict=True):
            if so.num_scheduled_tokens[new.req_id] != len(prompt):
                raise RuntimeError(
                    f"request {new.req_id}: {so.num_scheduled_tokens[new.req_id]} of "
                    f"{len(prompt)} prompt tokens scheduled; encoders run whole prompts"
                )
            if len(prompt) > art.max_seq_len:
                raise RuntimeError(
                    f"request {new.req_id}: {len(prompt)} tokens exceed the compiled "
                    f"max_seq_len={art.max_seq_len}"
                )
        lens = [len(p) for p in prompts]
        # Padded once: the device call takes all rows, vLLM's pooler the real ones.
        ids = torch.full((art.batch_size, art.max_seq_len), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(prompts):
            ids[i, : lens[i]] = torch.tensor(prompt, dtype=torch.long)
            mask[i, : lens[i]] = 1
        segments = [self._segment_start(n, n_tok) for n, n_tok in zip(news, lens, strict=True)]
        hidden = self._encode(ids, mask, lens, segments)
        flat = torch.cat([hidden[i, :n] for i, n in enumerate(lens)])
        metadata = self._metadata(news, ids[: len(lens)], lens)
        pooled = self.pooler(hidden_states=flat, pooling_metadata=metadata)
        req_ids = [n.req_id for n in news]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            pooler_output=[p.to("cpu") if p is not None else None for p in pooled],
        )

    @staticmethod
    def _segment_start(new: Any, length: int) -> int:
        """Where a prompt's second segment starts (its ``length`` when it has one segment):
        vLLM's score and rerank requests of a cross-encoder that takes segment ids say so in
        the pooling params (``compressed_token_type_ids``), as vLLM's own runner reads them."""
        extra = getattr(new.pooling_params, "extra_kwargs", None) or {}
        start = extra.get("compressed_token_type_ids")
        return length if start is None else int(start)

    def _encode(
        self, ids: torch.Tensor, mask: torch.Tensor, lens: list[int], segments: list[int]
    ) -> torch.Tensor:
        """One compiled call on the padded ``[batch_size, max_seq_len]`` inputs (the first
        ``len(lens)`` rows real): every position's hidden state (or its sequence's logits).
        ``segments``: where each row's second segment starts (segment id 1 from there on)."""
        art = self.artifact
        inputs = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in art.input_names:
            types = torch.zeros_like(ids)
            for i, (start, n) in enumerate(zip(segments, lens, strict=True)):
                types[i, start:n] = 1
            inputs["token_type_ids"] = types
        started = time.perf_counter()
        out = self.rbln_model(**inputs)
        self.stats.device_seconds += time.perf_counter() - started
        self.stats.prefill_steps += 1
        self.stats.prefill_requests += len(lens)
        self.stats.prefill_tokens += sum(lens)
        self.stats.padded_rows += art.batch_size - len(lens)
        if self.artifact.family.task == "classify":
            # One row of logits per sequence, repeated over its positions: whichever of its
            # tokens vLLM's sequence pooler takes (CLS, last, mean), it takes the logits.
            logits = out.logits if hasattr(out, "logits") else out[0]
            return logits.float()[:, None, :].expand(-1, art.max_seq_len, -1)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return hidden.float()

    @staticmethod
    def _metadata(news: list[Any], token_ids: torch.Tensor, lens: list[int]) -> PoolingMetadata:
        """vLLM's pooling metadata of the step (``token_ids``: one padded row per prompt)."""
        prompt_lens = torch.tensor(lens, dtype=torch.int32)
        metadata = PoolingMetadata(
            prompt_lens=prompt_lens,
            prompt_token_ids=token_ids,
            prompt_token_ids_cpu=token_ids,
            pooling_params=[n.pooling_params for n in news],
            pooling_states=[PoolingStates() for _ in news],
        )
        scheduled = np.array(lens, dtype=np.int64)  # whole prompts: scheduled == prompt length
        metadata.build_pooling_cursor(scheduled, prompt_lens, torch.device("cpu"))
        return metadata
