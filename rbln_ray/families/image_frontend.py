"""What the vLLM front ends of the image families share: their processing info and the dummy
inputs vLLM profiles the engine with.

Why one place: vLLM asks every multimodal family the same three questions (its HF config and
processor, how many images a prompt may carry) and profiles with prompts of ``n``
placeholders and ``n`` images of the size that costs the most tokens. Written out per family
they were the same lines five times; a family now says only its classes, its placeholder and
that size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from vllm.config.multimodal import BaseDummyOptions
from vllm.inputs import MultiModalDataDict
from vllm.multimodal.processing import BaseDummyInputsBuilder, BaseProcessingInfo


class ImageProcessingInfo(BaseProcessingInfo):
    """A family whose prompts carry any number of images; it sets its HF config and processor
    classes (``CONFIG``, ``PROCESSOR``) and says what it profiles with."""

    CONFIG: ClassVar[type]
    PROCESSOR: ClassVar[type]

    def get_hf_config(self) -> Any:
        return self.ctx.get_hf_config(self.CONFIG)

    def get_hf_processor(self, **kwargs: object) -> Any:
        return self.ctx.get_hf_processor(self.PROCESSOR, **kwargs)

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None}

    def image_placeholder(self) -> str:
        """What one image is in a prompt's text (before the processor expands it)."""
        return self.get_hf_processor().image_token

    def dummy_image_size(self) -> tuple[int, int]:
        """``(width, height)`` of the image that costs the most tokens: what vLLM profiles the
        engine's memory and the encoder cache with. Here a tower that takes one fixed square
        (the processor resizes every image to it); a family whose tokens grow with the image
        says its largest."""
        size = self.get_hf_config().vision_config.image_size
        return size, size


class ImageDummyInputs(BaseDummyInputsBuilder[ImageProcessingInfo]):
    """Profiling prompts: ``n`` placeholders and ``n`` images of the info's costliest size."""

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return self.info.image_placeholder() * mm_counts.get("image", 0)

    def get_dummy_mm_data(
        self,
        seq_len: int,
        mm_counts: Mapping[str, int],
        mm_options: Mapping[str, BaseDummyOptions],
    ) -> MultiModalDataDict:
        width, height = self.info.dummy_image_size()
        images = self._get_dummy_images(
            width=width,
            height=height,
            num_images=mm_counts.get("image", 0),
            overrides=mm_options.get("image"),
        )
        return {"image": images}
