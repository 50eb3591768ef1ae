"""Deterministic tiny vision-language models of the families rbln-ray serves with images.

Why: the vision-language tests compare rbln-ray with transformers' own ``generate`` on the
same weights and the same processor inputs, which needs a real Hugging Face directory (model,
tokenizer with the image token, image processor, chat template), built offline. The image
processors are transformers' PIL ones (``CLIPImageProcessorPil``, ``Qwen2VLImageProcessorPil``):
the project venv has no torchvision, and transformers' default Qwen2-VL image processor needs it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rbln_ray.common.paths import atomic_dir, cache_dir
from rbln_ray.compile.vision import VISION_FAMILIES
from rbln_ray.models.builder import TinyModelSpec, make_config
from rbln_ray.models.tokenizer import build_tokenizer

logger = logging.getLogger(__name__)

IMAGE_TOKEN = "<image>"
# Qwen2-VL's special tokens (its processor looks the image token up by this name) and what
# one image is in its prompts: the placeholder between the vision start and end markers.
QWEN_VISION_START, QWEN_VISION_END = "<|vision_start|>", "<|vision_end|>"
QWEN_IMAGE_PAD, QWEN_VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
QWEN_IMAGE = QWEN_VISION_START + QWEN_IMAGE_PAD + QWEN_VISION_END


def chat_template(image: str) -> str:
    """The local tokenizer's chat template, with OpenAI-style content parts: an image part
    renders as ``image`` where it stands (vLLM renders chat messages with it, and so does the
    transformers reference through the processor)."""
    return (
        "{% for m in messages %}<|{{ m['role'] }}|>\n"
        "{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for part in m['content'] %}"
        "{% if part['type'] in ('image', 'image_url') %}" + image + "{% else %}"
        "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )


VLM_CHAT_TEMPLATE = chat_template(IMAGE_TOKEN)
# What one image is in a prompt of each family (its chat template's rendering of an image).
IMAGE_PLACEHOLDER = {"llava": IMAGE_TOKEN, "qwen2_vl": QWEN_IMAGE}


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
    # Qwen2-VL only (None elsewhere, and then not part of the cache key): the image
    # processor's pixel budget, which bounds the patches of one image (max_pixels /
    # patch_size^2) and so the compiled vision tower's sequence length.
    max_pixels: int | None = None

    def __post_init__(self) -> None:
        if self.family not in VISION_FAMILIES:
            raise ValueError(
                f"unknown vision-language family {self.family!r}; known: {list(VISION_FAMILIES)}"
            )
        if self.language is None:
            default = TinyModelSpec(family=VISION_FAMILIES[self.family].language_family)
            object.__setattr__(self, "language", default)
        if self.family == "qwen2_vl" and self.max_pixels is None:
            object.__setattr__(self, "max_pixels", QWEN_MAX_PIXELS)
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
        # Fields added after a family's first models were built are left out while unset, so
        # those models keep their cached directories (and compiles).
        fields = {k: v for k, v in asdict(self).items() if v is not None}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


# The tiny Qwen2-VL's pixel budget: at most 256 patches (64 image tokens) per image.
QWEN_MAX_PIXELS = 28 * 28 * 64
QWEN_MIN_PIXELS = 56 * 56  # Qwen2-VL's own minimum


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


def _qwen2_vl(spec: TinyVisionLanguageSpec, tokenizer, ids: dict[str, int]):
    """Qwen2-VL's recipe at the spec's shape: a ViT over 14-pixel patches (two frames per
    temporal patch) with 2-D rotary positions, 2 x 2 patches merged into one token by an MLP,
    a Qwen2 language model with M-RoPE (temporal, height, width sections of the rotary
    dimensions)."""
    import transformers

    language = spec.language
    head_dim = language.hidden_size // language.num_heads
    pairs = head_dim // 2  # rotary pairs: Qwen2-VL's [16, 24, 24] of 64, scaled
    temporal = pairs // 4
    section = [temporal, (pairs - temporal) // 2, pairs - temporal - (pairs - temporal) // 2]
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=language.hidden_size,
        intermediate_size=language.intermediate_size,
        num_hidden_layers=language.num_layers,
        num_attention_heads=language.num_heads,
        num_key_value_heads=language.num_kv_heads,
        max_position_embeddings=language.max_position_embeddings,
        initializer_range=language.initializer_range,
        rope_scaling={"type": "mrope", "mrope_section": section},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(
        depth=spec.vision_layers,
        embed_dim=spec.vision_hidden_size,
        hidden_size=language.hidden_size,  # the merger's output: the LM's embeddings
        mlp_ratio=2,
        num_heads=spec.vision_heads,
        patch_size=spec.patch_size,
        # not a field of transformers' config, but in every Qwen2-VL checkpoint's, and
        # optimum-rbln 0.12's vision tower reads it
        spatial_patch_size=spec.patch_size,
        spatial_merge_size=2,
        temporal_patch_size=2,
        initializer_range=language.initializer_range,
    )
    config = transformers.Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[QWEN_IMAGE_PAD],
        video_token_id=ids[QWEN_VIDEO_PAD],
        vision_start_token_id=ids[QWEN_VISION_START],
        vision_end_token_id=ids[QWEN_VISION_END],
        tie_word_embeddings=False,
    )
    image_processor = transformers.Qwen2VLImageProcessorPil(
        min_pixels=QWEN_MIN_PIXELS,
        max_pixels=spec.max_pixels,
        patch_size=spec.patch_size,
        merge_size=2,
        temporal_patch_size=2,
    )
    # transformers' Qwen2VLProcessor, minus the video processor that needs torchvision
    from rbln_ray.compile.qwen2_vl_processor import Qwen2VLImageProcessorOnly

    processor = Qwen2VLImageProcessorOnly(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )
    return transformers.Qwen2VLForConditionalGeneration(config), processor


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
    if spec.family == "qwen2_vl":
        special = [QWEN_VISION_START, QWEN_VISION_END, QWEN_IMAGE_PAD, QWEN_VIDEO_PAD]
        tokenizer.add_special_tokens({"additional_special_tokens": special})
        tokenizer.chat_template = chat_template(QWEN_IMAGE)
        torch.manual_seed(spec.seed)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in special}
        model, processor = _qwen2_vl(spec, tokenizer, ids)
    else:
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
