"""Audio and references shared by the speech tests (``vllm.LLM`` and the Serve app), for
Whisper and Qwen3-ASR.

The clips are WAV files as a client would upload them: tones in noise of 3, 12 and 42 seconds
(the last one longer than Whisper's 30-second window, with a quiet second where vLLM splits
it) and a sentence spoken by ``espeak-ng``. A clip becomes the engine requests vLLM's
transcription server makes of it: decoded and resampled to 16 kHz by vLLM's own
``load_audio``, split by vLLM's own ``split_audio`` when it is longer than 30 seconds, one
request per chunk. The reference is transformers' plain greedy ``generate`` on the same
weights and the same decoder prompt, one chunk at a time (Whisper's own long-form generation
is not what vLLM serves: it decodes chunks independently).
"""

from __future__ import annotations

import io
from functools import cache
from pathlib import Path

import numpy as np

SPOKEN = "The quick brown fox jumps over the lazy dog. Speech to text on an emulated device."
MAX_TOKENS = 40
PROMPT = "<|startoftranscript|><|{lang}|><|{task}|><|notimestamps|>"


@cache
def clips() -> dict[str, bytes]:
    """Name -> WAV bytes."""
    from rbln_ray.models.speech import spoken_wav, tone_clip, wav_bytes

    return {
        "tone-3s": wav_bytes(tone_clip(3.0, 440, seed=1)),
        "tone-12s": wav_bytes(tone_clip(12.5, 220, seed=2)),
        "tone-42s": wav_bytes(tone_clip(42.0, 330, seed=3, quiet_at=29.5)),
        "spoken": spoken_wav(SPOKEN),
    }


def chunks(wav: bytes) -> list[np.ndarray]:
    """The 16 kHz chunks vLLM's transcription server makes of an upload (its own functions,
    with Whisper's speech-to-text settings)."""
    from vllm.config.speech_to_text import SpeechToTextConfig
    from vllm.multimodal.audio import split_audio
    from vllm.multimodal.media.audio import load_audio

    cfg = SpeechToTextConfig()  # Whisper's: its feature extractor's 30 s at 16 kHz
    y, sr = load_audio(io.BytesIO(wav), sr=cfg.sample_rate, mono=True)
    if len(y) / sr <= cfg.max_audio_clip_s:
        return [np.asarray(y, dtype=np.float32)]
    return [
        np.asarray(c, dtype=np.float32)
        for c in split_audio(
            audio_data=y,
            sample_rate=int(sr),
            max_clip_duration_s=cfg.max_audio_clip_s,
            overlap_duration_s=cfg.overlap_chunk_second,
            min_energy_window_size=cfg.min_energy_split_window_size,
        )
    ]


def reference(
    model_dir: Path, audio: list[np.ndarray], prompts: list[str], max_tokens: list[int]
) -> list[list[int]]:
    """transformers' greedy ``generate`` (GenerationMixin's, without Whisper's long-form and
    timestamp logic, which vLLM does not apply) of each chunk with its decoder prompt: the
    tokens after the prompt, up to its ``max_tokens`` or ``<|endoftext|>``."""
    import torch
    from transformers import AutoProcessor, GenerationMixin, WhisperForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir)
    model = WhisperForConditionalGeneration.from_pretrained(model_dir).eval()
    out = []
    with torch.no_grad():
        for y, prompt, n in zip(audio, prompts, max_tokens, strict=True):
            feats = processor.feature_extractor(y, sampling_rate=16000, return_tensors="pt")
            ids = processor.tokenizer(prompt, add_special_tokens=False).input_ids
            gen = GenerationMixin.generate(
                model,
                input_features=feats.input_features,
                decoder_input_ids=torch.tensor([ids]),
                max_new_tokens=n,
                do_sample=False,
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


def asr_reference(model_dir, audio: list, prompts: list[str], max_tokens: list[int]) -> list:
    """transformers' greedy ``generate`` of each chunk on its HF processor's inputs (a
    text-only prompt, ``None`` for its chunk: its tokens alone, which the processor does not
    take): (prompt ids, new tokens up to ``max_tokens`` or an end token)."""
    import torch
    from transformers import Qwen3ASRForConditionalGeneration, Qwen3ASRProcessor

    processor = Qwen3ASRProcessor.from_pretrained(model_dir)
    model = Qwen3ASRForConditionalGeneration.from_pretrained(model_dir).eval()
    out = []
    with torch.no_grad():
        for y, prompt, n in zip(audio, prompts, max_tokens, strict=True):
            if y is None:
                inputs = processor.tokenizer([prompt], return_tensors="pt")
            else:
                inputs = processor(
                    text=[prompt], audio=[y], sampling_rate=16000, return_tensors="pt"
                )
            ids = inputs["input_ids"][0].tolist()
            gen = model.generate(**inputs, max_new_tokens=n, do_sample=False)
            out.append((ids, gen[0, len(ids) :].tolist()))
    return out


def detected_language(model_dir: Path, audio: np.ndarray) -> str:
    """The language vLLM's server detects when a request names none: the most likely of
    Whisper's language tokens after ``<|startoftranscript|>`` (transformers on the same
    weights, over the languages vLLM's Whisper accepts)."""
    import torch
    from transformers import AutoProcessor, WhisperForConditionalGeneration
    from vllm.model_executor.models.whisper import WhisperForConditionalGeneration as VllmWhisper

    processor = AutoProcessor.from_pretrained(model_dir)
    model = WhisperForConditionalGeneration.from_pretrained(model_dir).eval()
    tokenizer = processor.tokenizer
    feats = processor.feature_extractor(audio, sampling_rate=16000, return_tensors="pt")
    sot = tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    with torch.no_grad():
        logits = model(
            input_features=feats.input_features, decoder_input_ids=torch.tensor([[sot]])
        ).logits[0, -1]
    codes = list(VllmWhisper.supported_languages)
    return max(codes, key=lambda c: float(logits[tokenizer.convert_tokens_to_ids(f"<|{c}|>")]))
