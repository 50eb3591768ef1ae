"""A tiny model's transformers config, as data: what a family's record says about how a small
random-weight model of it is built for tests.

Why data: every family's config is the same common shape (vocabulary, hidden size, layers,
heads, ...) with a few differences (a ``head_dim``, alternating sliding layers, expert
counts, GPT-2's own field names). A record states only the differences; :meth:`TinyRecipe.
config_kwargs` turns a shape into the config's keyword arguments, so adding a family adds a
record, not a branch. Values written ``"$name"`` are derived from the shape
(:func:`derived_values`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Sliding window of the hybrid families' tiny models: shorter than the test prompts, so the
# window matters (optimum requires window <= 32768 - prefill_chunk_size on ATOM).
DEFAULT_WINDOW = 64
# Shape fields (rbln_ray.models.TinyModelSpec) added after the first families' tiny models
# were cached: a recipe that names them in ``keyed_late`` leaves them out of its models' cache
# keys while they are at their defaults, so those models keep their directories (and compiles).
LATER_SHAPE_FIELDS = ("sliding_window", "num_experts", "experts_per_token")
# How a tiny encoder's tokenizer frames a pair of inputs (tokenizers' TemplateProcessing, the
# tokenizer's own first and last tokens for {bos} and {eos}): BERT's [CLS] A [SEP] B [SEP]
# with segment ids, RoBERTa's <s> A </s></s> B </s> in one segment. A single input is framed
# {bos} A {eos} either way.
BERT_PAIR = "{bos}:0 $A:0 {eos}:0 $B:1 {eos}:1"
ROBERTA_PAIR = "{bos}:0 $A:0 {eos}:0 {eos}:0 $B:0 {eos}:0"


@dataclass(frozen=True)
class TinyRecipe:
    """A family's tiny-model config: the transformers config class and what differs from the
    common shape."""

    config: str  # transformers config class
    fields: Mapping[str, Any] = field(default_factory=dict)  # added or overriding kwargs
    rename: Mapping[str, str] = field(default_factory=dict)  # common kwarg -> family's name
    drop: tuple[str, ...] = ()  # common kwargs the config does not take
    # How the checkpoint is saved: "" (as transformers saves it) or "mxfp4" (experts in
    # OpenAI's MXFP4 blocks and scales, as gpt-oss is published)
    checkpoint: str = ""
    # Encoders: how the tokenizer frames a pair of inputs (BERT_PAIR, ROBERTA_PAIR)
    framing: str = BERT_PAIR
    # The family's cache-key history: bumped when a recipe changes after its models were
    # cached (joins the cache key) ...
    revision: int = 0
    # ... and the shape fields added after its first models were cached (LATER_SHAPE_FIELDS),
    # left out of the key while at their defaults.
    keyed_late: tuple[str, ...] = ()

    def config_kwargs(self, common: Mapping[str, Any], derived: Mapping[str, Any]) -> dict:
        """The config's keyword arguments from the common ones and the derived values."""
        kwargs = {self.rename.get(k, k): v for k, v in common.items() if k not in self.drop}
        for key, value in self.fields.items():
            if isinstance(value, str) and value.startswith("$"):
                value = derived[value[1:]]
            kwargs[key] = value
        return kwargs


def derived_values(shape: Any) -> dict[str, Any]:
    """What ``"$name"`` values of a recipe stand for, from a decoder shape
    (:class:`rbln_ray.models.TinyModelSpec`)."""
    window = shape.sliding_window or DEFAULT_WINDOW
    return {
        "head_dim": shape.hidden_size // shape.num_heads,
        "head_dim_x2": 2 * (shape.hidden_size // shape.num_heads),
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "hidden_x4": 4 * shape.hidden_size,
        "num_heads": shape.num_heads,
        "intermediate_half": shape.intermediate_size // 2,
        "intermediate_quarter": shape.intermediate_size // 4,
        "num_experts": shape.num_experts,
        "experts_per_token": shape.experts_per_token,
        "sliding_window": shape.sliding_window,
        "window": window,
        # alternate sliding and full layers, as gemma2/gemma3/gpt-oss checkpoints do
        "hybrid": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(shape.num_layers)
        ],
        # linear attention but the last layer, as Qwen3.5's language models end
        "linear_then_full": ["linear_attention"] * (shape.num_layers - 1) + ["full_attention"],
    }


def decoder_config(recipe: TinyRecipe, shape: Any, bos_id: int, eos_id: int, pad_id: int):
    """The transformers config object of a tiny decoder of ``shape``."""
    import transformers

    common = dict(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        initializer_range=shape.initializer_range,
        tie_word_embeddings=False,
        torch_dtype="float32",
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    kwargs = recipe.config_kwargs(common, derived_values(shape))
    return getattr(transformers, recipe.config)(**kwargs)
