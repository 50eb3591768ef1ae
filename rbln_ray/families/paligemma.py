"""PaliGemma on RBLN: a SigLIP vision tower and a linear projector in front of a Gemma language
model that reads its whole prompt -- image and text -- as a *prefix*: every prompt token
attends to every other one (bidirectionally), generated tokens causally.

What differs from LLaVA (:mod:`.llava`):

* **Prefix-LM prefill.** optimum-rbln 0.12 compiles PaliGemma's language model with an
  attention mask and position ids and, with no ``image_prefill`` phase, a *bidirectional*
  prefill over one chunk of ``max_seq_len`` tokens (:func:`language_rbln_config`: rbln-ray's
  settings would compile no mask, and optimum then refuses the position ids). A prompt must
  therefore be prefilled in one call from position 0: chunked prefill and prefix caching are
  off (the registry record; a cached block would hold KV computed over another prompt's
  suffix). Decode steps take the ``[batch, max_seq_len]`` mask and position ids the runner
  passes for any artifact compiled with them.
* **Positions.** transformers numbers PaliGemma's positions from 1, optimum-rbln from 0
  (vllm-rbln too); rotary attention depends only on relative positions, so the results agree
  to float rounding (~1e-5 in the logits). Prefill positions cannot be passed to optimum's
  graph at all, so shifting only decode's would be wrong.
* **Prompt format.** The processor puts ``image_seq_length`` image tokens and BOS before the
  text and a newline after it; vLLM 0.30's processor does the same (it inserts no BOS for a
  text-only prompt, and appends the newline only when the prompt does not already end with
  one, which transformers' does regardless: the tiny chat template's generation prompt ends
  without a newline, :data:`GENERATION_PROMPT`). One image per prompt, no placeholder in the
  text (:data:`PLACEHOLDER` is empty).
* **vLLM's view.** vLLM 0.30's ``paligemma`` module imports here, but its
  ``get_vision_encoder_info`` imports ``pixtral`` (torchvision) on the first request;
  :class:`PaliGemmaSiglipProcessingInfo` answers with the SigLIP encoder's info directly and
  vLLM's own processor does the rest, under :class:`RBLNPaliGemmaDeclaration`.
* **Tokens per image.** optimum-rbln 0.12 reads ``vision_config.num_image_tokens`` when it
  runs the tower; transformers 5 saves it on ``text_config`` only (and derives it from the
  tower's shape), so an artifact compiled from such a checkpoint fails on its first image.
  :func:`num_image_tokens` reads it once, from wherever the checkpoint has it, and
  :meth:`PaliGemma.after_compile` writes it where optimum reads it.
* **Features.** The projector runs on the host; optimum's ``get_image_features`` divides it by
  ``sqrt(hidden)`` because the compiled Gemma graph scales every input embedding by it (the
  host embedding table is unscaled), which leaves image features as transformers has them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from vllm.model_executor.models import paligemma as vllm_paligemma
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.model_executor.models.siglip import SiglipEncoderInfo
from vllm.multimodal import MULTIMODAL_REGISTRY

from rbln_ray.families.contract import VisionCode
from rbln_ray.families.vision_base import (
    Declaration,
    PromptEmbedder,
    one_image,
    tiny_text_config,
    tiny_vision_kwargs,
)

# The processor puts the image tokens before the text itself: a prompt names no image.
PLACEHOLDER = ""
IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = [IMAGE_TOKEN]
# The processor ends every prompt with a newline of its own (see the module docstring).
GENERATION_PROMPT = "<|assistant|>"


def num_image_tokens(config: Mapping[str, Any]) -> int:
    """Tokens per image of a PaliGemma ``config.json``: the tower's patch grid
    (``(image_size // patch_size) ** 2``, what transformers derives), checked against the
    copies checkpoints keep on ``vision_config`` and ``text_config``; a ``ValueError`` names
    the field that is missing or disagrees."""
    vision = config.get("vision_config") or {}
    missing = [f for f in ("image_size", "patch_size") if not vision.get(f)]
    if missing:
        raise ValueError(
            f"PaliGemma config.json: vision_config has no {', '.join(missing)}, from which "
            "its tokens per image (num_image_tokens) are derived"
        )
    tokens = (vision["image_size"] // vision["patch_size"]) ** 2
    for where in ("vision_config", "text_config"):
        kept = (config.get(where) or {}).get("num_image_tokens")
        if kept is not None and kept != tokens:
            raise ValueError(
                f"PaliGemma config.json: {where}.num_image_tokens is {kept}, but the vision "
                f"tower's image_size {vision['image_size']} and patch_size "
                f"{vision['patch_size']} make {tokens} tokens per image"
            )
    return tokens


# ----------------------------------------------------------------------------- vLLM
class PaliGemmaSiglipProcessingInfo(vllm_paligemma.PaliGemmaProcessingInfo):
    """vLLM 0.30's PaliGemma processing, without the torchvision import of
    ``get_vision_encoder_info`` (PaliGemma's tower is SigLIP)."""

    def get_vision_encoder_info(self) -> SiglipEncoderInfo:
        return SiglipEncoderInfo(self.get_hf_config())


@MULTIMODAL_REGISTRY.register_processor(
    vllm_paligemma.PaliGemmaMultiModalProcessor,
    info=PaliGemmaSiglipProcessingInfo,
    dummy_inputs=vllm_paligemma.PaliGemmaDummyInputsBuilder,
)
class RBLNPaliGemmaDeclaration(Declaration, SupportsMultiModal):
    """``PaliGemmaForConditionalGeneration`` as vLLM's registry and front end see it on
    RBLN."""

    PLACEHOLDERS = {"image": None}  # the processor places the image


# ----------------------------------------------------------------------------- runner
class Embedder(PromptEmbedder):
    """Image features from ``get_image_features`` (the compiled SigLIP tower, the host
    projector)."""

    def _image_features(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        pixels = one_image(data["pixel_values"])
        return self.model.get_image_features(pixels)


# ----------------------------------------------------------------------------- family code
class PaliGemma(VisionCode):
    """PaliGemma's contract: its prompt format and its prefix-LM decoder's compile settings."""

    PLACEHOLDER = PLACEHOLDER
    SPECIAL_TOKENS = SPECIAL_TOKENS
    GENERATION_PROMPT = GENERATION_PROMPT
    Embedder = Embedder

    def language_rbln_config(self, hf_dir: str | Path, language: dict[str, Any]) -> dict:
        """The prefix-LM prefill's compile settings: an attention mask (optimum compiles
        position ids for PaliGemma, which it accepts only with one), the whole prompt in one
        chunk."""
        return {"use_attention_mask": True, "prefill_chunk_size": language["max_seq_len"]}

    def after_compile(self, hf_dir: str | Path, out: Path) -> None:
        """The tokens per image where optimum-rbln reads them (``vision_config``; see the
        module docstring), whichever field the checkpoint kept."""
        super().after_compile(hf_dir, out)
        tokens = num_image_tokens(json.loads((Path(hf_dir) / "config.json").read_text()))
        path = out / "config.json"
        config = json.loads(path.read_text())
        config.setdefault("vision_config", {})["num_image_tokens"] = tokens
        path.write_text(json.dumps(config, indent=2) + "\n")

    def tiny_model(self, spec: Any, tokenizer: Any) -> tuple[Any, Any]:
        """PaliGemma-1's recipe at the spec's shape: a SigLIP tower without its pooling head (as
        the released checkpoints), a linear projector, a Gemma language model."""
        import transformers
        from tokenizers import AddedToken

        # vLLM's processor looks the newline up as one vocabulary entry (Gemma's tokenizer has
        # it; a byte-level BPE spells it otherwise)
        tokenizer.add_tokens([AddedToken("\n", normalized=False, special=False)])
        tokens = spec.image_tokens
        image_processor = transformers.SiglipImageProcessorPil(
            size={"height": spec.image_size, "width": spec.image_size}, image_seq_length=tokens
        )
        # adds PaliGemma's 1152 <locNNNN>/<segNNN> tokens: the vocabulary is sized after it
        processor = transformers.PaliGemmaProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )
        hidden = spec.language.hidden_size
        text = tiny_text_config(spec, tokenizer)
        vision = dict(
            model_type="siglip_vision_model",
            **tiny_vision_kwargs(spec),
            projection_dim=hidden,
            vision_use_head=False,
            # no num_image_tokens: transformers 5 saves it on text_config only, as here
        )
        config = transformers.PaliGemmaConfig(
            text_config=text.to_dict(),
            vision_config=vision,
            image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
            projection_dim=hidden,  # else PaliGemmaConfig forces 2048 into the vision config
            hidden_size=hidden,
            vocab_size=len(tokenizer),
            tie_word_embeddings=False,
        )
        return transformers.PaliGemmaForConditionalGeneration(config), processor


CODE = PaliGemma()
