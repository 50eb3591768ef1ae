"""Deterministic tiny vision-language models of the families rbln-ray serves with images.

Why: the vision-language tests compare rbln-ray with transformers' own ``generate`` on the
same weights and the same processor inputs, which needs a real Hugging Face directory (model,
tokenizer with the image token, image processor, chat template), built offline. The image
processor is the PIL one (``CLIPImageProcessorPil``): no torchvision in the project venv.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from rbln_ray.common.paths import atomic_dir, cache_dir
from rbln_ray.compile.vision import VISION_FAMILIES
from rbln_ray.models.builder import TinyModelSpec, make_config
from rbln_ray.models.tokenizer import build_tokenizer

logger = logging.getLogger(__name__)

IMAGE_TOKEN = "<image>"
# The local tokenizer's chat template, with OpenAI-style content parts: an image part renders
# as the image token where it stands (vLLM renders chat messages with it, and so does the
# transformers reference through the processor).
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}" + IMAGE_TOKEN + "{% else %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class TinyVisionLanguageSpec:
    """Shape of a tiny vision-language model; every field is part of its cache key."""

    family: str = "llava"
    # The language model, a tiny decoder of the family's language family (its vocabulary is
    # the tokenizer's, the image token added).
    language: TinyModelSpec = field(default_factory=lambda: TinyModelSpec(family="llama"))
    # vision tower: (image_size / patch_size)^2 image tokens per image
    vision_hidden_size: int = 64
    vision_layers: int = 2
    vision_heads: int = 2
    image_size: int = 56
    patch_size: int = 14
    seed: int = 0

    def __post_init__(self) -> None:
        if self.family not in VISION_FAMILIES:
            raise ValueError(
                f"unknown vision-language family {self.family!r}; known: {list(VISION_FAMILIES)}"
            )
        wanted = VISION_FAMILIES[self.family].language_family
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
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def _llava(spec: TinyVisionLanguageSpec, tokenizer, image_token_id: int):
    """LLaVA-1.5's recipe at the spec's shape: CLIP tower, features of the second-to-last
    layer without the CLS position, a GELU MLP projector, a Llama language model."""
    import transformers

    vision = transformers.CLIPVisionConfig(
        hidden_size=spec.vision_hidden_size,
        intermediate_size=2 * spec.vision_hidden_size,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        projection_dim=spec.vision_hidden_size,
        initializer_range=spec.language.initializer_range,
    )
    text = make_config(
        replace(spec.language, vocab_size=len(tokenizer)),
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        image_seq_length=spec.image_tokens,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    image_processor = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": spec.image_size},
        crop_size={"height": spec.image_size, "width": spec.image_size},
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=spec.patch_size,
        vision_feature_select_strategy="default",
        chat_template=VLM_CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,  # CLIP's CLS position, dropped by "default"
    )
    return transformers.LlavaForConditionalGeneration(config), processor


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
    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(spec.language.vocab_size))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    torch.manual_seed(spec.seed)
    model, processor = _llava(spec, tokenizer, tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    model = model.eval()
    logger.info("building tiny %s vision-language model at %s", spec.family, out)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "rbln_ray_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    return out
