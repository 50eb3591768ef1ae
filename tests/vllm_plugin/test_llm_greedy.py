"""vllm.LLM on the RBLN platform: token-exact against transformers, continuous batching."""

from __future__ import annotations

import json
import random

import pytest

from rbln_ray.models import build_tiny_model
from tests.helpers import (
    EIGHT_PROMPTS,
    compiled_model,
    count_refills,
    greedy_request,
    hf_greedy,
    run_script,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("family", "attn_impl"),
    [
        pytest.param("llama", "eager", marks=pytest.mark.smoke),
        ("llama", "flash_attn"),
        ("qwen2", "eager"),
        ("qwen3", "flash_attn"),
    ],
)
def test_llm_greedy_matches_transformers(family: str, attn_impl: str) -> None:
    model = compiled_model(family, attn_impl=attn_impl)
    prompts = EIGHT_PROMPTS + ([[17] * 1100] if attn_impl == "flash_attn" else [])
    spec = {"model": str(model), "requests": [greedy_request(p, 16) for p in prompts]}
    result = run_script("rbln_llm_run.py", json.dumps(spec))
    got = [o[0]["token_ids"] for o in result["outputs"]]
    assert got == hf_greedy(build_tiny_model(family=family), prompts, 16)
    # vLLM was configured from rbln_config.json, not from its own defaults.
    cfg = result["config"]
    assert cfg["max_num_seqs"] == 4
    assert cfg["max_model_len"] == (2048 if attn_impl == "flash_attn" else 512)
    # vLLM blocks are one compiled prefill chunk, mapped onto the compiled KV blocks.
    assert cfg["block_size"] == 128
    compiled_blocks = 8 if attn_impl == "flash_attn" else 4
    per_block = (1024 if attn_impl == "flash_attn" else 512) // 128
    assert cfg["num_gpu_blocks"] == compiled_blocks * per_block + 1


def test_continuous_batching_32_requests_refill_slots() -> None:
    """32 requests on a batch-4 model: each equals its solo greedy result; slots refill."""
    rng = random.Random(7)
    lengths = [1, 300] + [rng.randint(1, 300) for _ in range(30)]
    prompts = [[rng.randrange(4096) for _ in range(n)] for n in lengths]
    max_tokens = [1, 64] + [rng.randint(1, 64) for _ in range(30)]
    spec = {
        "model": str(compiled_model("llama")),
        "requests": [greedy_request(p, m) for p, m in zip(prompts, max_tokens, strict=True)],
        "rpc": ["step_stats"],
    }
    result = run_script("rbln_llm_run.py", json.dumps(spec))
    got = [o[0]["token_ids"] for o in result["outputs"]]
    hf_dir = build_tiny_model(family="llama")
    expected = [hf_greedy(hf_dir, [p], m)[0] for p, m in zip(prompts, max_tokens, strict=True)]
    assert got == expected

    stats = result["rpc"]["step_stats"][0]
    history = stats["history"]
    assert stats["prefill_requests"] == 32
    assert all(len(ids) == 1 for _, kind, ids in history if kind == "prefill")
    assert max(len(ids) for _, kind, ids in history if kind == "decode") == 4
    # Refilling: some request's prefill ran while other requests were mid-decode (they
    # decoded both before and after it), i.e. a freed slot was reused without draining.
    refills = count_refills(history)
    assert refills >= 10, f"only {refills} prefills interleaved with running decodes"
