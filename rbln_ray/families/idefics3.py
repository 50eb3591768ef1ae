"""Idefics3 (and SmolVLM-style checkpoints) on RBLN: a SigLIP-like vision encoder over tiles of
an image, a connector that merges ``scale_factor`` x ``scale_factor`` patches into one token
(pixel shuffle + linear), and a Llama language model.

What differs from LLaVA (:mod:`.llava`):

* **Tiles and markers.** The processor splits an image into up to ``size / max_image_size``
  tiles per side plus a global (downscaled) tile; each tile is ``image_seq_len`` image tokens
  framed by ``<fake_token_around_image>`` and a ``<row_i_col_j>`` (or ``<global-img>``) tag,
  with a newline after each row of tiles. vLLM's placeholder range covers the markers too and
  marks the image tokens (``is_embed``), which the base embedder honours.
* **Where the decoder is.** optimum-rbln compiles it as the ``text_model`` submodule
  (:attr:`Embedder.language_model`); the encoder's patch and position embeddings run on the
  host and its compiled encoder takes no attention mask, which is exact for the PIL image
  processor's tiles (their pixels are all real; whole padding tiles are dropped by optimum).
  :class:`Embedder` refuses a tile that is partly padding rather than compute it without its
  mask.
* **Processor.** transformers 5.15's lazy import table marks ``Idefics3ImageProcessorPil``
  (PIL and numpy only) as needing torchvision, so ``AutoProcessor`` and
  ``Idefics3Processor.from_pretrained`` cannot load it here, optimum-rbln's export silently
  saves no processor with the artifact, and vLLM 0.30's ``Idefics3ProcessingInfo`` (whose
  module imports fine) cannot build its processor. :class:`Idefics3PilProcessor` loads the
  same processor from its parts; vLLM's own Idefics3 processor, dummy inputs and prompt
  updates serve the rest, with :class:`Idefics3PilProcessingInfo` handing them this
  processor, so the family registers :class:`RBLNIdefics3Declaration` for them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, Idefics3Processor
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from vllm.model_executor.models import idefics3 as vllm_idefics3
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.multimodal import MULTIMODAL_REGISTRY

from rbln_ray.families.contract import VisionCode
from rbln_ray.families.vision_base import (
    PROCESSOR_CONFIG,
    Declaration,
    PromptEmbedder,
    tiny_text_config,
    tiny_vision_kwargs,
)

PLACEHOLDER = "<image>"  # what one image is in a prompt (and in the chat template)
# The processor's markers: it adds the first three to a tokenizer itself, the tile tags must
# be in it already (as in every Idefics3 checkpoint's tokenizer).
SPECIAL_TOKENS = [
    "<fake_token_around_image>",
    PLACEHOLDER,
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
]
# Settings of Idefics3Processor itself (not its image processor's) in processor_config.json
PROCESSOR_SETTINGS = ("image_seq_len",)


# ----------------------------------------------------------------------------- processor
class Idefics3PilProcessor(Idefics3Processor):
    """``Idefics3Processor`` loaded from its parts, with the PIL image processor (see the
    module docstring); it saves itself as ``Idefics3Processor``."""

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | Path, *args: Any, **kwargs: Any
    ) -> Idefics3PilProcessor:
        path = Path(pretrained_model_name_or_path)
        tokenizer = kwargs.pop("tokenizer", None) or AutoTokenizer.from_pretrained(str(path))
        for hub_only in ("revision", "trust_remote_code"):  # a local directory; vLLM passes them
            kwargs.pop(hub_only, None)
        saved = json.loads((path / PROCESSOR_CONFIG).read_text())
        settings = {k: kwargs.pop(k, saved[k]) for k in PROCESSOR_SETTINGS if k in saved}
        # what is left are image processor settings (vLLM's mm_processor_kwargs)
        image_processor = Idefics3ImageProcessorPil.from_pretrained(str(path), **kwargs)
        return cls(
            image_processor=image_processor,
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
            **settings,
        )

    def to_dict(self) -> dict[str, Any]:
        config = super().to_dict()
        config["processor_class"] = Idefics3Processor.__name__
        return config


# ----------------------------------------------------------------------------- vLLM
class Idefics3PilProcessingInfo(vllm_idefics3.Idefics3ProcessingInfo):
    """vLLM 0.30's Idefics3 processing, with the processor loaded from its parts."""

    def get_hf_processor(self, **kwargs: object) -> Idefics3PilProcessor:
        return self.ctx.get_hf_processor(Idefics3PilProcessor, **kwargs)


@MULTIMODAL_REGISTRY.register_processor(
    vllm_idefics3.Idefics3MultiModalProcessor,
    info=Idefics3PilProcessingInfo,
    dummy_inputs=vllm_idefics3.Idefics3DummyInputsBuilder,
)
class RBLNIdefics3Declaration(Declaration, SupportsMultiModal):
    """``Idefics3ForConditionalGeneration`` as vLLM's registry and front end see it on
    RBLN."""

    PLACEHOLDERS = {"image": PLACEHOLDER}


# ----------------------------------------------------------------------------- runner
class Embedder(PromptEmbedder):
    """Image features of every tile (the host embeddings, the compiled encoder and
    connector: ``get_image_features``), in the processor's tile order; the decoder is
    ``text_model``."""

    @property
    def language_model(self) -> Any:
        return self.model.text_model

    def _image_features(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        pixels = data["pixel_values"]  # [tiles, C, H, W] of one image
        mask = data.get("pixel_attention_mask")  # [tiles, H, W]
        if mask is not None:
            real = (pixels != 0).flatten(1).any(dim=1)  # optimum drops all-zero (padding) tiles
            if not bool(mask[real].all()):
                raise ValueError(
                    "an image tile is partly padding; optimum-rbln 0.12 compiles Idefics3's "
                    "vision encoder without an attention mask, so it cannot be encoded exactly"
                )
        features = self.model.get_image_features(
            pixels.unsqueeze(0), None if mask is None else mask.unsqueeze(0)
        )
        return features.reshape(-1, features.shape[-1])


# ----------------------------------------------------------------------------- family code
class Idefics3(VisionCode):
    """Idefics3's contract: its processor (loaded from its parts, saved with the artifact)."""

    PLACEHOLDER = PLACEHOLDER
    SPECIAL_TOKENS = SPECIAL_TOKENS
    PROCESSOR = Idefics3PilProcessor
    Embedder = Embedder

    def tiny_model(self, spec: Any, tokenizer: Any) -> tuple[Any, Any]:
        """Idefics3's recipe at the spec's shape: an encoder over ``image_size`` tiles (up to
        2 x 2 of them plus the global one), a connector merging 2 x 2 patches, a Llama LM."""
        import transformers

        scale = 2
        tile_tokens = spec.image_tokens // scale**2
        vision = transformers.Idefics3VisionConfig(
            **tiny_vision_kwargs(spec),
            initializer_range=spec.language.initializer_range,
        )
        text = tiny_text_config(spec, tokenizer)
        config = transformers.Idefics3Config(
            vision_config=vision,
            text_config=text,
            scale_factor=scale,
            image_token_id=tokenizer.convert_tokens_to_ids(PLACEHOLDER),
            pad_token_id=tokenizer.pad_token_id,  # its default lies outside the tiny vocabulary
            tie_word_embeddings=False,
        )
        image_processor = Idefics3ImageProcessorPil(
            size={"longest_edge": 2 * spec.image_size},
            max_image_size={"longest_edge": spec.image_size},
            do_image_splitting=True,
        )
        processor = Idefics3PilProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            image_seq_len=tile_tokens,
            chat_template=tokenizer.chat_template,
        )
        return transformers.Idefics3ForConditionalGeneration(config), processor


CODE = Idefics3()
