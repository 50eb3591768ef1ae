"""RBLN runner for a decoder read as a pooling model: a decoder-based embedder (Qwen3-Embedding)
or reranker (Qwen3-Reranker), each prompt through the compiled prefill graph once.

Why not the encoder runner: a decoder's compiled graph is its prefill (one sequence per call,
chunked inside at ``prefill_chunk_size``, writing KV into a compiled block), not one
``[batch, max_seq_len]`` call. A pooling engine runs nothing else on the model and keeps no
KV between steps, so every prompt may use the first KV block(s). What the prefill returns
goes to vLLM's own pooler, as plain vLLM pools the same checkpoint:

- an embedder's graph (optimum's ``RBLNQwen3Model``) returns every position's hidden state,
  which vLLM's embedding pooler reads (the last token's, normalised, for Qwen3);
- a reranker's graph is the ordinary causal LM, whose last-token logits give the relevance
  ``logit("yes") - logit("no")`` (the tokens ``classifier_from_token`` names), exactly the
  score vLLM computes with its ``from_2_way_softmax`` head (that difference of the two rows
  of the LM head, in float32), and vLLM's classification pooler applies the sigmoid.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.pooler import DispatchPooler
from vllm.model_executor.layers.pooler.seqwise import pooler_for_classify
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from rbln_ray.compile.artifact import CompiledArtifact
from rbln_ray.families.registry import PoolingDecoderFamily
from rbln_ray.vllm_plugin.kv_blocks import NO_BLOCK
from rbln_ray.vllm_plugin.model_runner import StepStats
from rbln_ray.vllm_plugin.pooling_runner import RBLNPoolingRunner

logger = logging.getLogger(__name__)


class RBLNDecoderPoolingRunner:
    """Drives one loaded optimum-rbln decoder (embedder or causal LM) for a pooling engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        artifact: CompiledArtifact,
        family: PoolingDecoderFamily,
        model: Any,
    ) -> None:
        self.artifact = artifact
        self.family = family
        self.rbln_model = model  # not ``model``: see RBLNPoolingRunner
        model_config = vllm_config.model_config
        if model_config.pooler_config is None:
            raise RuntimeError(f"{artifact.path}: the engine has no pooler_config")
        self.label_ids: tuple[int, int] | None = None
        with set_current_vllm_config(vllm_config):  # vLLM's pooler reads it while building
            if family.task == "classify":
                self.pooler = DispatchPooler(
                    {"classify": pooler_for_classify(model_config.pooler_config)}
                )
                self.label_ids = _label_token_ids(vllm_config)
            else:
                self.pooler = DispatchPooler.for_embedding(model_config.pooler_config)
        self.supported_tasks = tuple(sorted(self.pooler.get_supported_tasks()))
        self.stats = StepStats()
        self.requests: dict[str, int] = {}  # none held between steps (see RBLNPoolingRunner)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Prefill and pool every prompt of the step; each request finishes here."""
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        if so.scheduled_cached_reqs.req_ids:
            raise RuntimeError(
                f"requests {so.scheduled_cached_reqs.req_ids} scheduled again: a pooling "
                "request must finish in the step that schedules its whole prompt"
            )
        news = so.scheduled_new_reqs
        prompts = [list(n.prompt_token_ids or []) for n in news]
        states = []
        for new, prompt in zip(news, prompts, strict=True):
            if so.num_scheduled_tokens[new.req_id] != len(prompt):
                raise RuntimeError(
                    f"request {new.req_id}: {so.num_scheduled_tokens[new.req_id]} of "
                    f"{len(prompt)} prompt tokens scheduled; pooling runs whole prompts"
                )
            states.append(self._pool_input(new.req_id, prompt))
        flat = torch.cat(states)
        lens = [len(p) for p in prompts]
        ids = torch.zeros(len(prompts), max(lens), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, : lens[i]] = torch.tensor(prompt, dtype=torch.long)
        metadata = RBLNPoolingRunner._metadata(news, ids, lens)
        pooled = self.pooler(hidden_states=flat, pooling_metadata=metadata)
        req_ids = [n.req_id for n in news]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            pooler_output=[p.to("cpu") if p is not None else None for p in pooled],
        )

    def _pool_input(self, req_id: str, prompt: list[int]) -> torch.Tensor:
        """``[len(prompt), width]``: what vLLM's pooler reads at each of the prompt's
        positions (hidden states, or the relevance logit at every position, so that whichever
        position the pooler takes, it takes the sequence's score)."""
        art = self.artifact
        n = len(prompt)
        if n > art.max_seq_len:
            raise RuntimeError(f"{n} tokens exceed the compiled max_seq_len={art.max_seq_len}")
        blocks = -(-n // art.kvcache_block_size)
        if blocks > art.kvcache_num_blocks:
            raise RuntimeError(
                f"{n} tokens need {blocks} KV blocks; {art.path} has {art.kvcache_num_blocks}"
            )
        table = list(range(blocks)) + [NO_BLOCK] * (art.blocks_per_seq - blocks)
        started = time.perf_counter()
        out = self.rbln_model.prefill_decoder(
            input_ids=torch.tensor([prompt], dtype=torch.long),
            cache_position=torch.arange(n, dtype=torch.int32).unsqueeze(0),
            block_tables=torch.tensor(table, dtype=torch.int16),
        )
        self.stats.device_seconds += time.perf_counter() - started
        self.stats.prefill_steps += 1
        self.stats.prefill_requests += 1
        self.stats.prefill_tokens += n
        self.stats.record("prefill", [req_id])
        if self.label_ids is None:  # the embedder: every position's hidden state
            return out.logits[0, :n].float()
        false_id, true_id = self.label_ids
        last = out.logits[0, -1].float()
        score = (last[true_id] - last[false_id]).view(1, 1)
        return score.expand(n, 1)


def _label_token_ids(vllm_config: VllmConfig) -> tuple[int, int]:
    """The ("no", "yes") token ids of a reranker's ``classifier_from_token``, looked up as
    vLLM looks them up for its ``from_2_way_softmax`` head."""
    from vllm.tokenizers import get_tokenizer

    model_config = vllm_config.model_config
    tokens = getattr(model_config.hf_config, "classifier_from_token", None)
    if not tokens or len(tokens) != 2:
        raise RuntimeError(
            f"{model_config.model}: a reranker read from a causal LM needs two "
            f"classifier_from_token (hf_overrides), got {tokens!r}"
        )
    tokenizer = get_tokenizer(
        model_config.tokenizer,
        revision=model_config.tokenizer_revision,
        tokenizer_mode=model_config.tokenizer_mode,
        trust_remote_code=model_config.trust_remote_code,
    )
    false_id, true_id = (tokenizer.convert_tokens_to_ids(t) for t in tokens)
    return int(false_id), int(true_id)
