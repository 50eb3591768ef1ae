"""vLLM's ``RejectionSampler`` on the host: pure-torch versions of its four kernels, and the
metadata that lays a verify step's logits out the way the sampler reads them.

Why: speculative decoding on RBLN samples on the host, like every other step (the compiled
graphs return logits). vLLM's rejection sampler is the algorithm that keeps the target
model's output distribution (Leviathan et al., 2023: accept a draft ``d`` with probability
``min(1, p(d)/q(d))``, else sample from ``max(p - q, 0)``; greedy rows accept while the draft
equals the argmax); only its four Triton kernels cannot run here, so they are replaced by the
functions below, which do exactly what the kernels do row by row (same inputs, same uniform
draws and exponential race, same ``-1`` = always-rejected draft convention), installed on
vLLM's dispatchers by :func:`rbln_ray.upstream.vllm_internals.install_rejection_kernels`.
Everything else (penalties, temperature, top-k/top-p, seeded generators, logprobs, bonus
tokens, synthetic acceptance) is vLLM's own code.
"""

from __future__ import annotations

import itertools

import torch

from rbln_ray.upstream import vllm_internals


def _bounds(cu: torch.Tensor) -> list[tuple[int, int]]:
    ends = cu.to(torch.int64).tolist()
    return list(itertools.pairwise([0, *ends]))


def expand(output, input, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: A002, N803
    """Row ``r``'s value ``input[r]`` (``replace_from`` -> ``replace_to``) at its tokens."""
    values = torch.where(
        input == replace_from, torch.as_tensor(replace_to, dtype=input.dtype), input
    )
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=torch.zeros(1, dtype=torch.int64))
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


def rejection_greedy_sample(
    output_token_ids,
    cu_num_draft_tokens,
    draft_token_ids,
    target_argmax,
    bonus_token_ids,
    is_greedy,
    max_spec_len,
    uniform_probs=None,
    synthetic_conditional_rates=None,
    SYNTHETIC_MODE=False,  # noqa: N803
):
    """Greedy rows: the target's argmax at every position up to the first draft that differs
    from it, the bonus token when every draft matched (synthetic mode: accept with the given
    per-position rate instead, as vLLM's kernel does)."""
    greedy = None if is_greedy is None else is_greedy.tolist()
    drafts = draft_token_ids.tolist()
    argmax = target_argmax.tolist()
    bonus = bonus_token_ids.view(-1).tolist()
    uniform = uniform_probs.tolist() if SYNTHETIC_MODE else None
    rates = synthetic_conditional_rates.tolist() if SYNTHETIC_MODE else None
    for r, (s, e) in enumerate(_bounds(cu_num_draft_tokens)):
        if greedy is not None and not greedy[r]:
            continue
        rejected = False
        for pos in range(e - s):
            draft, target = drafts[s + pos], argmax[s + pos]
            if SYNTHETIC_MODE:
                accepted = uniform[s + pos] < rates[pos] and draft >= 0
                token, rejected = (draft if accepted else target), not accepted
            else:
                token, rejected = target, draft != target
            output_token_ids[r, pos] = token
            if rejected:
                break
        if not rejected:
            output_token_ids[r, e - s] = bonus[r]


def rejection_random_sample(
    output_token_ids,
    cu_num_draft_tokens,
    draft_token_ids,
    draft_probs,
    target_probs,
    bonus_token_ids,
    recovered_token_ids,
    uniform_probs,
    is_greedy,
    max_spec_len,
    synthetic_conditional_rates=None,
    vocab_size=None,
    NO_DRAFT_PROBS=False,  # noqa: N803
    SYNTHETIC_MODE=False,  # noqa: N803
):
    """Random rows: accept draft ``d`` iff ``p(d) / q(d) >= u`` (``q(d) = 1`` without draft
    probabilities: one-hot drafts); at the first rejection the recovered token, else the
    bonus token. A negative draft id is always rejected."""
    greedy = is_greedy.tolist()
    drafts = draft_token_ids.tolist()
    uniform = uniform_probs.tolist()
    recovered = recovered_token_ids.tolist()
    bonus = bonus_token_ids.view(-1).tolist()
    rates = synthetic_conditional_rates.tolist() if SYNTHETIC_MODE else None
    for r, (s, e) in enumerate(_bounds(cu_num_draft_tokens)):
        if greedy[r]:
            continue
        rejected = False
        for pos in range(e - s):
            i, draft = s + pos, drafts[s + pos]
            if draft < 0:
                accepted = False
            elif SYNTHETIC_MODE:
                accepted = uniform[i] < rates[pos]
            else:
                q = 1.0 if NO_DRAFT_PROBS else float(draft_probs[i, draft])
                accepted = q > 0 and float(target_probs[i, draft]) / q >= uniform[i]
            if accepted:
                output_token_ids[r, pos] = draft
            else:
                output_token_ids[r, pos] = recovered[i]
                rejected = True
                break
        if not rejected:
            output_token_ids[r, e - s] = bonus[r]


def sample_recovered_tokens(
    output_token_ids,
    cu_num_draft_tokens,
    draft_token_ids,
    draft_probs,
    target_probs,
    inv_q,
    vocab_size=None,
    BLOCK_SIZE=None,  # noqa: N803
    NO_DRAFT_PROBS=False,  # noqa: N803
    USE_FP64_GUMBEL=False,  # noqa: N803
):
    """Each draft position's token drawn from ``max(p - q, 0)`` (``p`` without the draft
    token for one-hot drafts) by the exponential race ``argmax(prob / E)`` with the
    request's ``E ~ Exp(1)`` (``inv_q = 1/E``), as vLLM's kernel."""
    counts = torch.diff(
        cu_num_draft_tokens.to(torch.int64), prepend=torch.zeros(1, dtype=torch.int64)
    )
    if not int(counts.sum()):
        return
    rows = torch.repeat_interleave(torch.arange(len(counts)), counts)
    n = rows.numel()
    if NO_DRAFT_PROBS:
        prob = target_probs[:n].clone()
        drafts = draft_token_ids[:n].to(torch.int64)
        valid = drafts >= 0
        prob[torch.arange(n)[valid], drafts[valid]] = 0.0
    else:
        prob = (target_probs[:n] - draft_probs[:n]).clamp_min(0.0)
    score = prob.to(inv_q.dtype) * inv_q[rows]
    output_token_ids[:n] = score.argmax(dim=-1).to(output_token_ids.dtype)


KERNELS = {
    "_rejection_greedy_sample": rejection_greedy_sample,
    "_rejection_random_sample": rejection_random_sample,
    "_expand": expand,
    "_sample_recovered_tokens": sample_recovered_tokens,
}


def install() -> None:
    """Make vLLM's ``RejectionSampler`` run on the host (idempotent, per process)."""
    vllm_internals.install_rejection_kernels(KERNELS)


def rejection_sampler(spec_config, logprobs_mode):
    """vLLM's ``RejectionSampler`` (with its own ``Sampler`` for bonus tokens), runnable on
    the host."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    install()
    return RejectionSampler(Sampler(logprobs_mode=logprobs_mode), spec_config, torch.device("cpu"))


def spec_metadata(drafts: list[list[int]]):
    """vLLM's ``SpecDecodeMetadata`` for rows with ``drafts[r]`` draft tokens each, whose
    logits are laid out row after row: ``len(drafts[r]) + 1`` rows each (one per draft, then
    the bonus position), as :func:`flat_logits` returns them."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    num_drafts = [len(d) for d in drafts]
    cu_drafts = list(itertools.accumulate(num_drafts))
    cu_sampled = list(itertools.accumulate(n + 1 for n in num_drafts))
    starts = [c - n - 1 for c, n in zip(cu_sampled, num_drafts, strict=True)]
    target = [s + i for s, n in zip(starts, num_drafts, strict=True) for i in range(n)]
    bonus = [s + n for s, n in zip(starts, num_drafts, strict=True)]

    def int32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    return SpecDecodeMetadata(
        draft_token_ids=int32([t for d in drafts for t in d]),
        num_draft_tokens=num_drafts,
        cu_num_draft_tokens=int32(cu_drafts),
        cu_num_sampled_tokens=int32(cu_sampled),
        target_logits_indices=int32(target),
        bonus_logits_indices=int32(bonus),
        logits_indices=torch.arange(cu_sampled[-1] if cu_sampled else 0, dtype=torch.int32),
    )
