"""``custom_moe_glu`` and ``custom_moe_glu_mxfp4`` against transformers' own MoE blocks.

Each test builds a transformers MoE block with random weights, wraps a copy with
optimum-rbln 0.12's own replacement module (which routes in the graph and calls the op),
and compares the two outputs on the same tokens. MXFP4 dequantization is checked against
transformers' ``convert_moe_packed_tensors``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from rbln_ray.emulator.moe_kernels import dequantize_mxfp4
from rbln_ray.models.mxfp4 import random_mxfp4

OPS = torch.ops.rbln_custom_ops


def _init(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def _tokens(n: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(1, n, hidden, generator=torch.Generator().manual_seed(seed))


def _compare(hf_block, rbln_cls, n_tokens: int = 9) -> None:
    x = _tokens(n_tokens, hf_block.gate.weight.shape[1], 7)
    with torch.no_grad():
        expected = hf_block(x)
        expected = expected[0] if isinstance(expected, tuple) else expected
        got = rbln_cls(copy.deepcopy(hf_block))(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_mixtral_experts_match_transformers():
    from optimum.rbln.transformers.models.mixtral.mixtral_architecture import (
        MixtralSparseMoeBlock,
    )

    config = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2
    )
    block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config).eval()
    _init(block, 1)
    _compare(block, MixtralSparseMoeBlock)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen2_moe_experts_and_shared_expert_match_transformers(norm_topk_prob):
    from optimum.rbln.transformers.models.qwen2_moe.qwen2_moe_architecture import (
        Qwen2MoeSparseMoeBlock,
    )

    config = transformers.Qwen2MoeConfig(
        hidden_size=64,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        norm_topk_prob=norm_topk_prob,
    )
    block = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(config).eval()
    _init(block, 2)
    _compare(block, Qwen2MoeSparseMoeBlock)


def test_qwen3_moe_experts_match_transformers():
    from optimum.rbln.transformers.models.qwen3_moe.qwen3_moe_architecture import (
        Qwen3MoeSparseMoeBlock,
    )

    config = transformers.Qwen3MoeConfig(
        hidden_size=64, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32
    )
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config).eval()
    _init(block, 3)
    _compare(block, Qwen3MoeSparseMoeBlock, n_tokens=1)  # a decode row
    _compare(block, Qwen3MoeSparseMoeBlock, n_tokens=16)


def test_experts_nobody_routes_to_are_skipped_and_expert_map_drops_remote_ones():
    g = torch.Generator().manual_seed(4)
    e, t, h, i = 4, 5, 16, 8
    x = torch.randn(t, h, generator=g)
    gate, up = torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g)
    down = torch.randn(e, h, i, generator=g)
    weights = torch.zeros(e, t)
    weights[1, :3] = 0.25
    weights[3, 2:] = 0.75
    gate[0] = gate[2] = float("nan")  # experts nobody routes to: computing them would show

    def expert(j, rows):
        return (torch.nn.functional.silu(x[rows] @ gate[j].T) * (x[rows] @ up[j].T)) @ down[j].T

    expected = torch.zeros(t, h)
    expected[:3] += 0.25 * expert(1, slice(0, 3))
    expected[2:] += 0.75 * expert(3, slice(2, None))
    got = OPS.custom_moe_glu(x, gate, up, down, weights, "silu")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # expert 3 lives on another rank: only expert 1 (stored in local row 0) contributes
    local = torch.stack([gate[1], gate[1]]), torch.stack([up[1], up[1]]), torch.stack([down[1]] * 2)
    remote = OPS.custom_moe_glu(x, *local, weights, "silu", torch.tensor([-1, 0, -1, -1]))
    expected_local = torch.zeros(t, h)
    expected_local[:3] = 0.25 * expert(1, slice(0, 3))
    torch.testing.assert_close(remote, expected_local, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown hidden_act"):
        OPS.custom_moe_glu(x, gate, up, down, weights, "mish")


def test_mxfp4_dequantization_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4(rows=12, cols=96, experts=3, generator=torch.Generator())
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]
    ours = dequantize_mxfp4(blocks.reshape(3, 12, -1), scales, torch.float32)  # [E, N, K]
    torch.testing.assert_close(ours, theirs.transpose(1, 2), rtol=0, atol=0)


def test_gpt_oss_mxfp4_experts_match_transformers():
    """optimum's RBLNGptOssMLP (router + custom_moe_glu_mxfp4) on MXFP4 weights equals
    transformers' GptOssMLP on the same weights dequantized."""
    from optimum.rbln.transformers.models.gpt_oss.gpt_oss_architecture import RBLNGptOssMLP
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts, convert_moe_packed_tensors
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = transformers.GptOssConfig(
        hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2
    )
    g = torch.Generator().manual_seed(5)
    gu_blocks, gu_scales = random_mxfp4(2 * 64, 64, 4, g)
    d_blocks, d_scales = random_mxfp4(64, 64, 4, g)
    gu_bias, d_bias = torch.randn(4, 128, generator=g) * 0.1, torch.randn(4, 64, generator=g) * 0.1

    reference = GptOssMLP(config).eval()
    _init(reference.router, 6)
    with torch.no_grad():
        reference.experts.gate_up_proj.copy_(
            convert_moe_packed_tensors(gu_blocks, gu_scales, dtype=torch.float32)
        )
        reference.experts.down_proj.copy_(
            convert_moe_packed_tensors(d_blocks, d_scales, dtype=torch.float32)
        )
        reference.experts.gate_up_proj_bias.copy_(gu_bias)
        reference.experts.down_proj_bias.copy_(d_bias)

    quantized = GptOssMLP(config).eval()
    quantized.router = copy.deepcopy(reference.router)
    experts = Mxfp4GptOssExperts(config)  # optimum's get_pytorch_model loads these
    experts.gate_up_proj.data, experts.down_proj.data = gu_blocks, d_blocks
    experts.register_buffer("gate_up_proj_scales", gu_scales, persistent=False)
    experts.register_buffer("down_proj_scales", d_scales, persistent=False)
    experts.gate_up_proj_bias.data, experts.down_proj_bias.data = gu_bias, d_bias
    quantized.experts = experts

    x = _tokens(11, 64, 8) * 3  # large enough that the swiglu limit clamps some values
    with torch.no_grad():
        expected = reference(x)
        expected = expected[0] if isinstance(expected, tuple) else expected
        got = RBLNGptOssMLP(quantized)(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
