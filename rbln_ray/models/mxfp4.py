"""Random MXFP4 expert weights in gpt-oss's checkpoint layout, for tiny local models.

Why: optimum-rbln 0.12 compiles gpt-oss only from an MXFP4 checkpoint (its
``get_pytorch_model`` reads ``*_blocks``/``*_scales`` tensors and feeds them to
``custom_moe_glu_mxfp4``), as OpenAI publishes gpt-oss. Drawing the codes and scales directly
(instead of quantizing float weights) makes the weights exactly representable, so the
reference transformers dequantizes is the same model the compiled graph runs.

Layout (transformers' ``Mxfp4GptOssExperts``): ``gate_up_proj_blocks`` ``[E, 2I, H/32, 16]``
uint8 (gate and up rows interleaved, two E2M1 codes a byte), ``gate_up_proj_scales``
``[E, 2I, H/32]`` uint8 (E8M0: exponent + 127); ``down_proj_*`` likewise over ``[E, H, I/32]``.
"""

from __future__ import annotations

import torch

GROUP = 32  # values sharing one scale
SCALE_EXPONENTS = (-7, -4)  # 2**e; with |E2M1| <= 6 the weights stay within about +-0.4


def random_mxfp4(rows: int, cols: int, experts: int, generator: torch.Generator):
    """(blocks ``[E, rows, cols/32, 16]``, scales ``[E, rows, cols/32]``) drawn uniformly."""
    if cols % GROUP:
        raise ValueError(f"MXFP4 needs a multiple of {GROUP} input features, got {cols}")
    blocks = torch.randint(0, 256, (experts, rows, cols // GROUP, GROUP // 2), generator=generator)
    low, high = SCALE_EXPONENTS
    exponents = torch.randint(low, high + 1, (experts, rows, cols // GROUP), generator=generator)
    return blocks.to(torch.uint8), (exponents + 127).to(torch.uint8)


def gpt_oss_expert_tensors(config, seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of every layer's experts (``model.layers.{i}.mlp.experts.*``)."""
    g = torch.Generator().manual_seed(seed)
    e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
    out: dict[str, torch.Tensor] = {}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        out[prefix + "gate_up_proj_blocks"], out[prefix + "gate_up_proj_scales"] = random_mxfp4(
            2 * i, h, e, g
        )
        out[prefix + "down_proj_blocks"], out[prefix + "down_proj_scales"] = random_mxfp4(
            h, i, e, g
        )
        out[prefix + "gate_up_proj_bias"] = torch.randn(e, 2 * i, generator=g) * 0.1
        out[prefix + "down_proj_bias"] = torch.randn(e, h, generator=g) * 0.1
    return out
