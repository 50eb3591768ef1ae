"""transformers' Qwen2-VL processor without its video processor, so it loads without
torchvision.

Why: transformers 5.15's ``Qwen2VLProcessor`` takes an image processor, a tokenizer *and* a
video processor, and refuses to be built or loaded without the last; every video processor
of transformers 5.15 needs torchvision, which the project venv cannot have (README, "Setup").
The image side needs none: ``Qwen2VLImageProcessorPil`` resizes, normalises and patchifies
with PIL and numpy. rbln-ray serves images only, so this subclass declares just the image
processor and the tokenizer; every step of processing a prompt (resizing, the image grid,
expanding each ``<|image_pad|>`` into one token per merged patch, ``mm_token_type_ids``) is
transformers' own code, unchanged. It saves itself as ``Qwen2VLProcessor``, so a directory it
writes is an ordinary Qwen2-VL checkpoint (one without a video processor config).

Both vLLM's multimodal processor (``rbln_ray.vllm_plugin.vision_models``) and the tests'
transformers reference load a Qwen2-VL directory's processor through :func:`load_processor`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import ProcessorMixin, Qwen2VLProcessor


class Qwen2VLImageProcessorOnly(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` over images and text only (no video processor)."""

    def __init__(
        self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kw
    ) -> None:
        # What Qwen2VLProcessor.__init__ sets before its ProcessorMixin.__init__ (which would
        # require the video processor).
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = getattr(
            tokenizer, "image_token_id", None
        ) or tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = getattr(
            tokenizer, "video_token_id", None
        ) or tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kw)

    def to_dict(self) -> dict[str, Any]:
        config = super().to_dict()
        config["processor_class"] = Qwen2VLProcessor.__name__
        return config


def load_processor(model_dir: str | Path, **kwargs: Any) -> Qwen2VLImageProcessorOnly:
    """A Qwen2-VL directory's processor (images and text; see the module docstring)."""
    return Qwen2VLImageProcessorOnly.from_pretrained(str(model_dir), **kwargs)
