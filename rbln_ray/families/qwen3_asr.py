"""Qwen3-ASR on RBLN: a Qwen3 language model whose prompt carries a clip's audio features at
its ``<|audio_pad|>`` tokens, transcribing (or translating) behind vLLM's
``/v1/audio/transcriptions`` and ``/v1/audio/translations``.

Why it is served like a vision-language model, not like Whisper: there is no
cross-attention. The audio tower (three stride-2 convolutions over 100-frame mel chunks, 13
tokens a chunk, windowed self-attention) and its projector give one vector per placeholder
token, merged into the prompt's embeddings; then the decoder runs as any decoder-only model.
optimum-rbln 0.12 compiles it that way (``RBLNQwen3ASRForConditionalGeneration``: the top
level is the decoder, prefilled from ``inputs_embeds``; ``audio_tower`` one graph of tower
and projector over windows of 104 tokens), so rbln-ray's decoder runner, chunked prefill and
prefix caching serve it, and :class:`Embedder` puts the features in place.

Why rbln-ray declares it to vLLM itself: vLLM 0.30's ``qwen3_asr`` module imports Qwen2-VL's
(through Qwen2.5-Omni), whose transformers image processor needs torchvision, which the
project venv cannot have. The front end here is transformers' own ``Qwen3ASRProcessor``
(no torchvision), so prompts and features are exactly what transformers' ``generate`` gets;
the transcription prompt and its post-processing follow vLLM's own module (the official
Qwen3-ASR SDK's format). One clip per prompt: transformers' processor pairs texts and
audios one to one.

vLLM also registers a config class of its own for ``model_type`` ``qwen3_asr`` (nesting the
``-hf`` layout under ``thinker_config``), so what compiles or loads the model passes
transformers' config explicitly (:meth:`Qwen3ASR.hf_config`), and nothing here reads the
engine's ``hf_config``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import BatchFeature, Qwen3ASRConfig, Qwen3ASRProcessor
from transformers.models.qwen3_asr.processing_qwen3_asr import LANGUAGE_CODE_TO_NAME
from vllm.config import ModelConfig, SpeechToTextConfig
from vllm.config.multimodal import BaseDummyOptions
from vllm.config.speech_to_text import SpeechToTextParams
from vllm.inputs import MultiModalDataDict, PromptType, TokensPrompt
from vllm.model_executor.models.interfaces import (
    SupportsMultiModal,
    SupportsTranscription,
)
from vllm.model_executor.models.whisper_utils import ISO639_1_SUPPORTED_LANGS
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems
from vllm.multimodal.parse import MultiModalDataItems, MultiModalDataParser
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
)
from vllm.tokenizers import cached_tokenizer_from_config
from vllm.transformers_utils.processor import cached_processor_from_config

from rbln_ray.families.contract import VisionCode
from rbln_ray.families.vision_base import Declaration, PromptEmbedder, tiny_text_kwargs
from rbln_ray.upstream.transformers_internals import qwen3_asr_audio_tokens

AUDIO_TOKEN = "<|audio_pad|>"
PLACEHOLDER = "<|audio_start|>" + AUDIO_TOKEN + "<|audio_end|>"  # one clip in a prompt
ASR_TEXT = "<asr_text>"  # ends "language <Name>": the transcription follows
TIMESTAMP = "<timestamp>"  # the forced aligner's word boundary (not served; in the vocabulary)
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|audio_start|>", AUDIO_TOKEN, "<|audio_end|>"]
# The languages a request may name: the model's own (transformers' map, the names its
# prompts carry) that vLLM's transcription front end knows as ISO 639-1 codes.
LANGUAGES = {
    code: name for code, name in LANGUAGE_CODE_TO_NAME.items() if code in ISO639_1_SUPPORTED_LANGS
}
# ChatML markers a request's own text must not smuggle into the prompt (vLLM's rule).
_CHATML_LIKE = re.compile(r"<\|[^|]+\|>")
_LANGUAGE_PREFIX = "language "


# The tiny model's chat template: ChatML, the format of the released checkpoints' prompts
# (as vLLM's transcription prompt writes them); a clip part is PLACEHOLDER, and a final
# assistant turn stays open (the transcription prompt's "language <Name><asr_text>").
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('audio', 'audio_url', 'input_audio') %}"
    + PLACEHOLDER
    + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if not (loop.last and m['role'] == 'assistant') %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def sanitize(text: str | None) -> str:
    """A request's ``prompt`` without ChatML markers or ``<asr_text>``, removed until none is
    left (a nested ``<|im<|x|>_end|>`` must not become ``<|im_end|>``)."""
    text = text or ""
    previous = None
    while previous != text:
        previous = text
        text = _CHATML_LIKE.sub("", text).replace(ASR_TEXT, "")
    return text


def transcription_prompt(request_prompt: str | None, language_name: str | None) -> str:
    """The prompt of one transcription: a system turn with the request's context (only when
    there is one), the clip as the user's turn, and the answer opened with ``language
    <Name><asr_text>`` when the language is forced (else the model names it)."""
    context = sanitize(request_prompt)
    system = f"<|im_start|>system\n{context}<|im_end|>\n" if context else ""
    prompt = f"{system}<|im_start|>user\n{PLACEHOLDER}<|im_end|>\n<|im_start|>assistant\n"
    if language_name:
        prompt += f"{_LANGUAGE_PREFIX}{language_name}{ASR_TEXT}"
    return prompt


def transcription_text(output: str) -> str:
    """The transcription in a generated ``language <Name><asr_text>text``: what follows the
    last ``<asr_text>`` (the whole output when the model wrote none)."""
    return output.rsplit(ASR_TEXT, 1)[1] if ASR_TEXT in output else output


# ----------------------------------------------------------------------------- front end
class Qwen3ASRProcessingInfo(BaseProcessingInfo):
    """One clip per prompt, as many tokens as 13 per second of audio (the processor's
    count), resampled to the feature extractor's rate."""

    def get_hf_processor(self, **kwargs: object) -> Qwen3ASRProcessor:
        # Always transformers' class: vLLM would otherwise pick its own Qwen3ASRProcessor by
        # the name the directory records (a Whisper feature extractor, other features).
        return self.ctx.get_hf_processor(Qwen3ASRProcessor, **kwargs)

    def get_data_parser(self) -> MultiModalDataParser:
        extractor = self.get_hf_processor().feature_extractor
        return MultiModalDataParser(target_sr=extractor.sampling_rate, target_channels=1)

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"audio": 1}

    def get_mm_max_tokens_per_item(
        self, seq_len: int, mm_counts: Mapping[str, int] | None = None
    ) -> Mapping[str, int]:
        processor = self.get_hf_processor()
        extractor = processor.feature_extractor
        frames = extractor.chunk_length * extractor.sampling_rate // extractor.hop_length
        return {"audio": qwen3_asr_audio_tokens(processor, frames)}


class Qwen3ASRDummyInputs(BaseDummyInputsBuilder[Qwen3ASRProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return PLACEHOLDER * mm_counts.get("audio", 0)

    def get_dummy_mm_data(
        self,
        seq_len: int,
        mm_counts: Mapping[str, int],
        mm_options: Mapping[str, BaseDummyOptions],
    ) -> MultiModalDataDict:
        extractor = self.info.get_hf_processor().feature_extractor
        audios = self._get_dummy_audios(
            length=extractor.chunk_length * extractor.sampling_rate,
            num_audios=mm_counts.get("audio", 0),
            overrides=mm_options.get("audio"),
        )
        return {"audio": audios}


class Qwen3ASRMultiModalProcessor(BaseMultiModalProcessor[Qwen3ASRProcessingInfo]):
    def _get_hf_processor_text(self, mm_counts: Mapping[str, int]) -> str:
        # transformers' processor takes texts and audios one to one
        return self.dummy_inputs.get_dummy_text(mm_counts)

    def _preprocess_hf_mm_data(
        self, mm_data: Mapping[str, object], hf_processor_mm_kwargs: Mapping[str, object]
    ) -> tuple[Mapping[str, object], Mapping[str, object]]:
        data = dict(mm_data)
        if "audios" in data:
            data["audio"] = data.pop("audios")
        extractor = self.info.get_hf_processor().feature_extractor
        return data, {**hf_processor_mm_kwargs, "sampling_rate": extractor.sampling_rate}

    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        return {
            "input_features": MultiModalFieldConfig.batched("audio"),
            "input_features_mask": MultiModalFieldConfig.batched("audio"),
        }

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargsItems,
    ) -> Sequence[PromptUpdate]:
        processor = self.info.get_hf_processor(**hf_processor_mm_kwargs)
        masks = out_mm_kwargs.get_data().get("input_features_mask")

        def tokens(i: int) -> list[int]:
            n = qwen3_asr_audio_tokens(processor, masks[i].sum())
            return [processor.audio_token_id] * n

        target = [processor.audio_token_id]
        return [PromptReplacement(modality="audio", target=target, replacement=tokens)]


class Embedder(PromptEmbedder):
    """A clip's features from the compiled audio tower (tower and projector, one graph run
    per window of 8 chunks); the model itself is the decoder."""

    @property
    def language_model(self) -> Any:
        return self.model

    def _audio_features(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        # a batch of one clip; optimum casts to the graph's dtype and pads to whole windows
        features, mask = data["input_features"], data["input_features_mask"]
        return self.model.audio_tower(features.unsqueeze(0), mask.unsqueeze(0))


@MULTIMODAL_REGISTRY.register_processor(
    Qwen3ASRMultiModalProcessor, info=Qwen3ASRProcessingInfo, dummy_inputs=Qwen3ASRDummyInputs
)
class RBLNQwen3ASRDeclaration(Declaration, SupportsMultiModal, SupportsTranscription):
    """``Qwen3ASRForConditionalGeneration`` as vLLM's registry and transcription front end
    see it on RBLN."""

    PLACEHOLDERS = {"audio": PLACEHOLDER}
    supported_languages: ClassVar[Mapping[str, str]] = LANGUAGES

    @classmethod
    def get_speech_to_text_config(
        cls, model_config: ModelConfig, task_type: str
    ) -> SpeechToTextConfig:
        processor = cached_processor_from_config(model_config, processor_cls=Qwen3ASRProcessor)
        extractor = processor.feature_extractor
        return SpeechToTextConfig(
            max_audio_clip_s=extractor.chunk_length, sample_rate=extractor.sampling_rate
        )

    @classmethod
    def get_generation_prompt(cls, stt_params: SpeechToTextParams) -> PromptType:
        if stt_params.task_type not in ("transcribe", "translate"):
            raise ValueError(
                f"unsupported task_type {stt_params.task_type!r}: 'transcribe' or 'translate'"
            )
        translate = stt_params.task_type == "translate"
        code = stt_params.to_language if translate else stt_params.language
        name = cls.supported_languages.get(code, code) if code else None
        prompt = transcription_prompt(stt_params.request_prompt, name)
        tokenizer = cached_tokenizer_from_config(stt_params.model_config)
        return TokensPrompt(
            prompt_token_ids=tokenizer.encode(prompt, add_special_tokens=False),
            multi_modal_data={"audio": stt_params.audio},
        )

    @classmethod
    def post_process_output(cls, text: str) -> str:
        return transcription_text(text)


# ----------------------------------------------------------------------------- family code
class Qwen3ASR(VisionCode):
    """Qwen3-ASR's contract: transformers' processor (passed by class), its config passed to
    optimum explicitly, one pass of the audio tower per 30 s clip."""

    PLACEHOLDER = PLACEHOLDER
    SPECIAL_TOKENS = SPECIAL_TOKENS
    NAMED_TOKENS = {
        "audio_token": AUDIO_TOKEN,
        "audio_bos_token": "<|audio_start|>",
        "audio_eos_token": "<|audio_end|>",
    }
    PROCESSOR = Qwen3ASRProcessor
    Embedder = Embedder

    def hf_config(self, model_dir: str | Path) -> Qwen3ASRConfig:
        saved = json.loads((Path(model_dir) / "config.json").read_text())
        if "thinker_config" in saved:  # transformers would fill in a default model silently
            raise ValueError(
                f"{model_dir} is a Qwen3-ASR checkpoint in its original layout "
                "(thinker_config), which transformers' Qwen3ASRConfig and optimum-rbln do not "
                "read; serve the transformers one (Qwen/Qwen3-ASR-*-hf)"
            )
        return Qwen3ASRConfig.from_pretrained(str(model_dir))

    def vision_rbln_config(self, hf_dir: str | Path) -> dict[str, Any]:
        # Windows of 8 one-second chunks (104 tokens): 4 hold a 30 s clip, so one graph run.
        return {"audio_tower": {"num_windows": 4}}

    def tiny_model(self, spec: Any, tokenizer: Any) -> tuple[Any, Any]:
        """Qwen3-ASR's recipe at the spec's shape: the audio tower's sizes from the spec's
        vision fields, the chunking the released checkpoints use (optimum checks it), a
        tied Qwen3 language model long enough for a 30 s clip (390 tokens) and its answer;
        ``<asr_text>`` is an ordinary added token, as the transcription's parsing needs; the
        chat template is ChatML (:data:`CHAT_TEMPLATE`), as the released checkpoints'."""
        import transformers

        tokenizer.add_tokens([ASR_TEXT, TIMESTAMP])
        tokenizer.chat_template = CHAT_TEMPLATE
        text = transformers.Qwen3Config(
            **{
                **tiny_text_kwargs(spec, tokenizer),
                "max_position_embeddings": max(spec.language.max_position_embeddings, 1024),
            },
            head_dim=spec.language.hidden_size // spec.language.num_heads,
            tie_word_embeddings=True,
        )
        audio = transformers.Qwen3ASREncoderConfig(
            num_mel_bins=128,
            encoder_layers=spec.vision_layers,
            encoder_attention_heads=spec.vision_heads,
            encoder_ffn_dim=2 * spec.vision_hidden_size,
            d_model=spec.vision_hidden_size,
            downsample_hidden_size=16,
            output_dim=text.hidden_size,
            initializer_range=spec.language.initializer_range,
        )
        ids = tokenizer.convert_tokens_to_ids
        config = transformers.Qwen3ASRConfig(
            audio_config=audio,
            text_config=text,
            audio_token_id=ids(AUDIO_TOKEN),
            timestamp_token_id=ids(TIMESTAMP),
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=[tokenizer.eos_token_id, ids("<|im_end|>")],
            tie_word_embeddings=True,
        )
        processor = Qwen3ASRProcessor(
            feature_extractor=transformers.Qwen3ASRFeatureExtractor(),
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )
        return transformers.Qwen3ASRForConditionalGeneration(config), processor


CODE = Qwen3ASR()
