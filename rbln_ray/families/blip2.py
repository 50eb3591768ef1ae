"""BLIP-2 on RBLN: a ViT, a Q-Former whose learned queries read the image into a fixed number
of vectors, a linear projection into an OPT language model; one image per prompt, always
before the text.

What differs from LLaVA (:mod:`.llava`):

* **No placeholder in the text.** transformers' ``Blip2Processor`` puts ``num_query_tokens``
  image tokens in front of the prompt (before its BOS) and vLLM 0.30's own processor inserts
  the same tokens at the same place (``PromptInsertion`` at the start), so a prompt or a chat
  template names no image (:data:`PLACEHOLDER` is empty); a prompt takes one image.
* **vLLM's own front end.** vLLM 0.30's ``blip2`` module imports without torchvision and its
  multimodal processor gives the HF processor's token ids unchanged, so the family registers
  no declaration of its own.
* **Graphs.** optimum-rbln compiles the ViT, the Q-Former and the projection as three graphs
  (``get_image_features``: one image in, ``num_query_tokens`` vectors out) and the OPT decoder
  as the ``language_model`` submodule.
* **Config couplings optimum reads.** optimum-rbln 0.12's ``RBLNBlip2VisionModel`` reads
  ``vision_config.num_channels`` (no field of transformers 5.15's ``Blip2VisionConfig``; the
  tiny model writes it, and :func:`vision_rbln_config` refuses a checkpoint without it
  before a compile fails deep inside optimum) and its Q-Former takes
  ``image_text_hidden_size`` as the number of image patches (true of the released
  checkpoints: 256 = (224 / 14)^2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from rbln_ray.families.contract import VisionCode
from rbln_ray.families.vision_base import (
    PromptEmbedder,
    one_image,
    tiny_text_config,
    tiny_vision_kwargs,
)

# The processor puts the image tokens before the text itself: a prompt names no image.
PLACEHOLDER = ""
IMAGE_TOKEN = "<image>"  # Blip2Processor's image token (it adds it when missing)
SPECIAL_TOKENS = [IMAGE_TOKEN]
NUM_QUERY_TOKENS = 8  # the tiny model's image tokens (released checkpoints: 32)


class Embedder(PromptEmbedder):
    """Image features from ``get_image_features`` (the compiled ViT, Q-Former and
    projection): ``num_query_tokens`` vectors per image."""

    def _image_features(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        pixels = one_image(data["pixel_values"])
        return self.model.get_image_features(pixel_values=pixels)


# ----------------------------------------------------------------------------- family code
class Blip2(VisionCode):
    """BLIP-2's contract: vLLM's own front end (no declaration), its processor with its chat
    template, a tower refusing what optimum-rbln cannot compile."""

    PLACEHOLDER = PLACEHOLDER
    SPECIAL_TOKENS = SPECIAL_TOKENS
    Embedder = Embedder

    def load_processor(self, model_dir: str | Path, **kwargs: Any) -> Any:
        """A BLIP-2 directory's processor, with its chat template: transformers 5.15's
        ``Blip2Processor.__init__`` drops the ``chat_template`` ``from_pretrained`` hands it, so
        the template (saved next to the tokenizer) is set again here; everything else is
        ``AutoProcessor``'s."""
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(model_dir), **kwargs)
        if processor.chat_template is None:
            processor.chat_template = processor.tokenizer.chat_template
        return processor

    def vision_rbln_config(self, hf_dir: str | Path) -> dict[str, Any]:
        """Nothing to add for the vision graphs; refuses, before optimum-rbln 0.12 fails deep in
        a compile, what it cannot compile: a checkpoint without ``vision_config.num_channels``
        (the released ones have it), a Q-Former compiled for another number of patches than the
        tower makes, and the encoder-decoder (Flan-T5) variants."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(hf_dir))
        saved = json.loads((Path(hf_dir) / "config.json").read_text()).get("vision_config") or {}
        if "num_channels" not in saved:
            raise ValueError(
                f"{hf_dir}: config.json's vision_config has no num_channels, which optimum-rbln "
                "0.12's RBLNBlip2VisionModel reads (transformers' Blip2VisionConfig does not "
                'define it); add "num_channels": 3 to vision_config'
            )
        if not config.use_decoder_only_language_model:
            raise ValueError(
                f"{hf_dir}: a BLIP-2 with an encoder-decoder language model "
                f"({config.text_config.model_type}) is not served; rbln-ray serves BLIP-2 with a "
                "decoder-only one (OPT)"
            )
        vision = config.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2
        if config.image_text_hidden_size != patches:
            raise ValueError(
                f"{hf_dir}: image_text_hidden_size is {config.image_text_hidden_size}, but "
                f"optimum-rbln 0.12 compiles the Q-Former for that many image patches and the "
                f"vision tower makes {patches}"
            )
        return {}

    def tiny_model(self, spec: Any, tokenizer: Any) -> tuple[Any, Any]:
        """BLIP-2's recipe at the spec's shape: a ViT (CLS + patches), a Q-Former of
        ``NUM_QUERY_TOKENS`` learned queries cross-attending to it, a linear projection, an OPT
        language model."""
        import transformers

        # The processor first: it adds its image token to the tokenizer when missing, and the
        # language model's vocabulary is the tokenizer's.
        image_processor = transformers.BlipImageProcessorPil(
            size={"height": spec.image_size, "width": spec.image_size}
        )
        processor = transformers.Blip2Processor(
            image_processor=image_processor, tokenizer=tokenizer, num_query_tokens=NUM_QUERY_TOKENS
        )
        processor.chat_template = tokenizer.chat_template
        init = spec.language.initializer_range
        vision = dict(
            **tiny_vision_kwargs(spec),
            num_channels=3,  # read by optimum-rbln 0.12, not a transformers field (docstring)
            initializer_range=init,
        )
        qformer = dict(
            hidden_size=spec.vision_hidden_size,
            num_hidden_layers=spec.vision_layers,
            num_attention_heads=spec.vision_heads,
            intermediate_size=2 * spec.vision_hidden_size,
            encoder_hidden_size=spec.vision_hidden_size,
            initializer_range=init,
        )
        text = tiny_text_config(spec, tokenizer)
        config = transformers.Blip2Config(
            vision_config=vision,
            qformer_config=qformer,
            text_config=text,
            num_query_tokens=NUM_QUERY_TOKENS,
            image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
            image_text_hidden_size=spec.image_tokens,  # optimum: the number of image patches
            initializer_range=init,
            tie_word_embeddings=False,
        )
        model = transformers.Blip2ForConditionalGeneration(config)
        # transformers initialises the learned queries to zeros; random ones make the features
        # (and so the test's reference) depend on the image more strongly.
        with torch.no_grad():
            model.query_tokens.normal_(std=init)
        return model, processor


CODE = Blip2()
