"""Register the custom ops importing rebel registers (CPU + Meta kernels).

- ``torch.ops.rbln_custom_ops.*``: optimum-rbln's decoder graphs (attention, cache update,
  linear). optimum only *calls* them; names and argument names follow
  ``decoderonly_architecture.py``, which always calls them with keyword arguments, so
  argument names are the contract. Trailing defaulted arguments are not forwarded to
  Python kernels, hence the defaults here.
- ``torch.ops.rbln.*``: the sampling ops vllm-rbln's sampler graphs call positionally
  (``argmax``, ``top_k_top_p``, ``rejection_sample``; kernels and semantics in
  :mod:`rbln_ray.emulator.sampling`). Their Meta kernels let ``torch.compile`` trace them.
"""

from __future__ import annotations

import logging

import torch

from rbln_ray.emulator import kernels, sampling

logger = logging.getLogger(__name__)

NAMESPACE = "rbln_custom_ops"
SAMPLING_NAMESPACE = "rbln"
_LIB: torch.library.Library | None = None
_SAMPLING_LIB: torch.library.Library | None = None

_ATTN_TAIL = "Tensor? mask=None, bool? is_bidirectional=None, Tensor? s_aux=None) -> Tensor"
_ATTN_HEAD = (
    "Tensor q, Tensor k, Tensor v, Tensor(a!) kcache, Tensor(b!) vcache, Tensor seq, "
    "Tensor scale, Tensor block_table, int block_size, "
)


def _linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    # Must not call F.linear: optimum swaps F.linear for this very op while compiling.
    return torch._C._nn.linear(input, weight, bias)


def _attn_kernel(requires_mask: bool, flash: bool):
    """A kernel for one op variant; ``requires_mask`` marks the non-causal ``paged_attn_*``."""

    def kernel(
        q, k, v, kcache, vcache, seq, scale, block_table, block_size, *rest, **kw
    ) -> torch.Tensor:
        names = (["partition"] if flash else []) + ["mask", "is_bidirectional", "s_aux"]
        args = dict(zip(names, rest, strict=False))
        args.update(kw)
        mask = args.get("mask")
        if args.get("s_aux") is not None:
            raise NotImplementedError("attention sinks (s_aux) are not emulated")
        if requires_mask and mask is None:
            raise ValueError("paged_attn_* needs an attention mask")
        causal = not requires_mask and not bool(args.get("is_bidirectional") or False)
        if mask is not None and mask.dim() > 2:
            causal = False  # a per-query mask fully defines visibility
        with torch.no_grad():
            return kernels.paged_attention(
                q, k, v, kcache, vcache, seq, scale, block_table, int(block_size), mask, causal
            )

    return kernel


def _attn_meta(q, *args, **kwargs) -> torch.Tensor:
    return torch.empty_like(q)


def _cache_update(cache, state, position, axis):
    return kernels.cache_update(cache, state, position, axis)


def _cache_update_meta(cache, state, position, axis):
    return torch.empty_like(cache)


def _per_row_meta(x, k=None, p=None) -> torch.Tensor:
    """One int64 token id per row of ``x`` (argmax, top_k_top_p)."""
    return torch.empty(x.shape[:-1], dtype=torch.int64, device="meta")


def _rejection_meta(draft_token_ids, target_probs, cu_num_draft_tokens, top_k=None, top_p=None):
    batch = cu_num_draft_tokens.shape[0]
    width = target_probs.shape[0] // max(1, batch)
    return (
        torch.empty(batch, width, dtype=torch.int32, device="meta"),
        torch.empty(batch, dtype=torch.int32, device="meta"),
    )


def _register_sampling() -> None:
    global _SAMPLING_LIB
    if _SAMPLING_LIB is not None:
        return
    if hasattr(getattr(torch.ops, SAMPLING_NAMESPACE), "top_k_top_p"):
        logger.debug("%s already registered; not re-registering", SAMPLING_NAMESPACE)
        return
    lib = torch.library.Library(SAMPLING_NAMESPACE, "DEF")
    lib.define("argmax(Tensor logits) -> Tensor")
    lib.impl("argmax", sampling.argmax, "CPU")
    lib.impl("argmax", _per_row_meta, "Meta")
    lib.define("top_k_top_p(Tensor probs, Tensor? k=None, Tensor? p=None) -> Tensor")
    lib.impl("top_k_top_p", sampling.top_k_top_p, "CPU")
    lib.impl("top_k_top_p", _per_row_meta, "Meta")
    lib.define(
        "rejection_sample(Tensor draft_token_ids, Tensor target_probs, "
        "Tensor cu_num_draft_tokens, Tensor? top_k=None, Tensor? top_p=None) -> (Tensor, Tensor)"
    )
    lib.impl("rejection_sample", sampling.rejection_sample, "CPU")
    lib.impl("rejection_sample", _rejection_meta, "Meta")
    _SAMPLING_LIB = lib


def register() -> None:
    """Define the ops once per process (idempotent); skip if someone else already did."""
    global _LIB
    _register_sampling()
    if _LIB is not None:
        return
    if hasattr(torch.ops, NAMESPACE) and hasattr(
        getattr(torch.ops, NAMESPACE), "paged_attn_decode"
    ):
        logger.debug("%s already registered; not re-registering", NAMESPACE)
        return
    lib = torch.library.Library(NAMESPACE, "DEF")
    lib.define("linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor")
    lib.impl("linear", _linear, "CPU")
    lib.impl("linear", lambda i, w, b=None: torch._C._nn.linear(i, w, b), "Meta")
    for phase in ("prefill", "decode"):
        for flash in (False, True):
            for requires_mask in (True, False):
                kind = ("flash_" if flash else "") + ("" if requires_mask else "causal_")
                name = f"paged_{kind}attn_{phase}"
                head = _ATTN_HEAD + ("int partition, " if flash else "")
                lib.define(f"{name}({head}{_ATTN_TAIL}")
                lib.impl(name, _attn_kernel(requires_mask, flash), "CPU")
                lib.impl(name, _attn_meta, "Meta")
    lib.define(
        "rbln_cache_update(Tensor(a!) cache, Tensor state, Tensor position, Tensor axis) -> Tensor"
    )
    lib.impl("rbln_cache_update", _cache_update, "CPU")
    lib.impl("rbln_cache_update", _cache_update_meta, "Meta")
    _LIB = lib
    logger.debug("registered torch.ops.%s emulator kernels", NAMESPACE)
