"""Every model-zoo family under ``vllm.LLM`` on the RBLN backend, token-exact against
transformers, under continuous batching.

One engine per (family, attention) artifact runs all prompts at once on a batch-4 model:
short prompts decode while longer ones are prefilled chunk by chunk in between (for the
families whose prefill can resume), slots free and refill, and every request's greedy
tokens must equal transformers' own ``generate`` on the same weights. Prompts are longer
than the tiny models' sliding window (64), and decoding crosses it. The artifact is
compiled by the code path ``rbln-ray compile`` uses (``rbln_ray.models.compile``).
"""

from __future__ import annotations

import json
import random

import pytest

from rbln_ray.models import build_tiny_model
from rbln_ray.models.builder import DEFAULT_WINDOW
from rbln_ray.models.zoo import FAMILIES
from tests.conftest import compiled_model, count_refills, greedy_request, hf_greedy, run_script

pytestmark = pytest.mark.slow

# The four families verified before the zoo keep their own test (test_llm_greedy.py);
# mistral is verified here with a sliding window on every layer (cache_impl "sliding_window").
ZOO = [name for name in FAMILIES if name not in ("llama", "qwen2", "qwen3")]
CASES = [
    (name, impl)
    for name in ZOO
    for impl in ("eager", "flash_attn")
    if impl in FAMILIES[name].verified_by
]
LEARNED_POSITIONS = ("gpt2", "opt")  # flash needs max_seq_len 2048 positions


def model_spec(family: str, attn_impl: str) -> dict:
    """``TinyModelSpec`` fields beyond the family."""
    spec: dict = {}
    if family == "mistral":
        spec["sliding_window"] = DEFAULT_WINDOW
    if attn_impl == "flash_attn" and family in LEARNED_POSITIONS:
        spec["max_position_embeddings"] = 2048
    return spec


def workload(flash: bool) -> tuple[list[list[int]], list[int]]:
    """Short prompts first (they decode while the long ones prefill), then prompts spanning
    several 128-token chunks and several windows."""
    rng = random.Random(15)
    lengths = [3, 40, 70, 9, 300, 200, 130, 61]
    if flash:
        lengths.append(1100)  # crosses a 1024-token partition
    prompts = [[rng.randrange(4096) for _ in range(n)] for n in lengths]
    max_tokens = [24, 16, 8, 20, 16, 12, 16, 10] + ([8] if flash else [])
    return prompts, max_tokens


@pytest.mark.parametrize(("family", "attn_impl"), CASES, ids=[f"{f}-{a}" for f, a in CASES])
def test_family_greedy_matches_transformers(family: str, attn_impl: str) -> None:
    spec = model_spec(family, attn_impl)
    model = compiled_model(family, model=spec, attn_impl=attn_impl)
    prompts, max_tokens = workload(attn_impl == "flash_attn")
    run = {
        "model": str(model),
        "requests": [greedy_request(p, m) for p, m in zip(prompts, max_tokens, strict=True)],
        "rpc": ["step_stats"],
    }
    result = run_script("rbln_llm_run.py", json.dumps(run), timeout=900)
    got = [o[0]["token_ids"] for o in result["outputs"]]
    # greedy continuations are prefixes of longer ones: one reference run per prompt
    expected = [
        full[:m]
        for full, m in zip(
            hf_greedy(build_tiny_model(family=family, **spec), prompts, max(max_tokens)),
            max_tokens,
            strict=True,
        )
    ]
    assert got == expected

    history = result["rpc"]["step_stats"][0]["history"]
    assert count_refills(history) >= 1, "no prefill ran while other requests were decoding"
    sliding = FAMILIES[family].attention == "hybrid" or family == "mistral"
    resumable = FAMILIES[family].prefill_resumable
    assert result["config"]["enable_prefix_caching"] is not (sliding or not resumable)
    prefills: dict[str, list[int]] = {}
    for step, kind, ids in history:
        if kind == "prefill":
            prefills.setdefault(ids[0], []).append(step)
    chunked = [steps for steps in prefills.values() if len(steps) > 1]
    if resumable:
        # a long prompt's chunks ran in separate steps with decodes between them
        assert any(s[-1] - s[0] > len(s) - 1 for s in chunked), prefills
    else:
        assert not chunked, "a non-resumable family's prompt was prefilled in several steps"
