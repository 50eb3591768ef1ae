"""What rbln-ray takes from transformers beyond its public API: how many tokens Qwen3-ASR's
processor gives a clip.

Why: vLLM's multimodal processor must replace a prompt's one ``<|audio_pad|>`` with as many
as the audio tower will give, and transformers' ``Qwen3ASRProcessor`` computes that count only
in a private method (``_get_audio_token_length``: 13 tokens per 100-frame chunk, fewer for a
partial last chunk). Asking the processor keeps rbln-ray's count transformers' own, where a
copy of the formula could drift from it.
"""

from __future__ import annotations

from typing import Any

from rbln_ray.upstream.contract import Requirement, Upstream

UPSTREAM = Upstream("transformers", "transformers", "5.15.1")
QWEN3_ASR = "transformers.models.qwen3_asr.processing_qwen3_asr:Qwen3ASRProcessor"
REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement(
        f"{QWEN3_ASR}._get_audio_token_length",
        "rbln_ray/families/qwen3_asr.py",
        params=("audio_lengths", "n_window"),
    ),
)


def qwen3_asr_audio_tokens(processor: Any, frames: Any) -> int:
    """Audio tokens of a clip of ``frames`` valid mel frames (a count, or a 0-d tensor), as
    ``processor`` (a ``Qwen3ASRProcessor``) expands its placeholder."""
    import torch

    return int(processor._get_audio_token_length(torch.as_tensor(frames)))
