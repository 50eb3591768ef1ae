"""CPU kernels of the sampling ops rebel's compiler registers: ``torch.ops.rbln.{argmax,
top_k_top_p, rejection_sample}``, and the device RNG that ``rebel.manual_seed`` seeds.

Why: vllm-rbln 0.12.0's default sampler (``v1/sample/rbln_sampler.py``) and its rejection
sampler (``v1/sample/rbln_rejection_sampler.py``) call these ops inside graphs compiled with
``rebel.core.torch_compile.rbln_backend``; on an NPU the compiler lowers them, here these
functions define what they compute. Semantics come from those call sites (argument order,
shapes, dtypes, what the caller does with the results); where the call sites leave a choice
open, the choice is stated below and tested.

``argmax(logits [..., V]) -> [...] int64``
    Index of the largest logit in the last dimension; ties go to the lowest index (so an
    all ``-inf`` row gives 0), as ``torch.argmax``.

``top_k_top_p(probs [B, V], k [B] int | None, p [B] float | None) -> [B] int64``
    Draw one token per row from ``probs`` (already softmaxed by the caller) restricted to
    the ``k`` most probable tokens and to the smallest most-probable prefix whose mass
    reaches ``p`` (nucleus), renormalised. Ranking is by probability, ties broken by the
    lower token id, so exactly ``k`` tokens survive top-k and ``k == 1`` is exactly
    ``argmax`` (vllm-rbln encodes a greedy row of a mixed batch as ``top_k == 1``).
    ``k`` off: ``None``, ``k <= 0`` or ``k >= V`` (vLLM stores "no top-k" as ``V``).
    ``p`` off: ``None`` or ``p >= 1``; the top token is always kept. A row with no positive
    finite probability gives token 0 (what vLLM's own exponential-race sampler returns).

``rejection_sample(draft_token_ids [B*K] int, target_probs [B*K, V], cu_num_draft_tokens [B],
top_k [B] | None, top_p [B] | None) -> (recovered [B, K] int32, num_accepted [B] int32)``
    Speculative-decoding verification without draft probabilities (n-gram style: the draft
    distribution is one-hot on the draft token). Request ``r`` owns rows
    ``cu[r-1]:cu[r]`` (``cu[-1] = 0``); rows past ``cu[B-1]`` are padding and ignored. For
    its drafts in order, with ``q`` the target row filtered by ``top_k``/``top_p`` as above
    and renormalised: draft ``d`` is accepted with probability ``q[d]``; at the first
    rejection the recovered token is drawn from ``q`` with ``d`` removed (``max(q - onehot,
    0)`` renormalised; the argmax of ``q`` if nothing is left), and verification stops.
    ``num_accepted[r]`` counts accepted drafts; ``recovered[r]`` is 0 everywhere except at
    column ``num_accepted[r]`` when a draft was rejected (the call site relies on that
    layout). With ``top_k == 1`` this is greedy verification: accept while the draft is the
    argmax, recover the argmax.

Randomness comes from one ``torch.Generator`` per process (the emulated device's), seeded by
:func:`manual_seed` (``rebel.manual_seed``; vllm-rbln calls it from
``RblnPlatform.manual_seed_all``). Unseeded, it starts from torch's default seed.
"""

from __future__ import annotations

import threading

import torch

_GEN_LOCK = threading.Lock()
_GENERATOR: torch.Generator | None = None


def generator() -> torch.Generator:
    """The emulated device's random generator (created on first use)."""
    global _GENERATOR
    with _GEN_LOCK:
        if _GENERATOR is None:
            _GENERATOR = torch.Generator(device="cpu")
        return _GENERATOR


def manual_seed(seed: int) -> None:
    """``rebel.manual_seed``: seed the device RNG the sampling ops draw from."""
    generator().manual_seed(int(seed))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1)


def _keep_mask(probs: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None):
    """Boolean ``[B, V]``: tokens that survive top-k then top-p (see the module docstring)."""
    batch, vocab = probs.shape
    # Rank by probability, ties to the lower id: a stable descending sort.
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
    sorted_probs = probs.gather(-1, order)
    rank = torch.arange(vocab).expand(batch, vocab)
    keep_sorted = torch.ones(batch, vocab, dtype=torch.bool)
    if k is not None:
        kk = k.to(torch.int64).reshape(batch, 1)
        active = (kk > 0) & (kk < vocab)
        keep_sorted &= ~active | (rank < kk)
    if p is not None:
        pp = p.to(probs.dtype).reshape(batch, 1)
        masked = torch.where(keep_sorted, sorted_probs, torch.zeros_like(sorted_probs))
        total = masked.sum(-1, keepdim=True)
        # mass strictly before each token (of the top-k survivors, as a share of their mass)
        before = (masked.cumsum(-1) - masked) / torch.where(total > 0, total, 1)
        keep_sorted &= (pp >= 1) | (before < pp) | (rank == 0)
    keep = torch.zeros_like(keep_sorted)
    keep.scatter_(-1, order, keep_sorted)
    return keep


def _draw(weights: torch.Tensor) -> torch.Tensor:
    """One index per row with probability proportional to ``weights`` (exponential race).

    Rows with no positive finite weight give 0, like vLLM's ``random_sample``.
    """
    w = torch.where(torch.isfinite(weights) & (weights > 0), weights, torch.zeros_like(weights))
    q = torch.empty_like(w).exponential_(1.0, generator=generator())
    return (w / q).argmax(dim=-1)


def top_k_top_p(
    probs: torch.Tensor, k: torch.Tensor | None = None, p: torch.Tensor | None = None
) -> torch.Tensor:
    flat = probs.reshape(-1, probs.shape[-1]).to(torch.float32)
    keep = _keep_mask(flat, k, p)
    return _draw(torch.where(keep, flat, torch.zeros_like(flat))).reshape(probs.shape[:-1])


def rejection_sample(
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch = int(cu_num_draft_tokens.shape[0])
    rows, vocab = target_probs.shape
    if batch == 0 or rows % batch:
        raise ValueError(
            f"rejection_sample: {rows} draft rows do not split into {batch} requests of K rows"
        )
    width = rows // batch
    ends = cu_num_draft_tokens.to(torch.int64).tolist()
    starts = [0, *ends[:-1]]
    counts = [e - s for s, e in zip(starts, ends, strict=True)]
    if min(counts) < 0 or max(counts) > width or ends[-1] > rows:
        raise ValueError(
            f"rejection_sample: cu_num_draft_tokens {ends} is not a cumulative count of at most "
            f"{width} drafts per request over {rows} rows"
        )
    owner = torch.zeros(rows, dtype=torch.int64)
    for r, (s, e) in enumerate(zip(starts, ends, strict=True)):
        owner[s:e] = r
    probs = target_probs.to(torch.float32)
    k_rows = top_k.to(torch.int64)[owner] if top_k is not None else None
    p_rows = top_p[owner] if top_p is not None else None
    q = torch.where(_keep_mask(probs, k_rows, p_rows), probs, torch.zeros_like(probs))
    q = q / q.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    drafts = draft_token_ids.to(torch.int64).clamp(0, vocab - 1)
    # u in (0, 1]: a draft with zero target probability is never accepted
    u = 1.0 - torch.rand(rows, generator=generator())
    accept = q.gather(-1, drafts[:, None])[:, 0] >= u
    residual = q.scatter(-1, drafts[:, None], 0.0)
    empty = residual.sum(-1) <= 0
    recovered_rows = torch.where(empty, q.argmax(-1), _draw(residual))

    recovered = torch.zeros(batch, width, dtype=torch.int32)
    num_accepted = torch.zeros(batch, dtype=torch.int32)
    for r, (s, e) in enumerate(zip(starts, ends, strict=True)):
        n = 0
        while n < e - s and bool(accept[s + n]):
            n += 1
        num_accepted[r] = n
        if n < e - s:
            recovered[r, n] = int(recovered_rows[s + n])
    return recovered, num_accepted
