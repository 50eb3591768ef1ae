"""Embeddings, classifications and scores of compiled pooling models through
``vllm.LLM(runner="pooling")``, against plain vLLM-CPU on the same weights (acceptance 1 of the
pooling-models issue, 2 of the speech and retrieval issue): every encoder family (embedding
models and cross-encoder rerankers) and every decoder read as one (Qwen3 embedder, Qwen3
reranker).

Each side runs every family in one process, one engine after another (the imports once)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from rbln_ray.families.registry import ENCODERS, POOLING_DECODERS
from rbln_ray.models import build_tiny_encoder, build_tiny_model
from tests.embeddings import QUERY, TEXTS, assert_embeddings_match
from tests.helpers import EMBED_MAX_LEN, vllm_embeddings

pytestmark = pytest.mark.slow

FAMILIES = {**ENCODERS, **POOLING_DECODERS}


def model_dir(family: str) -> Path:
    """The tiny HF directory of a pooling family: an encoder's own, or a decoder checkpoint
    (each decoder-based family its own seed, so that each is a model of its own)."""
    if family in ENCODERS:
        return build_tiny_encoder(family=family)
    record = POOLING_DECODERS[family]
    return build_tiny_model(
        family=record.decoder_family, seed=1 + list(POOLING_DECODERS).index(family)
    )


@pytest.fixture(scope="module")
def both_sides() -> dict[str, tuple[dict, dict]]:
    """Per family: (rbln-ray's results, plain vLLM-CPU's) on the HF directory (compiled on
    first use)."""
    dirs = {family: model_dir(family) for family in FAMILIES}
    overrides = {
        str(dirs[f]): dict(r.hf_overrides) for f, r in POOLING_DECODERS.items() if r.hf_overrides
    }
    too_long = [5] * (EMBED_MAX_LEN + 1)
    common = {"hf_overrides": overrides}
    ours = vllm_embeddings(
        list(dirs.values()), TEXTS, QUERY, "emulated", step_stats=True, too_long=too_long, **common
    )
    plain = vllm_embeddings(list(dirs.values()), TEXTS, QUERY, **common)
    return {family: (ours[d], plain[d]) for family, d in dirs.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pooling_outputs_match_vllm_cpu(both_sides, family: str) -> None:
    """``LLM.embed`` or ``LLM.classify``, and ``LLM.score``, equal plain vLLM's."""
    ours, plain = both_sides[family]
    task = FAMILIES[family].task
    # A compiled classifier ends in its sequence head (an encoder's), or scores from the last
    # token's logits (a decoder's): no per-token classification.
    per_token = {"token_classify"} if task == "classify" else set()
    assert set(ours["tasks"]) == set(plain["tasks"]) - per_token and task in ours["tasks"]
    assert ours["prompt_lens"] == plain["prompt_lens"]
    if task == "embed":
        assert_embeddings_match(ours["embeddings"], plain["embeddings"])
    else:  # a reranker: one relevance probability per text, and they differ between texts
        for got, want in zip(ours["probs"], plain["probs"], strict=True):
            assert len(got) == len(want) == 1 and abs(got[0] - want[0]) < 1e-4, (got, want)
        assert max(p[0] for p in plain["probs"]) - min(p[0] for p in plain["probs"]) > 0.05
        for got, want in zip(ours["pair_probs"], plain["pair_probs"], strict=True):
            assert abs(got[0] - want[0]) < 1e-4, (ours["pair_probs"], plain["pair_probs"])
    for got, want in zip(ours["scores"], plain["scores"], strict=True):
        assert abs(got - want) < 1e-4, (ours["scores"], plain["scores"])
    assert all(math.isfinite(s) for s in ours["scores"])
    if "token_type_ids" in getattr(FAMILIES[family], "input_names", ()) and task == "classify":
        # A BERT cross-encoder's score reads the pair's segment ids: the same tokens without
        # them (pair_probs) score differently on the reference, so agreeing with its scores
        # shows they reached the compiled graph.
        gaps = [abs(p[0] - s) for p, s in zip(plain["pair_probs"], plain["scores"], strict=True)]
        assert max(gaps) > 1e-3, gaps
    stats = ours["step_stats"][0]
    assert stats["prefill_requests"] >= len(TEXTS)
    if family in ENCODERS:  # many short inputs share one compiled call (batch 4)
        assert stats["prefill_steps"] < stats["prefill_requests"]
    # Too long for the compiled model: vLLM refuses it, naming both lengths.
    assert ours["refused"] is not None
    assert str(EMBED_MAX_LEN + 1) in ours["refused"] and str(EMBED_MAX_LEN) in ours["refused"]
