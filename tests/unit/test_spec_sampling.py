"""vLLM's RejectionSampler on the host with rbln-ray's pure-torch kernels.

Greedy rows are checked token for token; random rows by their output distribution, which
rejection sampling must keep equal to the target model's (one-hot drafts as ngram proposes,
drafts with probabilities, temperature with top-k, and a token after an accepted draft).
Each distribution check draws 20 000 rows in one call; a total-variation distance under
0.02 is > 5 standard deviations of a correct sampler's noise on these 4-token vocabularies.
"""

from __future__ import annotations

import pytest
import torch

from rbln_ray.vllm_plugin.spec.sampling import rejection_sampler, spec_metadata

V = 4
N = 20_000


def sampling_metadata(batch, *, temperature=None, top_k=None, generators=None):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    greedy = temperature is None
    return SamplingMetadata(
        temperature=None if greedy else torch.full((batch,), float(temperature)),
        all_greedy=greedy,
        all_random=not greedy,
        top_p=None,
        top_k=None if top_k is None else torch.full((batch,), top_k, dtype=torch.int32),
        generators=generators or {},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


@pytest.fixture(scope="module")
def sampler():
    from vllm.config import SpeculativeConfig  # noqa: F401 - vLLM's config module loads

    return rejection_sampler(None, "raw_logprobs")


def sample(sampler, drafts, logits, meta, draft_probs=None) -> list[list[int]]:
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    md = spec_metadata(drafts)
    out = sampler(md, draft_probs, logits.clone(), meta).sampled_token_ids
    tokens, _ = RejectionSampler.parse_output(out, V)
    return tokens


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def test_greedy_accepts_while_drafts_equal_the_argmax(sampler) -> None:
    # row 0: drafts [2, 1, 3], argmax [2, 1, 0] -> 2, 1, then the argmax 0 at the mismatch
    # row 1: drafts [3], argmax [3], bonus argmax 1 -> 3, 1 (all accepted: bonus)
    # row 2: no drafts -> its bonus position's argmax 2
    # row 3: draft -1 (padding) is never accepted -> argmax 0
    argmax_rows = [2, 1, 0, 3, 3, 1, 2, 0, 2]
    logits = torch.full((len(argmax_rows), V), -5.0)
    logits[torch.arange(len(argmax_rows)), torch.tensor(argmax_rows)] = 5.0
    drafts = [[2, 1, 3], [3], [], [-1]]
    # rows of the flat logits: r0 -> 0..3 (3 drafts + bonus), r1 -> 4, 5; r2 -> 6; r3 -> 7, 8
    got = sample(sampler, drafts, logits, sampling_metadata(4))
    assert got == [[2, 1, 0], [3, 1], [2], [0]]


def test_mixed_greedy_and_random_rows_keep_greedy_rows_exact(sampler) -> None:
    logits = torch.tensor([[0.0, 9.0, 0.0, 0.0], [9.0, 0, 0, 0], [0.0, 0, 0, 0], [0.0, 0, 0, 0]])
    meta = sampling_metadata(2, temperature=1.0)
    meta.temperature[0] = 0.0  # row 0 greedy
    meta.all_random = False
    got = sample(sampler, [[1], [2]], logits, meta)
    assert got[0] == [1, 0]  # draft 1 = argmax, then the bonus argmax 0
    assert 1 <= len(got[1]) <= 2


def first_token_counts(sampler, drafts, logits_rows, meta, draft_probs=None) -> torch.Tensor:
    n = len(drafts)
    logits = logits_rows.repeat(n, 1)
    tokens = sample(sampler, drafts, logits, meta, draft_probs)
    return torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=V).float()


P = torch.tensor([0.1, 0.4, 0.2, 0.3])


def test_one_hot_drafts_keep_the_target_distribution(sampler) -> None:
    """ngram drafts (no probabilities): draft 0, unlikely under the target."""
    rows = torch.stack([P.log(), torch.zeros(V)])  # draft position, bonus position
    counts = first_token_counts(sampler, [[0]] * N, rows, sampling_metadata(N, temperature=1.0))
    assert tv(counts, P) < 0.02, counts / N


def test_drafts_with_probabilities_keep_the_target_distribution(sampler) -> None:
    q = torch.tensor([0.5, 0.2, 0.2, 0.1])
    gen = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(q, N, replacement=True, generator=gen).tolist()
    rows = torch.stack([P.log(), torch.zeros(V)])
    probs = q.repeat(N, 1)
    counts = first_token_counts(
        sampler, [[d] for d in drafts], rows, sampling_metadata(N, temperature=1.0), probs
    )
    assert tv(counts, P) < 0.02, counts / N


def test_temperature_and_top_k_apply_before_acceptance(sampler) -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, 0.5])
    target = torch.softmax(logits / 0.7, -1)
    target[0] = 0.0  # top-k 3 drops the smallest
    target /= target.sum()
    rows = torch.stack([logits, torch.zeros(V)])
    meta = sampling_metadata(N, temperature=0.7, top_k=3)
    counts = first_token_counts(sampler, [[2]] * N, rows, meta)
    assert tv(counts, target) < 0.02, counts / N


def test_token_after_an_accepted_draft_follows_its_position(sampler) -> None:
    """Three drafts [1, 3, 0]: the first output token follows position 1's distribution; when
    draft 1 was accepted the second follows position 2's (a different one)."""
    p2 = torch.tensor([0.25, 0.05, 0.3, 0.4])
    rows = torch.stack([P.log(), p2.log(), torch.zeros(V), torch.zeros(V)])
    tokens = sample(
        sampler, [[1, 3, 0]] * N, rows.repeat(N, 1), sampling_metadata(N, temperature=1.0)
    )
    first = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=V).float()
    second = torch.tensor([t[1] for t in tokens if t[0] == 1 and len(t) > 1])
    assert tv(first, P) < 0.02
    assert len(second) > 0.35 * N  # P(draft 1 accepted) = 0.4
    assert tv(torch.bincount(second, minlength=V).float(), p2) < 0.02


def test_seeded_rows_repeat(sampler) -> None:
    def once():
        gens = {i: torch.Generator().manual_seed(100 + i) for i in range(8)}
        meta = sampling_metadata(8, temperature=1.0, generators=gens)
        rows = torch.stack([P.log(), P.log(), torch.zeros(V)])
        return sample(sampler, [[2, 1]] * 8, rows.repeat(8, 1), meta)

    assert once() == once()
