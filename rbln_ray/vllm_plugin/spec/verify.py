"""Speculative decoding in the model runner: the verify step's inputs, its device call, its
rejection sampling, and the drafts for the next step.

Why apart from :mod:`rbln_ray.vllm_plugin.model_runner`: a verify step is its own kind of
step (``width`` positions a row through the artifact's verify graph, rows front- and
back-padded, then vLLM's rejection sampler), and the runner's prefill and decode paths do not
need to know how. The runner calls these functions with itself (its input batch, request
states, statistics and block tables) when a step is a verify step or samples drafts.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.outputs import DraftTokenIds

from rbln_ray.upstream import vllm_internals
from rbln_ray.vllm_plugin.kv_blocks import KVStepPlan
from rbln_ray.vllm_plugin.spec.policy import SpecStepInfo


@dataclass
class Speculator:
    """A worker's speculative-decoding parts: the artifact's verify runtimes (one per
    compiled decode batch) and the proposer."""

    verify_runtimes: dict[int, Any]
    drafter: Any  # spec.proposers.NgramDrafter | DraftModelDrafter


@dataclass
class VerifyStep:
    """A speculative-decoding verify step's device inputs (built in the runner's ``prepare``: its
    positions depend on how many drafts the previous step accepted)."""

    so: SchedulerOutput
    req_ids: list[str]  # live rows, input batch order
    bs: int
    width: int
    inputs: list[torch.Tensor]  # the verify graph's inputs, in its input order
    device_row: dict[str, int]  # request -> row of the call
    front: dict[str, int]  # request -> positions re-fed before its last token (front padding)
    drafts: dict[str, list[int]]  # request -> its drafts as scheduled


def prepare_verify(
    runner: Any, so: SchedulerOutput, plan: KVStepPlan, req_ids: list[str]
) -> VerifyStep:
    """A verify step's inputs: per row the last sampled token and its drafts, ``width``
    positions from the last sampled token's (back-padded by repeating the last real
    token; front-padded near ``max_model_len``); padding rows on the scratch block."""
    if runner.spec is None:
        raise RuntimeError("a verify step on a runner without speculative decoding")
    width = plan.width
    sizes = runner.artifact.decoder_batch_sizes
    idx = bisect.bisect_left(sizes, len(req_ids))
    if idx == len(sizes):
        raise RuntimeError(f"{len(req_ids)} verify rows exceed the compiled batch {sizes[-1]}")
    bs = sizes[idx]
    limit = runner.vllm_config.model_config.max_model_len
    rows: list[tuple[int, list[int], list[int], str]] = []  # (first position, ids, ...)
    front: dict[str, int] = {}
    drafts: dict[str, list[int]] = {}
    for r in req_ids:
        state = runner.requests[r]
        n = state.num_tokens - 1  # the last sampled token's position (no KV yet)
        mine = list(so.scheduled_spec_decode_tokens.get(r, ()))[: width - 1]
        f = max(0, n + width - limit)
        ids = [state.get_token_id(p) for p in range(n - f, n + 1)]
        ids += [max(0, d) for d in mine]  # a -1 draft (never accepted) as a valid id
        ids += [ids[-1]] * (width - len(ids))
        rows.append((n - f, ids, runner._table_row(plan.tables[r]), r))
        front[r], drafts[r] = f, mine
    order = list(range(len(rows)))
    if runner.artifact.requires_batch_sort:
        order.sort(key=lambda i: -rows[i][0])
    padding = bs - len(rows)
    scratch = plan.scratch_position
    ids = [rows[i][1] for i in order] + [[0] * width] * padding
    pos = [list(range(rows[i][0], rows[i][0] + width)) for i in order]
    pos += [list(range(scratch, scratch + width))] * padding
    tables = [rows[i][2] for i in order]
    tables += [runner._table_row([plan.scratch_block])] * padding
    cache_pos = torch.tensor(pos, dtype=torch.int32)
    inputs = [
        torch.tensor(ids, dtype=torch.long),
        cache_pos,
        torch.tensor(tables, dtype=torch.int16),
    ]
    if runner.artifact.use_attention_mask:  # one causal row per query token
        span = torch.arange(runner.artifact.max_seq_len)
        inputs.append((span.view(1, 1, 1, -1) <= cache_pos.view(bs, 1, width, 1)).float())
    device_row = {rows[i][3]: row for row, i in enumerate(order)}
    return VerifyStep(so, req_ids, bs, width, inputs, device_row, front, drafts)


def propose(
    runner: Any, so: SchedulerOutput, req_ids: list[str], sampled: list[list[int]]
) -> DraftTokenIds | None:
    """Drafts for the next step of the rows that sampled a token now (``sampled`` in
    input batch order); the scheduler says how many (0: none)."""
    k = min(so.num_spec_tokens_to_schedule, runner.num_spec_tokens(runner.vllm_config))
    if runner.spec is None or k <= 0 or not any(sampled):
        return None
    drafts = runner.spec.drafter.propose_step(runner, so, req_ids, sampled, k)
    return DraftTokenIds(list(req_ids), [list(d) for d in drafts])


def sample_verify(runner: Any, pending: Any, grammar_output: GrammarOutput | None):
    """Rejection-sample a verify step; returns (tokens per row, logprobs)."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    from rbln_ray.vllm_plugin.spec.sampling import spec_metadata

    so, logits, drafts, _ = pending
    batch = runner.input_batch
    for req_id, mine in zip(batch.req_ids, drafts, strict=True):
        # penalties and bad words see the drafts (vLLM's sampling metadata)
        vllm_internals.set_spec_tokens(batch, runner.requests[req_id], mine)
    if grammar_output is not None:
        from vllm.v1.structured_output.utils import apply_grammar_bitmask

        apply_grammar_bitmask(so, grammar_output, batch, logits)
    md = spec_metadata(drafts)
    out = runner.rejection_sampler(md, None, logits, batch.sampling_metadata)
    tokens, logprobs = RejectionSampler.parse_output(
        out.sampled_token_ids,
        runner.vllm_config.model_config.get_vocab_size(),
        logprobs_tensors=out.logprobs_tensors,
    )
    for req_id in batch.req_ids:
        vllm_internals.set_spec_tokens(batch, runner.requests[req_id], [])
    runner.stats.spec_draft_tokens += sum(len(d) for d in drafts)
    runner.stats.spec_accepted_tokens += sum(
        max(0, len(t) - 1) for t, d in zip(tokens, drafts, strict=True) if d
    )
    return tokens, logprobs


def run_verify(runner: Any, step: VerifyStep):
    """Run a verify step; its logits in vLLM's flat layout (per request in batch order:
    one row per draft, then the bonus position) and the drafts, for the runner's ``sample``."""
    if runner.before_device is not None:
        runner.before_device()
    runtime = runner.spec.verify_runtimes[step.bs]
    start_t = time.perf_counter()
    logits = runtime(*step.inputs)
    took = time.perf_counter() - start_t
    runner.stats.device_seconds += took
    runner.stats.verify_steps += 1
    runner.stats.verify_rows += len(step.req_ids)
    runner.stats.padded_rows += step.bs - len(step.req_ids)
    runner.stats.record("verify", step.req_ids)
    pieces, drafts = [], []
    for r in runner.input_batch.req_ids:
        row, f, mine = step.device_row[r], step.front[r], step.drafts[r]
        pieces.append(logits[row, f : f + len(mine) + 1])
        drafts.append(mine)
    firsts = [int(step.inputs[1][row, 0]) for row in step.device_row.values()]
    context = sum(firsts) // max(1, len(firsts))
    info = SpecStepInfo("verify", step.bs, context, took)
    return step.so, torch.cat(pieces).float(), drafts, info
