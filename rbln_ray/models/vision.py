"""Deterministic tiny vision-language models of the families rbln-ray serves with images.

Why: the vision-language tests compare rbln-ray with transformers' own ``generate`` on the
same weights and the same processor inputs, which needs a real Hugging Face directory (model,
tokenizer with the family's image tokens, image processor, chat template), built offline.
The shape is common to every family (:class:`TinyVisionLanguageSpec`); the recipe (configs,
PIL image processor: the project venv has no torchvision) is the family's code, its contract's
``tiny_model`` (:class:`rbln_ray.families.contract.VisionCode`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from rbln_ray.common.paths import atomic_dir, cache_dir
from rbln_ray.families.contract import GENERATION_PROMPT
from rbln_ray.families.registry import VISION
from rbln_ray.models.builder import TinyModelSpec
from rbln_ray.models.tokenizer import build_tokenizer

logger = logging.getLogger(__name__)


def chat_template(image: str, generation_prompt: str = GENERATION_PROMPT) -> str:
    """The local tokenizer's chat template, with OpenAI-style content parts: an image part
    renders as ``image`` (the family's placeholder) where it stands (vLLM renders chat
    messages with it, and so does the transformers reference through the processor)."""
    return (
        "{% for m in messages %}<|{{ m['role'] }}|>\n"
        "{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for part in m['content'] %}"
        "{% if part['type'] in ('image', 'image_url') %}" + image + "{% else %}"
        "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}" + generation_prompt + "{% endif %}"
    )


def image_placeholder(family: str) -> str:
    """What one image is in a prompt of ``family`` (its chat template's rendering of one)."""
    return VISION[family].code().PLACEHOLDER


@dataclass(frozen=True)
class TinyVisionLanguageSpec:
    """Shape of a tiny vision-language model; every set field is part of its cache key."""

    family: str = "llava"
    # The language model, a tiny decoder of the family's language family (its vocabulary is
    # the tokenizer's, the image tokens added); None: the family's default shape.
    language: TinyModelSpec | None = None
    # vision tower: (image_size / patch_size)^2 image tokens per image (LLaVA); Qwen2-VL
    # resizes each image to a multiple of 2 x patch_size and merges 2 x 2 patches per token
    vision_hidden_size: int = 64
    vision_layers: int = 2
    vision_heads: int = 2
    image_size: int = 56
    patch_size: int = 14
    seed: int = 0
    # Families whose images are any size (Qwen2-VL): the image processor's pixel budget,
    # which bounds the patches of one image (max_pixels / patch_size^2) and so the compiled
    # vision tower's sequence length; the family module's default when unset (None elsewhere,
    # and then not part of the cache key).
    max_pixels: int | None = None

    def __post_init__(self) -> None:
        if self.family not in VISION:
            raise ValueError(
                f"unknown vision-language family {self.family!r}; known: {list(VISION)}"
            )
        wanted = VISION[self.family].tiny_language_family
        if self.language is None:
            object.__setattr__(self, "language", TinyModelSpec(family=wanted))
        for name, value in VISION[self.family].code().SPEC_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.language.family != wanted:
            raise ValueError(
                f"{self.family}'s language model is {wanted}, not {self.language.family}"
            )
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of {self.patch_size}")

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def key(self) -> str:
        # Fields added after a family's first models were built are left out while unset, so
        # those models keep their cached directories (and compiles).
        fields = {k: v for k, v in asdict(self).items() if v is not None}
        if VISION[self.family].tiny_revision:  # its recipe changed after models were cached
            fields["recipe"] = VISION[self.family].tiny_revision
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def build_tiny_vlm(
    spec: TinyVisionLanguageSpec | None = None, out_dir: Path | None = None, **kw
) -> Path:
    """Build (once, cached by spec) a random-weight vision-language model directory with its
    tokenizer, image processor and chat template. ``kw`` are ``TinyVisionLanguageSpec``
    fields."""
    import torch
    from transformers import AutoTokenizer

    spec = spec or TinyVisionLanguageSpec(**kw)
    out = out_dir or cache_dir() / "models" / f"tiny-{spec.family}-{spec.key()}"
    if (out / "config.json").exists():
        return out
    code = VISION[spec.family].code()
    # named special tokens (tokenizer.image_token, ...) the family's processor looks up
    named = code.NAMED_TOKENS
    tokenizer = AutoTokenizer.from_pretrained(
        build_tokenizer(spec.language.vocab_size),
        **({"extra_special_tokens": dict(named)} if named else {}),
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(code.SPECIAL_TOKENS)})
    tokenizer.chat_template = chat_template(code.PLACEHOLDER, code.GENERATION_PROMPT)
    torch.manual_seed(spec.seed)
    model, processor = code.tiny_model(spec, tokenizer)
    model = model.eval()
    logger.info("building tiny %s vision-language model at %s", spec.family, out)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "rbln_ray_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    return out
