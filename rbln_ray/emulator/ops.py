"""Register the custom ops importing rebel registers (CPU + Meta kernels).

- ``torch.ops.rbln_custom_ops.*``: optimum-rbln's decoder graphs: paged attention (eager and
  flash, causal and masked, ``*_kv_fp8``, attention sinks ``s_aux``), sliding-window
  attention, T5's ``paged_add_softmax_attn_decode``, the MoE expert blocks
  (``custom_moe_glu``, ``custom_moe_glu_mxfp4``), cache update and linear. optimum only
  *calls* them; names and argument names follow its ``*_architecture.py`` call sites, which
  mostly pass keyword arguments, so argument names are the contract. Trailing defaulted
  arguments are not forwarded to Python kernels, hence the defaults here. Kernels:
  :mod:`~rbln_ray.emulator.kernels`, :mod:`~rbln_ray.emulator.sliding_kernels`,
  :mod:`~rbln_ray.emulator.moe_kernels`.
- ``torch.ops.rbln.*``: the sampling ops vllm-rbln's sampler graphs call positionally
  (``argmax``, ``top_k_top_p``, ``rejection_sample``; kernels and semantics in
  :mod:`rbln_ray.emulator.sampling`), and ``tri_recur_update``, the row recurrence of
  optimum-rbln's chunked gated-delta rule (Qwen3.5's linear attention,
  :func:`tri_recur_update`). Their Meta kernels let ``torch.compile`` trace them.
"""

from __future__ import annotations

import logging

import torch

from rbln_ray.emulator import kernels, moe_kernels, sampling, sliding_kernels

logger = logging.getLogger(__name__)

NAMESPACE = "rbln_custom_ops"
SAMPLING_NAMESPACE = "rbln"
_LIB: torch.library.Library | None = None
_SAMPLING_LIB: torch.library.Library | None = None

_ATTN_HEAD = (
    "Tensor q, Tensor k, Tensor v, Tensor(a!) kcache, Tensor(b!) vcache, Tensor seq, "
    "Tensor scale, Tensor block_table, int block_size, "
)
_ATTN_TAIL = "Tensor? mask=None, bool? is_bidirectional=None, Tensor? s_aux=None) -> Tensor"
# *_kv_fp8: the cache is float8_e4m3fn; k_scale/v_scale are its per-tensor scales.
_ATTN_FP8_TAIL = (
    "Tensor? mask=None, bool? is_bidirectional=None, Tensor? k_scale=None, "
    "Tensor? v_scale=None, Tensor? s_aux=None) -> Tensor"
)
_SLIDING = (
    "Tensor q, Tensor k, Tensor v, Tensor(a!) kcache, Tensor(b!) vcache, Tensor cache_seq_len, "
    "Tensor cache_offset, Tensor scale, Tensor block_table, int block_size, "
    "bool? is_bidirectional=None, Tensor? attn_mask=None, Tensor? s_aux=None) -> Tensor"
)
_ADD_SOFTMAX = (
    "Tensor q, Tensor k, Tensor v, Tensor mask, Tensor(a!) kcache, Tensor(b!) vcache, "
    "Tensor seq, Tensor scale, Tensor block_table, int block_size) -> Tensor"
)
_MOE_GLU = (
    "Tensor hidden_states, Tensor gate_proj_weight, Tensor up_proj_weight, "
    'Tensor down_proj_weight, Tensor masked_routing_weight, str hidden_act="silu", '
    "Tensor? expert_map=None, Tensor? gate_proj_bias=None, Tensor? up_proj_bias=None, "
    "Tensor? down_proj_bias=None) -> Tensor"
)
_MOE_MXFP4 = (
    "Tensor hidden_states, Tensor gate_proj_blocks, Tensor gate_proj_scales, "
    "Tensor gate_proj_bias, Tensor up_proj_blocks, Tensor up_proj_scales, Tensor up_proj_bias, "
    "Tensor down_proj_blocks, Tensor down_proj_scales, Tensor down_proj_bias, "
    "Tensor masked_routing_weight, Tensor alpha, Tensor limit, Tensor? expert_map=None) -> Tensor"
)


def _linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    # Must not call F.linear: optimum swaps F.linear for this very op while compiling.
    return torch._C._nn.linear(input, weight, bias)


def _attn_kernel(requires_mask: bool, flash: bool, fp8: bool = False):
    """A kernel for one paged-attention variant; ``requires_mask`` marks the non-causal
    ``paged_attn_*`` / ``paged_flash_attn_*``, ``fp8`` the ``*_kv_fp8`` ones."""

    def kernel(
        q, k, v, kcache, vcache, seq, scale, block_table, block_size, *rest, **kw
    ) -> torch.Tensor:
        names = (["partition"] if flash else []) + ["mask", "is_bidirectional"]
        names += ["k_scale", "v_scale", "s_aux"] if fp8 else ["s_aux"]
        args = dict(zip(names, rest, strict=False))
        args.update(kw)
        mask = args.get("mask")
        if requires_mask and mask is None:
            raise ValueError("paged_attn_* needs an attention mask")
        if fp8 and (args.get("k_scale") is None or args.get("v_scale") is None):
            raise ValueError("*_kv_fp8 attention needs k_scale and v_scale")
        causal = not requires_mask and not bool(args.get("is_bidirectional") or False)
        if mask is not None and mask.dim() > 2:
            causal = False  # a per-query mask fully defines visibility
        inputs = (q, k, v, kcache, vcache, seq, scale, block_table, int(block_size), mask)
        extras = {name: args.get(name) for name in ("s_aux", "k_scale", "v_scale")}
        with torch.no_grad():
            return kernels.paged_attention(*inputs, causal, **extras)

    return kernel


def _attn_meta(q, *args, **kwargs) -> torch.Tensor:
    return torch.empty_like(q)


def _moe_meta(hidden_states, *args, **kwargs) -> torch.Tensor:
    return torch.empty_like(hidden_states)


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


def tri_recur_update(attn: torch.Tensor) -> torch.Tensor:
    """The row recurrence of a chunked gated-delta rule over ``[..., C, C]``: for i = 1..C-1,
    ``attn[..., i, :i] += (attn[..., i, :i, None] * attn[..., :i, :i]).sum(-2)``, each row from
    the rows above it as already updated (transformers' ``torch_chunk_gated_delta_rule``, the
    identity it adds afterwards left out, as optimum-rbln's ``rbln_chunk_gated_delta_rule``
    adds it itself). Returns a new tensor."""
    out = attn.clone()
    for i in range(1, out.shape[-1]):
        row = out[..., i, :i].clone()
        out[..., i, :i] = row + (row.unsqueeze(-1) * out[..., :i, :i]).sum(-2)
    return out


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
    lib.define("tri_recur_update(Tensor attn) -> Tensor")
    lib.impl("tri_recur_update", tri_recur_update, "CPU")
    lib.impl("tri_recur_update", lambda attn: torch.empty_like(attn), "Meta")
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
                head = _ATTN_HEAD + ("int partition, " if flash else "")
                for suffix, tail in (("", _ATTN_TAIL), ("_kv_fp8", _ATTN_FP8_TAIL)):
                    name = f"paged_{kind}attn_{phase}{suffix}"
                    lib.define(f"{name}({head}{tail}")
                    lib.impl(name, _attn_kernel(requires_mask, flash, bool(suffix)), "CPU")
                    lib.impl(name, _attn_meta, "Meta")
        name = f"paged_sliding_window_attn_{phase}"
        lib.define(f"{name}({_SLIDING}")
        lib.impl(name, getattr(sliding_kernels, f"sliding_window_{phase}"), "CPU")
        lib.impl(name, _attn_meta, "Meta")
    lib.define(f"paged_add_softmax_attn_decode({_ADD_SOFTMAX}")
    lib.impl("paged_add_softmax_attn_decode", kernels.paged_add_softmax_decode, "CPU")
    lib.impl("paged_add_softmax_attn_decode", _attn_meta, "Meta")
    for name, schema, kernel in (
        ("custom_moe_glu", _MOE_GLU, moe_kernels.moe_glu),
        ("custom_moe_glu_mxfp4", _MOE_MXFP4, moe_kernels.moe_glu_mxfp4),
    ):
        lib.define(f"{name}({schema}")
        lib.impl(name, kernel, "CPU")
        lib.impl(name, _moe_meta, "Meta")
    lib.define(
        "rbln_cache_update(Tensor(a!) cache, Tensor state, Tensor position, Tensor axis) -> Tensor"
    )
    lib.impl("rbln_cache_update", _cache_update, "CPU")
    lib.impl("rbln_cache_update", _cache_update_meta, "Meta")
    _LIB = lib
    logger.debug("registered torch.ops.%s emulator kernels", NAMESPACE)
