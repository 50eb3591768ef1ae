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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rbln_ray.common.paths import atomic_dir, cache_dir
from rbln_ray.families.registry import DECODERS
from rbln_ray.families.tiny import decoder_config
from rbln_ray.models.tokenizer import build_tokenizer

logger = logging.getLogger(__name__)

FAMILIES = tuple(DECODERS)


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
    # Sliding window (tokens) of the layers that use one; None: the family's default
    # (rbln_ray.families.tiny.DEFAULT_WINDOW for hybrid families, none for mistral).
    sliding_window: int | None = None
    num_experts: int = 4  # MoE families: experts per layer ...
    experts_per_token: int = 2  # ... and how many each token uses
    # Tokens added to the trained tokenizer as single, non-special tokens (e.g. `<think>`
    # for a reasoning parser); the model's vocabulary grows to hold them.
    added_tokens: tuple[str, ...] = ()

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

    def key_fields(self) -> dict:
        """The fields that identify this model in cache keys: its family recipe's cache-key
        history (:class:`rbln_ray.families.tiny.TinyRecipe` ``keyed_late``, ``revision``)
        decides which are left out."""
        fields = asdict(self)
        if not self.added_tokens:  # absent from every key made before the field existed
            del fields["added_tokens"]
        recipe = DECODERS[self.family].tiny
        defaults = TinyModelSpec.__dataclass_fields__
        for name in recipe.keyed_late:
            if fields[name] == defaults[name].default:
                del fields[name]
        if recipe.revision:  # a recipe changed after its first models were cached
            fields["recipe"] = recipe.revision
        return fields

    def key(self) -> str:
        digest = hashlib.sha256(json.dumps(self.key_fields(), sort_keys=True).encode())
        return digest.hexdigest()[:12]


def make_config(spec: TinyModelSpec, bos_id: int, eos_id: int, pad_id: int):
    """The transformers config object for ``spec``: its family's recipe
    (:attr:`rbln_ray.families.registry.DecoderFamily.tiny`) at the spec's shape."""
    return decoder_config(DECODERS[spec.family].tiny, spec, bos_id, eos_id, pad_id)


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
    shape = spec
    if spec.added_tokens:
        tokenizer.add_tokens(list(spec.added_tokens), special_tokens=False)
        shape = replace(spec, vocab_size=-(-len(tokenizer) // 64) * 64)
    config = make_config(
        shape, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    logger.info("building tiny %s model at %s", spec.family, out)
    with atomic_dir(out) as tmp:
        if DECODERS[spec.family].tiny.checkpoint == "mxfp4":
            _save_mxfp4(model, tmp, spec.seed)
        else:
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "rbln_ray_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    return out


def _save_mxfp4(model, out: Path, seed: int) -> None:
    """Save gpt-oss as OpenAI publishes it: experts in MXFP4 (``*_blocks``/``*_scales``), the
    rest as is, and ``quantization_config`` naming mxfp4 (what optimum-rbln 0.12 loads)."""
    from safetensors.torch import save_file

    from rbln_ray.models.mxfp4 import gpt_oss_expert_tensors

    tensors = {
        name: t.detach().contiguous()
        for name, t in model.state_dict().items()
        if ".mlp.experts." not in name
    }
    tensors.update(gpt_oss_expert_tensors(model.config, seed))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]
    model.config.quantization_config = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
