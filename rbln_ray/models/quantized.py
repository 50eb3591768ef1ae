"""Tiny pre-quantized checkpoints, built locally.

Why: quantized artifacts are tested (and demonstrated) on checkpoints built here, since
nothing may come from a model hub. A quantized checkpoint is a tiny model
(:func:`~rbln_ray.models.build_tiny_model`) with its seven projections quantized
round-to-nearest, symmetric, per output channel, in the layout llm-compressor writes and
optimum-rbln reads (``compressed-tensors``: ``weight`` int8 or float8_e4m3fn,
``weight_scale`` ``[out, 1]`` float32; fp8 KV: ``self_attn.k_scale``/``v_scale`` scalars,
calibrated from the float model's post-RoPE keys and values on local prompts). This is
round-to-nearest quantization for tests and demos, not a calibrated production recipe.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from rbln_ray.common.paths import atomic_dir, cache_dir
from rbln_ray.models.builder import TinyModelSpec, build_tiny_model

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0
INT8_MAX = 127.0
KV_MARGIN = 1.25  # fp8 KV scale = margin x calibrated amax / 448
RECIPE = 1  # bumped when what a build writes changes


def _quantize(weight: Any, weights: str) -> tuple[Any, Any]:
    """(quantized weight, fp32 scale [out, 1]) of a float weight, per output channel."""
    import torch

    amax = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    if weights == "int8":
        scale = amax / INT8_MAX
        return torch.round(weight / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale
    scale = amax / FP8_MAX
    return (weight / scale).to(torch.float8_e4m3fn), scale


def _kv_amax(model_dir: Path, num_layers: int) -> list[tuple[float, float]]:
    """Per layer, the largest |key| and |value| (after RoPE) the float model produces on a
    few fixed local prompts."""
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    seen = [[0.0, 0.0] for _ in range(num_layers)]

    def observe(module, query, key, value, attention_mask, **kw):
        i = module.layer_idx
        seen[i][0] = max(seen[i][0], float(key.abs().max()))
        seen[i][1] = max(seen[i][1], float(value.abs().max()))
        return eager_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("rbln_ray_kv_calibration", observe)
    AttentionMaskInterface.register("rbln_ray_kv_calibration", eager_mask)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="rbln_ray_kv_calibration"
    ).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for length in (16, 64, 200):
            ids = torch.randint(0, model.config.vocab_size, (1, length), generator=g)
            model(input_ids=ids)
    return [(k, v) for k, v in seen]


def _compressed_tensors_config(weights: str, kv_caches: str) -> dict[str, Any]:
    kv_scheme = None
    if kv_caches == "fp8":
        kv_scheme = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": "tensor",
            "dynamic": False,
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if weights == "int8" else "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": None,
                "weights": {
                    "num_bits": 8,
                    "type": "int" if weights == "int8" else "float",
                    "symmetric": True,
                    "strategy": "channel",
                    "dynamic": False,
                },
            }
        },
        "kv_cache_scheme": kv_scheme,
    }


def build_tiny_quantized_model(weights: str = "int8", kv_caches: str = "fp16", **spec: Any) -> Path:
    """A tiny model (``spec``: :class:`TinyModelSpec` fields) as a pre-quantized checkpoint
    with ``weights`` int8 or fp8 and ``kv_caches`` fp16 or fp8 (cached by all of them)."""
    import torch
    from safetensors.torch import load_file, save_file

    if weights not in ("int8", "fp8") or kv_caches not in ("fp16", "fp8"):
        raise ValueError(f"weights={weights!r} kv_caches={kv_caches!r}: int8|fp8, fp16|fp8")
    tiny = TinyModelSpec(**spec)
    base = build_tiny_model(tiny)
    tag = weights + ("-fp8kv" if kv_caches == "fp8" else "")
    key = hashlib.sha256(f"{tiny.key()}-{tag}-{RECIPE}".encode()).hexdigest()[:12]
    out = cache_dir() / "models" / f"tiny-{tiny.family}-{tag}-{key}"
    if (out / "config.json").exists():
        return out
    config = json.loads((base / "config.json").read_text())
    tensors = load_file(str(base / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if parts[-1] == "weight" and parts[-2] in PROJECTIONS:
            q, scale = _quantize(tensor.float(), weights)
            quantized[name] = q.contiguous()
            quantized[name[: -len("weight")] + "weight_scale"] = scale.float().contiguous()
        else:
            quantized[name] = tensor
    if kv_caches == "fp8":
        for layer, (k, v) in enumerate(_kv_amax(base, config["num_hidden_layers"])):
            prefix = f"model.layers.{layer}.self_attn."
            quantized[prefix + "k_scale"] = torch.tensor(k * KV_MARGIN / FP8_MAX)
            quantized[prefix + "v_scale"] = torch.tensor(v * KV_MARGIN / FP8_MAX)
    config["quantization_config"] = _compressed_tensors_config(weights, kv_caches)
    with atomic_dir(out) as tmp:
        for path in base.iterdir():
            if path.is_file() and path.name not in ("model.safetensors", "config.json"):
                shutil.copyfile(path, tmp / path.name)
        save_file(quantized, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return out
