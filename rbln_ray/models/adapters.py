"""Tiny LoRA adapters, built locally.

Why: compiled-in adapters are tested (and demonstrated) on adapters built here, since nothing
may come from a model hub. An adapter is a PEFT LoRA directory (``adapter_config.json`` +
``adapter_model.safetensors``, written directly: ``peft`` is not needed) with random,
non-zero A and B (PEFT initialises B to zero, which would make an adapter a no-op and a test
of it pointless).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from rbln_ray.common.paths import atomic_dir, cache_dir


def build_tiny_adapter(
    model_dir: str | Path,
    r: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int = 1,
    scale: float = 0.1,
    *,
    use_rslora: bool = False,
) -> Path:
    """A PEFT LoRA adapter for the tiny model at ``model_dir``: for every layer and target,
    ``lora_A = scale * randn(r, in)`` and ``lora_B = scale * randn(out, r)`` (seeded);
    cached by its arguments and the model's config."""
    import torch
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    args = {
        "model": hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:12],
        "r": r,
        "alpha": alpha,
        "targets": list(targets),
        "seed": seed,
        "scale": scale,
        "rslora": use_rslora,
    }
    key = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:12]
    out = cache_dir() / "adapters" / f"{model_dir.name}-r{r}-{key}"
    if (out / "adapter_config.json").exists():
        return out
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    dims = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for proj in targets:
            module = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key_base = f"base_model.model.model.layers.{layer}.{module}.{proj}"
            fan_in, fan_out = dims[proj]
            tensors[key_base + ".lora_A.weight"] = torch.randn(r, fan_in, generator=g) * scale
            tensors[key_base + ".lora_B.weight"] = torch.randn(fan_out, r, generator=g) * scale
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": use_rslora,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "base_model_name_or_path": str(model_dir),
        "inference_mode": True,
    }
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out
