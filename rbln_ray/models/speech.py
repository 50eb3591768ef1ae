"""A deterministic tiny speech-to-text model (Whisper) and test audio, built offline.

Why: the speech tests compare rbln-ray with transformers' ``generate`` on the same weights, so
they need a real model directory (``WhisperForConditionalGeneration``, a ``WhisperProcessor``
whose feature extractor makes the 80 log-mel bins x 3000 frames of a 30-second window, and a
tokenizer with Whisper's special tokens), built without a model hub. The recipe and the
tokenizer's layout are the family's (:mod:`rbln_ray.families.whisper`); the tokenizer's text
vocabulary is the local byte-level BPE's (:mod:`.tokenizer`) without its own special tokens.
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
from typing import Any

import numpy as np

from rbln_ray.common.paths import atomic_dir, cache_dir
from rbln_ray.families.registry import SPEECH
from rbln_ray.models.tokenizer import BOS, EOS, PAD, build_tokenizer

logger = logging.getLogger(__name__)

SAMPLE_RATE = 16_000  # Whisper's


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


def _tokenizer(code: Any, vocab_size: int) -> Any:
    """The family's tokenizer over the local BPE's text vocabulary (its own specials dropped)."""
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
    return code.tiny_tokenizer(vocab, merges)


def build_tiny_whisper(
    spec: TinyWhisperSpec | None = None, out_dir: Path | None = None, **kw
) -> Path:
    """Build (once, cached by spec) a random-weight Whisper directory with its processor."""
    import torch

    spec = spec or TinyWhisperSpec(**kw)
    out = out_dir or cache_dir() / "models" / f"tiny-whisper-{spec.key()}"
    if (out / "config.json").exists():
        return out
    code = SPEECH["whisper"].code()
    tokenizer = _tokenizer(code, spec.vocab_size)
    torch.manual_seed(spec.seed)
    model, processor = code.tiny_model(spec, tokenizer)
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
