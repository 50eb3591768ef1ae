"""Gemma3 with images on RBLN (``gemma3_vl``; ``gemma3`` is the text-only decoder family): a
SigLIP vision tower, a projector that pools its patches to ``mm_tokens_per_image`` tokens, and
the Gemma3 language model (sliding-window and global layers), whose prefill lets each image's
tokens attend to each other bidirectionally.

What differs from LLaVA (:mod:`.llava`):

* **Token types per prefill.** optimum-rbln 0.12 compiles the language model with a causal
  ``prefill`` graph for text and a bidirectional ``image_prefill`` graph for an image's run of
  tokens; its prefill routes each run by ``token_type_ids`` (1 on image tokens), which
  :meth:`Embedder.prefill_inputs` passes with every prompt that has images (without them the
  images would be read causally: transformers' output differs, and
  ``test_bidirectional_prefill_changes_the_output`` checks the reference is sensitive to it).
* **Whole-prompt prefill.** That prefill tight-packs the runs into chunks of
  ``prefill_chunk_size`` (which optimum requires to equal ``mm_tokens_per_image``,
  :func:`language_rbln_config`) and builds its attention mask from position 0 of the call, so
  a prompt is prefilled in one call from 0: chunked prefill and prefix caching are off (as for
  the text Gemma3 family; the sliding window alone rules prefix caching out). A chunk may write
  up to ``prefill_chunk_size - 1`` KV slots past the prompt (a dead tail the next chunk or
  decode overwrites); optimum raises inside the engine when that passes ``max_seq_len``, so the
  processor refuses such a prompt first (:meth:`Gemma3MultiModalProcessor.apply`).
* **Eager attention only.** With flash attention optimum pads chunks to partition boundaries
  and decode then needs a per-request padded position and mask (vllm-rbln keeps them per
  request); rbln-ray's decode takes token positions, so the compile refuses ``flash_attn``.
* **Prompt format.** Each ``<start_of_image>`` becomes ``"\\n\\n<start_of_image>"``,
  ``mm_tokens_per_image`` image tokens, ``"<end_of_image>\\n\\n"``; vLLM's placeholder covers
  all of it and marks the image tokens (``is_embed``). transformers' processor inserts that
  text before tokenizing, so Gemma's multi-newline tokens (``"\\n\\n\\n"`` is one token) swallow
  the newlines on either side; vLLM inserts token ids, so the processor below merges each run
  of newline tokens an insertion touches as the tokenizer would (:func:`merge_newlines`, what
  vLLM's own ``gemma3_mm`` does). The tiny tokenizer has Gemma's newline tokens, so the
  tests' prompt ids check it. Pan-and-scan crops are not served.
* **vLLM's view.** vLLM 0.30's ``gemma3_mm`` imports transformers' torchvision image processor
  at module level, so the processor below and :class:`RBLNGemma3Declaration` take its place.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from transformers import BatchFeature, Gemma3Config, Gemma3Processor
from vllm.inputs import MultiModalInput
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems
from vllm.multimodal.parse import ImageProcessorItems, MultiModalDataItems
from vllm.multimodal.processing import (
    BaseMultiModalProcessor,
    ProcessorInputs,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
    TimingContext,
)
from vllm.multimodal.processing.processor import PlaceholderFeaturesInfo

from rbln_ray.families.contract import VisionCode
from rbln_ray.families.image_frontend import ImageDummyInputs, ImageProcessingInfo
from rbln_ray.families.vision_base import (
    Declaration,
    PromptEmbedder,
    one_image,
    tiny_text_config,
    tiny_vision_kwargs,
)
from rbln_ray.upstream.vllm_internals import AfterTokenInsertion

PLACEHOLDER = "<start_of_image>"  # what one image is in a prompt (and in the chat template)
END_OF_IMAGE, IMAGE_TOKEN = "<end_of_image>", "<image_soft_token>"
SPECIAL_TOKENS = [PLACEHOLDER, END_OF_IMAGE, IMAGE_TOKEN]
# The tokenizer's named tokens Gemma3Processor looks up (tokenizer.boi_token, ...).
NAMED_TOKENS = {"boi_token": PLACEHOLDER, "eoi_token": END_OF_IMAGE, "image_token": IMAGE_TOKEN}
# Gemma's tokenizer has a token for each run of newlines ("\n" up to 31 of them); the tiny
# tokenizer gets the first few, which the prompts around an image need.
TINY_NEWLINE_TOKENS = ["\n" * n for n in range(1, 5)]
# Tokens per image of the tiny model: optimum-rbln needs the prefill chunk to equal it and be a
# multiple of 64; one token per patch of an 8 x 8 grid.
TOKENS_PER_IMAGE = 64


def newline_tokens(vocab: Mapping[str, int]) -> dict[int, int]:
    """Token id -> newlines, for a vocabulary's tokens that are runs of newlines only."""
    return {i: len(t) for t, i in vocab.items() if t and t.strip("\n") == ""}


def merge_newlines(
    ids: list[int],
    touched: set[int],
    newlines: Mapping[int, int],
    encode: Callable[[str], list[int]],
) -> tuple[list[int], list[int]]:
    """``ids`` with every run of newline tokens that includes a position of ``touched`` (an
    insertion's) encoded again as one text, as the tokenizer encodes the prompt's text with
    the insertion in it; and, per old position, the new position of the token holding its
    first character. A run the tokenizer would not spell with newline tokens only is kept."""
    out: list[int] = []
    where: list[int] = []
    i = 0
    while i < len(ids):
        j = i
        while j < len(ids) and ids[j] in newlines:
            j += 1
        run = ids[i:j]
        merged = run
        if len(run) > 1 and touched.intersection(range(i, j)):  # encode only what may merge
            merged = encode("\n" * sum(newlines[t] for t in run))
        if merged == run or not all(t in newlines for t in merged):
            where.append(len(out))
            out.append(ids[i])
            i += 1
            continue
        ends = []  # the character offset each merged token ends at, within the run
        for t in merged:
            ends.append((ends[-1] if ends else 0) + newlines[t])
        offset = 0
        for t in run:  # its first character lies in the first merged token that ends past it
            where.append(len(out) + next(k for k, end in enumerate(ends) if end > offset))
            offset += newlines[t]
        out.extend(merged)
        i = j
    return out, where


# ----------------------------------------------------------------------------- vLLM
class Gemma3ProcessingInfo(ImageProcessingInfo):
    """Gemma3: a fixed ``mm_tokens_per_image`` per image, framed by its markers."""

    CONFIG, PROCESSOR = Gemma3Config, Gemma3Processor

    def image_placeholder(self) -> str:
        return PLACEHOLDER

    def get_mm_max_tokens_per_item(
        self, seq_len: int, mm_counts: Mapping[str, int]
    ) -> Mapping[str, int]:
        return {"image": self.get_hf_config().mm_tokens_per_image}

    def longest_prompt_with_images(self) -> int:
        """Tokens a prompt with images may have: optimum's prefill may write up to a chunk
        (``mm_tokens_per_image``) less one past its end, within the compiled length."""
        return self.ctx.model_config.max_model_len - (self.get_hf_config().mm_tokens_per_image - 1)


class Gemma3MultiModalProcessor(AfterTokenInsertion, BaseMultiModalProcessor[Gemma3ProcessingInfo]):
    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        crops = hf_inputs.get("num_crops")
        if crops is not None and bool(torch.as_tensor(crops).any()):
            raise ValueError("Gemma3's pan-and-scan crops (do_pan_and_scan) are not served")
        return {"pixel_values": MultiModalFieldConfig.batched("image")}

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargsItems,
    ) -> Sequence[PromptUpdate]:
        config = self.info.get_hf_config()
        processor = self.info.get_hf_processor(**hf_processor_mm_kwargs)
        mm_items.get_items("image", ImageProcessorItems)  # pixels only, no precomputed embeds
        sequence = self.info.get_tokenizer().encode(
            processor.full_image_sequence, add_special_tokens=False
        )
        replacement = PromptUpdateDetails.select_token_id(sequence, config.image_token_index)
        return [
            PromptReplacement(
                modality="image", target=[config.boi_token_index], replacement=replacement
            )
        ]

    @cached_property
    def _newline_tokens(self) -> dict[int, int]:
        """The tokenizer's newline tokens, looked up once (Gemma's vocabulary has 262,144)."""
        return newline_tokens(self.info.get_tokenizer().get_vocab())

    def after_insertion(
        self, ids: list[int], placeholders: Mapping[str, list[PlaceholderFeaturesInfo]]
    ) -> tuple[list[int], Mapping[str, list[PlaceholderFeaturesInfo]]]:
        """The newlines around each inserted image merged as the tokenizer merges them (module
        docstring); the placeholders follow their tokens."""
        tokenizer = self.info.get_tokenizer()
        newlines = self._newline_tokens
        touched = {
            p.start_idx + k for ps in placeholders.values() for p in ps for k in range(p.length)
        }
        if not newlines or not touched:
            return ids, placeholders
        merged, where = merge_newlines(
            ids, touched, newlines, lambda text: tokenizer.encode(text, add_special_tokens=False)
        )
        image_token = self.info.get_hf_config().image_token_index
        placed: dict[str, list[PlaceholderFeaturesInfo]] = {}
        for modality, items in placeholders.items():
            placed[modality] = []
            for p in items:
                start, end = where[p.start_idx], where[p.start_idx + p.length - 1] + 1
                tokens = merged[start:end]
                is_embed = torch.tensor(tokens) == image_token
                placed[modality].append(
                    replace(p, start_idx=start, tokens=tokens, is_embed=is_embed)
                )
        return merged, placed

    def apply(self, inputs: ProcessorInputs, timing_ctx: TimingContext) -> MultiModalInput:
        processed = super().apply(inputs, timing_ctx)
        most = self.info.longest_prompt_with_images()
        tokens = len(processed["prompt_token_ids"])
        if processed["mm_placeholders"].get("image") and tokens > most:
            raise ValueError(
                f"a Gemma3 prompt with images may be at most {most} tokens (max_model_len less "
                f"the {self.info.get_hf_config().mm_tokens_per_image - 1} KV slots optimum-rbln's "
                f"prefill may write past it); this one is {tokens}"
            )
        return processed


@MULTIMODAL_REGISTRY.register_processor(
    Gemma3MultiModalProcessor, info=Gemma3ProcessingInfo, dummy_inputs=ImageDummyInputs
)
class RBLNGemma3Declaration(Declaration, SupportsMultiModal):
    """``Gemma3ForConditionalGeneration`` as vLLM's registry and front end see it on RBLN."""

    PLACEHOLDERS = {"image": PLACEHOLDER}


# ----------------------------------------------------------------------------- runner
class Embedder(PromptEmbedder):
    """Image features from ``get_image_features`` (the compiled tower and projector) and the
    prompt's token types (1 on image tokens) at its prefill."""

    def _image_features(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        pixels = one_image(data["pixel_values"])
        return self.model.get_image_features(pixels)

    def prefill_inputs(self, state: Any, start: int, end: int) -> dict[str, torch.Tensor]:
        if not self.has_images(state.mm_features):
            return {}  # text only: the causal prefill, as optimum runs it without types
        if start:
            raise RuntimeError(
                f"request {state.req_id}: a Gemma3 prompt with images must be prefilled from "
                f"position 0, not {start} (optimum-rbln's prefill masks from the call's start)"
            )
        types = torch.zeros(end, dtype=torch.long)
        for feature in state.mm_features:
            where = feature.mm_position
            span = torch.arange(where.offset, where.offset + where.length)
            if where.is_embed is not None:
                span = span[where.is_embed]
            types[span[span < end]] = 1
        return {"token_type_ids": types.unsqueeze(0)}


# ----------------------------------------------------------------------------- family code
class Gemma3VL(VisionCode):
    """Gemma3's contract with images: its named tokens and its decoder's prefill chunk."""

    PLACEHOLDER = PLACEHOLDER
    SPECIAL_TOKENS = SPECIAL_TOKENS
    NAMED_TOKENS = NAMED_TOKENS
    Embedder = Embedder

    def language_rbln_config(self, hf_dir: str | Path, language: dict[str, Any]) -> dict[str, Any]:
        """The language model's prefill chunk: optimum-rbln 0.12 requires the text chunk to equal
        the image chunk, ``mm_tokens_per_image``; eager attention only (module docstring)."""
        if language.get("attn_impl") == "flash_attn":
            raise ValueError(
                f"{hf_dir}: Gemma3 with images is served with attn_impl='eager' only: with "
                "flash_attn optimum-rbln 0.12 pads prefill chunks to KV partitions, and decode "
                "would then need per-request padded positions, which rbln-ray does not keep"
            )
        config = json.loads((Path(hf_dir) / "config.json").read_text())
        return {"prefill_chunk_size": int(config.get("mm_tokens_per_image", 256))}

    def tiny_model(self, spec: Any, tokenizer: Any) -> tuple[Any, Any]:
        """Gemma3's recipe at the spec's shape: a SigLIP tower without pooling head over an 8 x 8
        patch grid (the image is sized for it), the projector (RMS norm, average pool to
        ``TOKENS_PER_IMAGE``, linear), a Gemma3 LM with alternating sliding and global layers."""
        import transformers
        from tokenizers import AddedToken

        tokenizer.add_tokens(
            [AddedToken(t, normalized=False, special=False) for t in TINY_NEWLINE_TOKENS]
        )
        side = 8 * spec.patch_size
        init = spec.language.initializer_range
        ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in NAMED_TOKENS.items()}
        text = tiny_text_config(spec, tokenizer)
        vision = dict(
            model_type="siglip_vision_model",
            **tiny_vision_kwargs(spec, side),
            # transformers 5.15 defaults SigLIP to a pooling head, which optimum-rbln then compiles
            # as a second output Gemma3's tower call has no buffer for; checkpoints have none
            vision_use_head=False,
        )
        config = transformers.Gemma3Config(
            text_config=text.to_dict(),
            vision_config=vision,
            mm_tokens_per_image=TOKENS_PER_IMAGE,
            boi_token_index=ids["boi_token"],
            eoi_token_index=ids["eoi_token"],
            image_token_index=ids["image_token"],
            initializer_range=init,  # the LM head's; the default 0.02 makes near-flat logits
            tie_word_embeddings=False,
        )
        model = transformers.Gemma3ForConditionalGeneration(config)
        # transformers initialises the projection to zeros: every image would be the same
        # (zero) features and a test would pass whatever the image
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=init)
        image_processor = transformers.Gemma3ImageProcessorPil(size={"height": side, "width": side})
        processor = transformers.Gemma3Processor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
            image_seq_length=TOKENS_PER_IMAGE,
        )
        return model, processor


CODE = Gemma3VL()
