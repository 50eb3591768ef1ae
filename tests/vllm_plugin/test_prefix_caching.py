"""Automatic prefix caching and chunked prefill on RBLN, token-exact against transformers.

Prefixes of 0, 1, several and a partial vLLM block (128 tokens), shared within a batch (the
hit lives in a running request's RBLN block: an on-device copy) and across batches (a
finished request's block: adopted), first and second pass, under continuous batching; a
workload with more distinct prefixes than RBLN blocks (evictions); an artifact with fewer
RBLN blocks than batch x sequences (RBLN-block preemption while cached blocks are shared);
aborts while a prefix is shared.
"""

from __future__ import annotations

import json
import random

import pytest

from rbln_ray.models import build_tiny_model
from tests.conftest import compiled_model, greedy_request, hf_greedy, run_script

pytestmark = pytest.mark.slow


def run_exact(model, prompts: list[list[int]], max_tokens: list[int], **spec) -> dict:
    """Serve ``prompts`` with ``vllm.LLM`` on ``model``; assert every pass equals transformers'
    greedy output; return the run (its step stats under ``stats``)."""
    run = {
        "model": str(model),
        "requests": [greedy_request(p, m) for p, m in zip(prompts, max_tokens, strict=True)],
        "rpc": ["step_stats"],
        **spec,
    }
    result = run_script("rbln_llm_run.py", json.dumps(run))
    hf_dir = build_tiny_model(family="llama")
    expected = [hf_greedy(hf_dir, [p], m)[0] for p, m in zip(prompts, max_tokens, strict=True)]
    for n, outputs in enumerate(result["passes"]):
        assert [o[0]["token_ids"] for o in outputs] == expected, f"pass {n + 1} differs"
    result["stats"] = result["rpc"]["step_stats"][0]
    return result


def _shared_prefix_prompts(rng: random.Random, long_prefix: bool) -> list[list[int]]:
    """Groups of 4 prompts sharing 0, 128 (one block), 200 (one block and a part) and 384
    (several blocks) tokens, each with its own suffix; with ``long_prefix`` two more sharing
    1,100 tokens (across a flash partition)."""

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 4096) for _ in range(n)]

    prompts = []
    for shared in (0, 128, 200, 384):
        prefix = tokens(shared)
        prompts += [prefix + tokens(rng.randint(5, 40)) for _ in range(4)]
    if long_prefix:
        prefix = tokens(1100)
        prompts += [prefix + tokens(rng.randint(5, 40)) for _ in range(2)]
    return prompts


@pytest.mark.parametrize("attn_impl", ["eager", "flash_attn"])
def test_shared_prefixes_are_reused_and_exact(attn_impl: str) -> None:
    rng = random.Random(11)
    prompts = _shared_prefix_prompts(rng, long_prefix=attn_impl == "flash_attn")
    rng.shuffle(prompts)
    max_tokens = [rng.randint(4, 24) for _ in prompts]
    model = compiled_model("llama", attn_impl=attn_impl)
    result = run_exact(model, prompts, max_tokens, passes=2)
    assert result["config"]["enable_prefix_caching"]  # on by default
    stats = result["stats"]
    # Both ways of reusing a prefix happened: copies (the holder was still running) and
    # adoption (reused tokens beyond what was copied); no hit had to be recomputed.
    assert stats["kv_copies"] > 0
    assert stats["prefix_reused_tokens"] > stats["kv_copy_tokens"] > 0
    assert stats["prefix_recomputed_tokens"] == 0
    # Prompts longer than a chunk were prefilled chunk by chunk, with decodes in between.
    assert stats["prefill_steps"] > stats["prefill_requests"]
    assert interleaved_chunks(stats["history"]) > 0


def interleaved_chunks(history: list) -> int:
    """Requests with a decode step of other requests between two of their prefill chunks."""
    chunks: dict[str, list[int]] = {}
    decode_steps = []
    for step, kind, ids in history:
        if kind == "prefill":
            chunks.setdefault(ids[0], []).append(step)
        else:
            decode_steps.append(step)
    return sum(
        1
        for steps in chunks.values()
        if any(a < d < b for a, b in zip(steps, steps[1:], strict=False) for d in decode_steps)
    )


def test_prefix_caching_off_recomputes_everything() -> None:
    rng = random.Random(3)
    prompts = _shared_prefix_prompts(rng, long_prefix=False)[4:12]
    llm_kwargs = {"enable_prefix_caching": False}
    result = run_exact(compiled_model("llama"), prompts, [8] * 8, passes=2, llm_kwargs=llm_kwargs)
    assert not result["config"]["enable_prefix_caching"]
    stats = result["stats"]
    assert stats["prefix_reused_tokens"] == 0 and stats["kv_copies"] == 0
    assert stats["prefill_tokens"] == 2 * sum(len(p) for p in prompts)


def test_more_prefixes_than_blocks_evict_consistently() -> None:
    """12 distinct 300-token prefixes, twice, on 8 RBLN blocks (flash) whose 64 vLLM blocks
    could remember more than the device holds: vLLM's prefix cache must forget what the
    device overwrote, so no hit ever has to be recomputed, and outputs stay exact."""
    rng = random.Random(5)
    prefixes = [[rng.randrange(1, 4096) for _ in range(300)] for _ in range(12)]
    prompts = [p + [rng.randrange(1, 4096) for _ in range(9)] for p in prefixes]
    # Newest first: an LRU device cache still holds the latest prefixes, not the oldest.
    prompts += [p + [rng.randrange(1, 4096) for _ in range(13)] for p in reversed(prefixes)]
    model = compiled_model("llama", attn_impl="flash_attn")
    stats = run_exact(model, prompts, [6] * len(prompts))["stats"]
    assert stats["prefix_recomputed_tokens"] == 0
    # Some second-round prompts still found their prefix on the device, the oldest did not.
    assert 0 < stats["prefix_reused_tokens"] < 12 * 256


def test_rbln_block_preemption_with_shared_prefix() -> None:
    """5 RBLN blocks of 1,024 tokens for batch 4: four requests sharing 900 tokens all decode
    past position 1,024 and need a second block each, so some must be preempted (and later
    resumed, their prefix found again) — every output still equals transformers'."""
    rng = random.Random(9)
    prefix = [rng.randrange(1, 4096) for _ in range(900)]
    prompts = [prefix + [rng.randrange(1, 4096) for _ in range(60 + i)] for i in range(4)]
    model = compiled_model("llama", attn_impl="flash_attn", kvcache_num_blocks=5)
    stats = run_exact(model, prompts, [110] * 4)["stats"]
    decoded: set[str] = set()
    restarted = 0
    for _, kind, ids in stats["history"]:
        if kind == "decode":
            decoded.update(ids)
        elif ids[0] in decoded:  # a prefill of a request that had already decoded: resumed
            restarted += 1
    assert restarted >= 1
    assert stats["prefix_reused_tokens"] > 0


def test_abort_while_prefix_is_shared() -> None:
    rng = random.Random(13)
    prefix = [rng.randrange(1, 4096) for _ in range(300)]
    suffixes = [[rng.randrange(1, 4096) for _ in range(7 + i)] for i in range(10)]
    result = run_script(
        "rbln_prefix_abort.py",
        json.dumps({"model": str(compiled_model("llama")), "prefix": prefix, "suffixes": suffixes}),
    )
    hf_dir = build_tiny_model(family="llama")
    for req_id, tokens in result["completed"].items():
        prompt = prefix + suffixes[int(req_id[1:])]
        assert tokens == hf_greedy(hf_dir, [prompt], len(tokens))[0], req_id
    assert set(result["aborted"]) == {"r0", "r1", "r2", "r3"}
    assert len(result["completed"]) == 6
    assert result["stats"]["prefix_reused_tokens"] > 0
    assert result["stats"]["slots_in_use"] == 0
