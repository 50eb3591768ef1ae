"""CPU reference kernels of optimum-rbln's mixture-of-experts ops.

Why: Mixtral, Qwen2-MoE and Qwen3-MoE compile their expert block to
``rbln_custom_ops.custom_moe_glu``, gpt-oss to ``custom_moe_glu_mxfp4`` (experts stored as
MXFP4); on an NPU the compiler lowers them, on CPU these functions define what they compute.

Contract (optimum-rbln 0.12 ``*_architecture.py`` call sites, ``utils/moe.py``): tokens
``hidden_states`` ``[T,H]``; per-expert weights split from transformers' fused
``gate_up_proj`` (``gate``/``up`` ``[E,I,H]``, ``down`` ``[E,H,I]``); routing already done by
the graph: ``masked_routing_weight`` ``[E,T]`` holds each token's weight for its top-k experts
and zero elsewhere. The output is ``sum_e w[e,t] * expert_e(x_t)``. Only experts that some
token routes to are computed, and each only on its tokens (as transformers' own expert loop).

``expert_map`` (vLLM-path callers only; an assumption of the emulator, not an optimum call
site): local weight row of each global expert, negative when the expert lives elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# MXFP4 (OCP microscaling): E2M1 values, low nibble first, one E8M0 scale per 32 values.
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
MXFP4_GROUP = 32


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    # Not F.linear: optimum swaps F.linear for rbln_custom_ops.linear while compiling.
    return torch._C._nn.linear(x, weight, bias)


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    acts: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "silu": torch.nn.functional.silu,
        "swish": torch.nn.functional.silu,
        "gelu": torch.nn.functional.gelu,
        "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
        "gelu_pytorch_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
        "relu": torch.nn.functional.relu,
    }
    if name not in acts:
        raise ValueError(f"custom_moe_glu: unknown hidden_act {name!r}; known: {sorted(acts)}")
    return acts[name]


def _routed(
    masked_routing_weight: torch.Tensor, expert_map: torch.Tensor | None
) -> list[tuple[int, int, torch.Tensor]]:
    """(global expert, weight row, token indices) of every expert some token routes to."""
    hit = (masked_routing_weight != 0).any(dim=1).nonzero().flatten().tolist()
    out = []
    for expert in hit:
        row = expert if expert_map is None else int(expert_map[expert])
        if row < 0:
            continue
        tokens = (masked_routing_weight[expert] != 0).nonzero().flatten()
        out.append((expert, row, tokens))
    return out


@torch.no_grad()
def moe_glu(
    hidden_states: torch.Tensor,
    gate_proj_weight: torch.Tensor,
    up_proj_weight: torch.Tensor,
    down_proj_weight: torch.Tensor,
    masked_routing_weight: torch.Tensor,
    hidden_act: str = "silu",
    expert_map: torch.Tensor | None = None,
    gate_proj_bias: torch.Tensor | None = None,
    up_proj_bias: torch.Tensor | None = None,
    down_proj_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``custom_moe_glu``: ``down(act(gate(x)) * up(x))`` per routed expert, weighted."""
    act = _activation(hidden_act)
    out = torch.zeros_like(hidden_states)
    for expert, row, tokens in _routed(masked_routing_weight, expert_map):
        x = hidden_states[tokens]

        def bias(b: torch.Tensor | None, row: int = row) -> torch.Tensor | None:
            return None if b is None else b[row]

        h = act(_linear(x, gate_proj_weight[row], bias(gate_proj_bias))) * _linear(
            x, up_proj_weight[row], bias(up_proj_bias)
        )
        y = _linear(h, down_proj_weight[row], bias(down_proj_bias))
        weight = masked_routing_weight[expert, tokens].to(y.dtype)
        out.index_add_(0, tokens, y * weight[:, None])
    return out


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """MXFP4 weights ``[..., N, K/2]`` uint8 (two E2M1 values a byte, low nibble first) with
    E8M0 scales ``[..., N, K/32]`` (exponent + 127) -> ``[..., N, K]`` in ``dtype``; exact."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    packed = blocks.to(torch.int64)
    values = torch.stack([lut[packed & 0x0F], lut[packed >> 4]], dim=-1)
    values = values.reshape(*blocks.shape[:-1], blocks.shape[-1] * 2)
    groups = values.reshape(*values.shape[:-1], -1, MXFP4_GROUP)
    exponent = scales.to(torch.int32) - 127
    if exponent.shape != groups.shape[:-1]:
        raise ValueError(
            f"MXFP4 scales {list(scales.shape)} do not match blocks {list(blocks.shape)} "
            f"({MXFP4_GROUP} values per scale)"
        )
    return (
        torch.ldexp(groups, exponent[..., None].to(torch.float32)).reshape(values.shape).to(dtype)
    )


@torch.no_grad()
def moe_glu_mxfp4(
    hidden_states: torch.Tensor,
    gate_proj_blocks: torch.Tensor,
    gate_proj_scales: torch.Tensor,
    gate_proj_bias: torch.Tensor,
    up_proj_blocks: torch.Tensor,
    up_proj_scales: torch.Tensor,
    up_proj_bias: torch.Tensor,
    down_proj_blocks: torch.Tensor,
    down_proj_scales: torch.Tensor,
    down_proj_bias: torch.Tensor,
    masked_routing_weight: torch.Tensor,
    alpha: torch.Tensor,
    limit: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """``custom_moe_glu_mxfp4``: gpt-oss experts, ``down((clamp(up) + 1) * glu(clamp(gate)))``
    with ``glu(g) = g * sigmoid(alpha * g)`` (transformers' ``GptOssExperts``)."""
    dtype = hidden_states.dtype
    a, lim = float(alpha), float(limit)
    out = torch.zeros_like(hidden_states)
    for expert, row, tokens in _routed(masked_routing_weight, expert_map):
        x = hidden_states[tokens]
        gate = _linear(x, dequantize_mxfp4(gate_proj_blocks[row], gate_proj_scales[row], dtype))
        gate = (gate + gate_proj_bias[row].to(dtype)).clamp(max=lim)
        up = _linear(x, dequantize_mxfp4(up_proj_blocks[row], up_proj_scales[row], dtype))
        up = (up + up_proj_bias[row].to(dtype)).clamp(min=-lim, max=lim)
        glu = gate * torch.sigmoid(gate * a)
        down = dequantize_mxfp4(down_proj_blocks[row], down_proj_scales[row], dtype)
        y = _linear((up + 1) * glu, down, down_proj_bias[row].to(dtype))
        weight = masked_routing_weight[expert, tokens].to(dtype)
        out.index_add_(0, tokens, y * weight[:, None])
    return out
