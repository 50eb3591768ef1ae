"""``torch.ops.rbln.{argmax, top_k_top_p, rejection_sample}`` and ``rebel.manual_seed``
against plain-Python references (sorted lists, loops), written independently of the ops.

Random ops are checked by their support (every draw is an allowed token) and by empirical
frequencies against the reference distribution, over thousands of seeded draws (a fixed
seed makes each check deterministic; tolerances are ~5 standard deviations).
"""

from __future__ import annotations

import math

import pytest
import rebel
import torch

V = 12
DRAWS = 4000


# ---------------------------------------------------------------------------- references
def ref_argmax(row: list[float]) -> int:
    best = 0
    for i, x in enumerate(row):
        if x > row[best]:
            best = i
    return best


def ref_distribution(row: list[float], k: int | None, p: float | None) -> dict[int, float]:
    """Allowed tokens and their renormalised probabilities (module docstring semantics)."""
    ranked = sorted(range(len(row)), key=lambda i: (-row[i], i))
    if k is not None and 0 < k < len(row):
        ranked = ranked[:k]
    if p is not None and p < 1:
        total = sum(row[i] for i in ranked)
        kept, mass = [], 0.0
        for i in ranked:
            if kept and mass >= p * total:
                break
            kept.append(i)
            mass += row[i]
        ranked = kept
    total = sum(row[i] for i in ranked)
    return {i: row[i] / total for i in ranked if row[i] > 0}


def frequencies(tokens: torch.Tensor) -> dict[int, float]:
    counts = torch.bincount(tokens.reshape(-1), minlength=V).tolist()
    n = tokens.numel()
    return {i: c / n for i, c in enumerate(counts) if c}


def assert_matches(freq: dict[int, float], expected: dict[int, float], n: int) -> None:
    assert set(freq) <= set(expected), f"drew tokens outside the allowed set: {freq} {expected}"
    for tok, prob in expected.items():
        tol = 5 * math.sqrt(prob * (1 - prob) / n) + 1e-9
        assert abs(freq.get(tok, 0.0) - prob) <= tol, (tok, freq.get(tok, 0.0), prob)


def probs_row(seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, generator=g) * 1.5, -1).tolist()


# ---------------------------------------------------------------------------- argmax
def test_argmax_matches_reference_with_ties_and_masked_rows():
    rows = [
        [0.1, 3.0, 3.0, -1.0],  # tie: lowest index wins
        [-math.inf] * 4,  # all masked: 0
        [-math.inf, -math.inf, 2.0, -math.inf],
        [5.0, 5.0, 5.0, 5.0],
    ]
    got = torch.ops.rbln.argmax(torch.tensor(rows))
    assert got.dtype == torch.int64 and got.shape == (4,)
    assert got.tolist() == [ref_argmax(r) for r in rows]


# ---------------------------------------------------------------------------- top_k_top_p
CASES = [
    (None, None),  # pure multinomial
    (3, None),
    (None, 0.6),
    (4, 0.5),
    (0, None),  # k = 0: top-k off
    (V, None),  # k = V: vLLM's "no top-k"
    (None, 1.0),  # p = 1: top-p off
    (None, 0.995),  # vllm-rbln's TOP_P_CLAMP
    (1, 0.9),  # a greedy row of a mixed batch
]


@pytest.mark.parametrize(("k", "p"), CASES, ids=[f"k={k}-p={p}" for k, p in CASES])
def test_top_k_top_p_draws_from_the_reference_distribution(k, p):
    row = probs_row(seed=3)
    probs = torch.tensor([row] * DRAWS)
    kk = None if k is None else torch.full((DRAWS,), k, dtype=torch.int32)
    pp = None if p is None else torch.full((DRAWS,), p)
    rebel.manual_seed(1234)
    tokens = torch.ops.rbln.top_k_top_p(probs, kk, pp)
    assert tokens.dtype == torch.int64 and tokens.shape == (DRAWS,)
    assert_matches(frequencies(tokens), ref_distribution(row, k, p), DRAWS)


def test_top_k_one_is_argmax_even_with_ties():
    """vllm-rbln sends greedy rows of a mixed batch as top_k=1: they must never diverge."""
    rows = [[0.1, 0.4, 0.4, 0.1], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.3, 0.7]]
    probs = torch.tensor(rows).repeat(500, 1)
    k = torch.ones(probs.shape[0], dtype=torch.int32)
    got = torch.ops.rbln.top_k_top_p(probs, k, None)
    assert got.tolist() == [ref_argmax(r) for r in rows] * 500


def test_top_p_keeps_at_least_the_top_token_and_ties_rank_by_id():
    probs = torch.tensor([[0.3, 0.3, 0.2, 0.2]] * 2000)
    got = torch.ops.rbln.top_k_top_p(probs, None, torch.full((2000,), 1e-6))
    assert set(got.tolist()) == {0}
    got = torch.ops.rbln.top_k_top_p(probs, torch.full((2000,), 2, dtype=torch.int32), None)
    assert set(got.tolist()) == {0, 1}


def test_rows_without_probability_mass_give_token_zero():
    probs = torch.tensor([[0.0] * V, [math.nan] * V, [0.0] * (V - 1) + [1.0]])
    got = torch.ops.rbln.top_k_top_p(probs, None, None)
    assert got.tolist() == [0, 0, V - 1]


def test_mixed_rows_each_follow_their_own_parameters():
    rows = [probs_row(seed=s) for s in range(4)]
    params = [(1, None), (2, 0.99), (None, 0.3), (None, None)]
    n = 3000
    probs = torch.tensor(rows * n)
    k = torch.tensor([V if kk is None else kk for kk, _ in params] * n, dtype=torch.int32)
    p = torch.tensor([1.0 if pp is None else pp for _, pp in params] * n)
    rebel.manual_seed(7)
    got = torch.ops.rbln.top_k_top_p(probs, k, p).reshape(n, 4)
    for j, (row, (kk, pp)) in enumerate(zip(rows, params, strict=True)):
        assert_matches(frequencies(got[:, j]), ref_distribution(row, kk, pp), n)


def test_manual_seed_makes_draws_reproducible():
    probs = torch.tensor([probs_row(seed=5)] * 1000)
    rebel.manual_seed(42)
    first = torch.ops.rbln.top_k_top_p(probs, None, None)
    rebel.manual_seed(42)
    again = torch.ops.rbln.top_k_top_p(probs, None, None)
    rebel.manual_seed(43)
    other = torch.ops.rbln.top_k_top_p(probs, None, None)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


# ---------------------------------------------------------------------------- rejection_sample
def ref_greedy_verify(targets: list[list[float]], drafts: list[int]) -> tuple[int, int | None]:
    """(accepted, recovered token or None) of greedy verification of one request."""
    for j, (row, d) in enumerate(zip(targets, drafts, strict=True)):
        best = ref_argmax(row)
        if d != best:
            return j, best
    return len(drafts), None


def test_rejection_sample_greedy_matches_reference():
    torch.manual_seed(0)
    k_max, counts = 3, [3, 0, 2, 1]  # request 1 has no drafts; request 3 pads two rows
    batch = len(counts)
    probs = torch.softmax(torch.randn(batch * k_max, V), -1)
    argmaxes = probs.argmax(-1).tolist()
    drafts = [argmaxes[0], argmaxes[1], (argmaxes[2] + 1) % V]  # accept 2, reject the 3rd
    drafts += [(argmaxes[3] + 1) % V, argmaxes[4]]  # reject the first
    drafts += [argmaxes[5]]  # accept all
    drafts += [0] * (batch * k_max - len(drafts))  # padding rows
    cu = torch.tensor([3, 3, 5, 6], dtype=torch.int32)
    recovered, accepted = torch.ops.rbln.rejection_sample(
        torch.tensor(drafts, dtype=torch.int32),
        probs,
        cu,
        torch.ones(batch, dtype=torch.int32),
        None,
    )
    assert recovered.dtype == torch.int32 and recovered.shape == (batch, k_max)
    assert accepted.dtype == torch.int32 and accepted.shape == (batch,)
    rows, start = probs.tolist(), 0
    expected_recovered = [[0] * k_max for _ in range(batch)]
    expected_accepted = []
    for r, n in enumerate(counts):
        acc, rec = ref_greedy_verify(rows[start : start + n], drafts[start : start + n])
        expected_accepted.append(acc)
        if rec is not None:
            expected_recovered[r][acc] = rec
        start += n
    assert accepted.tolist() == expected_accepted == [2, 0, 0, 1]
    assert recovered.tolist() == expected_recovered


def test_rejection_sample_random_acceptance_and_recovery_follow_the_target():
    """One draft per request: accepted with probability q[d]; a rejection recovers from q
    without d (renormalised); q is the target filtered by top-k."""
    n = 6000
    row = probs_row(seed=11)
    ranked = sorted(range(V), key=lambda i: -row[i])
    d = ranked[1]  # the second most likely token
    top_k = 4
    q = ref_distribution(row, top_k, None)
    probs = torch.tensor([row] * n)
    rebel.manual_seed(99)
    recovered, accepted = torch.ops.rbln.rejection_sample(
        torch.full((n,), d, dtype=torch.int32),
        probs,
        torch.arange(1, n + 1, dtype=torch.int32),
        torch.full((n,), top_k, dtype=torch.int32),
        None,
    )
    rate = accepted.float().mean().item()
    assert abs(rate - q[d]) <= 5 * math.sqrt(q[d] * (1 - q[d]) / n)
    rejected = recovered[accepted == 0, 0]
    residual = {t: pr / (1 - q[d]) for t, pr in q.items() if t != d}
    assert_matches(frequencies(rejected), residual, rejected.numel())
    assert bool((recovered[accepted == 1] == 0).all())  # nothing recovered when accepted


def test_rejection_sample_never_accepts_a_token_top_k_removed():
    probs = torch.tensor([probs_row(seed=2)] * 500)
    worst = int(probs[0].argmin())
    _, accepted = torch.ops.rbln.rejection_sample(
        torch.full((500,), worst, dtype=torch.int32),
        probs,
        torch.arange(1, 501, dtype=torch.int32),
        torch.full((500,), 3, dtype=torch.int32),
        torch.full((500,), 0.9),
    )
    assert int(accepted.sum()) == 0


def test_rejection_sample_rejects_an_invalid_cumsum():
    with pytest.raises(ValueError, match="cumulative count"):
        torch.ops.rbln.rejection_sample(
            torch.zeros(4, dtype=torch.int32),
            torch.full((4, V), 1.0 / V),
            torch.tensor([3, 1], dtype=torch.int32),  # decreasing
            None,
            None,
        )
