"""Inputs and the reference shared by the vision-language tests (``vllm.LLM`` and the Serve
app): deterministic images, data URLs, and transformers' own greedy ``generate`` on the
processor's inputs."""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path
from typing import Any

VLM_MAX_LEN = 512  # the tiny VLM's compiled max_seq_len in tests
VLM_BATCH = 4


def make_image(seed: int, width: int = 64, height: int = 48):
    """A deterministic RGB noise image (the processor resizes and crops it)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def image_spec(seed: int, width: int = 64, height: int = 48) -> dict[str, int]:
    """How a request names an image across a process boundary (``rbln_llm_run.py``)."""
    return {"seed": seed, "width": width, "height": height}


def make_video(seed: int, frames: int = 4, width: int = 64, height: int = 48):
    """A deterministic ``[frames, height, width, 3]`` uint8 noise video (numpy frames, as
    ``vllm.LLM``'s ``multi_modal_data={"video": ...}`` takes them)."""
    import numpy as np

    rng = np.random.default_rng(1000 + seed)
    return rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def video_spec(seed: int, frames: int = 4, width: int = 64, height: int = 48) -> dict[str, int]:
    """How a request names a video across a process boundary (``rbln_llm_run.py``)."""
    return {"seed": seed, "frames": frames, "width": width, "height": height}


def data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def image_chat(image, question: str, fmt: str = "PNG") -> list[dict]:
    """OpenAI-style messages: one user turn, ``image`` as a ``data:`` URL, then ``question``
    (what the Serve app's clients send, and ``LLM.chat`` takes)."""
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(image, fmt)}},
                {"type": "text", "text": question},
            ],
        }
    ]


# An image of 32 x 32 patches of 14 pixels (16 x 16 of 16) when a request raises the pixel
# budget to it: more than a tiny any-size model's tower takes (256 patches).
LARGE, LARGE_BUDGET = (448, 448), {"min_pixels": 56 * 56, "max_pixels": 448 * 448}


# Families compiled otherwise: Qwen3.5 compiles flash attention only, whose partitions on
# ATOM are at least 1024 tokens, two per sequence (rbln_ray.families.qwen3_5).
COMPILE: dict[str, dict] = {
    "qwen3_5": {"attn_impl": "flash_attn", "kvcache_partition_len": 1024, "max_seq_len": 2048},
}


def compiled_vlm(family: str = "llava") -> Path:
    """A tiny vision-language model compiled on the emulator (batch 4, 512 tokens unless
    ``COMPILE`` says otherwise; cached)."""
    os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")
    from rbln_ray.compile import CompileSettings, resolve_compiled_dir
    from rbln_ray.models import build_tiny_vlm

    settings = {"max_seq_len": VLM_MAX_LEN, **COMPILE.get(family, {})}
    settings = CompileSettings(batch_size=VLM_BATCH, decoder_batch_sizes=(4, 2, 1), **settings)
    return resolve_compiled_dir(build_tiny_vlm(family=family), settings)


_MODELS: dict[str, Any] = {}


def hf_reference(model_dir: Path):
    """transformers' model (float32, every token generated, as vLLM's ignore_eos) and the
    HF processor of ``model_dir``, loaded once per directory."""
    import torch
    import transformers

    from rbln_ray.compile.vision import load_hf_processor

    key = str(model_dir)
    if key not in _MODELS:
        model = transformers.AutoModelForImageTextToText.from_pretrained(
            key, dtype=torch.float32
        ).eval()
        model.generation_config.eos_token_id = None  # as vLLM's ignore_eos
        # transformers' AutoProcessor; for Qwen2-VL its processor minus the video processor
        # (which needs torchvision): rbln_ray.compile.qwen2_vl_processor
        _MODELS[key] = (model, load_hf_processor(key))
    return _MODELS[key]


# How transformers is told to prefill causally, for the families whose prefill attends partly
# bidirectionally (test_bidirectional_prefill_changes_the_output): PaliGemma's prompt is a
# prefix (token type 0) unless marked as a suffix (1); Gemma3's images are bidirectional blocks
# (1) unless marked as text (0).
CAUSAL_TOKEN_TYPE = {"paligemma": 1, "gemma3_vl": 0}


def hf_vlm_greedy(
    model_dir: Path,
    prompt: str,
    images: list,
    max_new_tokens: int,
    videos: list | None = None,
    causal: bool = False,
) -> tuple[list[int], list[int]]:
    """transformers' (prompt token ids, greedy new token ids) for a text prompt with its
    images (and videos), prepared by the model's own HF processor (the Qwen families':
    ``mm_token_type_ids`` included, without which ``generate`` falls back to 1-D positions;
    ``causal``: with a causal prefill, for the families of :data:`CAUSAL_TOKEN_TYPE`)."""
    import torch

    from rbln_ray.families.registry import vision_for_dir

    model, processor = hf_reference(model_dir)
    family = vision_for_dir(model_dir).name
    if not images and not videos and family == "paligemma":
        # PaliGemma's processor refuses a prompt without an image; vLLM runs no multimodal
        # processor for one: its tokens as they are (PaliGemma's tokenizer adds no BOS). The
        # whole prompt is the prefix, attended bidirectionally: token_type_ids 0, as the
        # processor gives every prompt token.
        inputs = processor.tokenizer([prompt], add_special_tokens=False, return_tensors="pt")
        inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
    elif videos:
        inputs = processor(images=images or None, videos=videos, text=[prompt], return_tensors="pt")
    else:
        inputs = processor(images=images or None, text=[prompt], return_tensors="pt")
    if causal:
        inputs["token_type_ids"] = torch.full_like(inputs["input_ids"], CAUSAL_TOKEN_TYPE[family])
    generate = model.generate
    if not images and family == "blip2":
        # BLIP-2's generate requires pixel_values: a prompt without an image is its language
        # model's alone (as optimum-rbln's and vLLM's BLIP-2 run it)
        generate = model.language_model.generate
    with torch.no_grad():
        out = generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.config.text_config.pad_token_id,
        )
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, out[0, len(prompt_ids) :].tolist()


def hf_chat_prompt(model_dir: Path, messages: list[dict]) -> str:
    """The prompt the model's chat template renders for OpenAI-style ``messages``."""
    _, processor = hf_reference(model_dir)
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
