"""Speculative decoding through ``vllm.LLM`` on the emulated RBLN device (issue #34).

One subprocess runs every engine (``rbln_llm_run.py``'s ``runs``), the tests read its
results. The references are independent: transformers' greedy ``generate`` on the same
weights (never rbln-ray against itself) and, for random sampling, the target model's own
next-token distributions computed with transformers.

- ngram (prompt lookup) on the trained demo model, whose greedy Python copies its context
  (drafts accepted and rejected): continuous batching on a batch-4 artifact, a prompt over
  one prefill chunk, two prompts sharing a 256-token prefix (prefix caching); with the
  policy forced on, with the default ``auto`` policy, with speculation off (the plain RBLN
  path), and on the Ray executor (``take_draft_token_ids`` from the step results);
- draft_model: a perturbed copy of the tiny Llama (partial acceptance) and the target's own
  HF directory (every draft accepted), both compiled on first use with the target's KV
  geometry;
- random sampling: the output distribution of the first three tokens against the target's
  on an 8-token vocabulary (``allowed_token_ids``), chi-square.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile

import pytest
import torch

from rbln_ray.models import build_tiny_model
from tests.helpers import (
    EIGHT_PROMPTS,
    compiled_model,
    greedy_request,
    hf_greedy,
    perturbed_model,
    run_script,
)

# one subprocess runs every engine (the first test waits for it): up to 4 min on an idle
# 2-core machine, much longer while other work shares it
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

K_DEMO, K_TINY = 4, 3
NEW = 32
ALLOWED = list(range(300, 308))  # the sampling test's vocabulary
SAMPLES = 800
METRICS = ["vllm:spec_decode"]


def demo_compiled():
    from rbln_ray.compile import CompileSettings, resolve_compiled_dir
    from rbln_ray.models import demo_model_dir

    settings = CompileSettings(
        batch_size=4, max_seq_len=1024, decoder_batch_sizes=(4, 2, 1), spec_tokens=K_DEMO
    )
    return demo_model_dir(), resolve_compiled_dir(demo_model_dir(), settings)


def code_prompts(hf_dir) -> list[list[int]]:
    """Six prompts of held-out Python (the demo model never trained on them): one over a
    prefill chunk, two sharing their first 256 tokens, the rest short."""
    from transformers import AutoTokenizer

    from rbln_ray.models.tokenizer import corpus_files

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    held_out = corpus_files(offset_files=len(corpus_files()))
    ids = tok(held_out[0].read_text(errors="replace"))["input_ids"]
    shared = ids[:256]
    return [
        ids[300:460],  # > 128 tokens: two prefill chunks
        shared + ids[600:610],
        shared + ids[700:705],
        ids[900:940],
        ids[1000:1012],
        ids[1100:1160],
    ]


def spec_run(model, spec: dict | None, requests, policy: str = "always", **extra) -> dict:
    kwargs: dict = {"disable_log_stats": False}
    if spec is not None:
        kwargs["speculative_config"] = spec
        kwargs["additional_config"] = {"rbln_spec_policy": policy}
    kwargs.update(extra.pop("llm_kwargs", {}))
    return {
        "model": str(model),
        "llm_kwargs": kwargs,
        "requests": requests,
        "rpc": ["step_stats"],
        "metrics": METRICS,
        **extra,
    }


def sampling_prompt() -> list[int]:
    return ALLOWED * 3  # every token recurs: the n-gram proposer drafts at every step


@functools.cache
def results() -> dict:
    demo_hf, demo = demo_compiled()
    tiny_hf = build_tiny_model(family="llama")
    tiny = compiled_model("llama", spec_tokens=K_TINY)
    noisy = perturbed_model(tiny_hf, 0.04)
    prompts = code_prompts(demo_hf)
    greedy = [greedy_request(p, NEW) for p in prompts]
    ngram = {"method": "ngram", "num_speculative_tokens": K_DEMO, "prompt_lookup_max": 4}
    ngram["prompt_lookup_min"] = 2
    tiny_greedy = [greedy_request(p, 24) for p in EIGHT_PROMPTS]
    draft = {"method": "draft_model", "num_speculative_tokens": K_TINY}
    sampling = {
        "prompt_token_ids": sampling_prompt(),
        "params": {
            "temperature": 1.0,
            "max_tokens": 3,
            "ignore_eos": True,
            "allowed_token_ids": ALLOWED,
        },
    }
    runs = {
        "ngram": spec_run(demo, ngram, greedy),
        "auto": spec_run(demo, ngram, greedy, policy="auto"),
        "plain": spec_run(demo, None, greedy),
        "ray": spec_run(
            demo,
            ngram,
            greedy[3:],
            llm_kwargs={"distributed_executor_backend": "ray"},
            ray_local={"num_cpus": 2, "resources": {"RBLN": 1}},
        ),
        "draft_noisy": spec_run(tiny, {**draft, "model": str(noisy)}, tiny_greedy),
        "draft_self": spec_run(tiny, {**draft, "model": str(tiny_hf)}, tiny_greedy),
        "sampling": spec_run(
            tiny,
            {"method": "ngram", "num_speculative_tokens": K_TINY, "prompt_lookup_min": 1},
            [sampling] * SAMPLES,
        ),
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"runs": list(runs.values())}, f)  # too long for a command line
    try:
        out = run_script("rbln_llm_run.py", f"@{f.name}", timeout=1800)["runs"]
    finally:
        os.unlink(f.name)
    got = dict(zip(runs, out, strict=True))
    for name, result in got.items():
        assert "error" not in result, (name, result)
    return {
        "runs": got,
        "prompts": prompts,
        "demo_hf": demo_hf,
        "tiny_hf": tiny_hf,
    }


def tokens(result: dict) -> list[list[int]]:
    return [o[0]["token_ids"] for o in result["outputs"]]


def accepted(result: dict) -> tuple[int, int]:
    m = result["metrics"]
    return m["vllm:spec_decode_num_accepted_tokens"], m["vllm:spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("run", ["ngram", "auto", "plain"])
def test_ngram_greedy_equals_transformers(run: str) -> None:
    r = results()
    result = r["runs"][run]
    assert tokens(result) == hf_greedy(r["demo_hf"], r["prompts"], NEW)
    stats = result["rpc"]["step_stats"][0]
    # the shared prefix came from the cache (its first chunk at least: both prompts arrive
    # together, the second may start before the first's second chunk is computed)
    assert stats["prefix_reused_tokens"] >= 128 and stats["kv_copies"] >= 1
    assert stats["prefill_steps"] > len(r["prompts"])  # the long prompt took two chunks
    if run == "plain":
        assert stats["verify_steps"] == 0
        return
    good, drafted = accepted(result)
    assert 0 < good < drafted, (good, drafted)  # drafts accepted and rejected
    assert stats["spec_accepted_tokens"] == good
    assert stats["verify_steps"] > 0
    # fewer device calls than decoded tokens: accepted drafts cost no call of their own
    decoded = sum(len(t) - 1 for t in tokens(result))
    assert stats["verify_steps"] + stats["decode_steps"] < decoded


def test_ngram_on_the_ray_executor_equals_transformers() -> None:
    r = results()
    result = r["runs"]["ray"]
    assert tokens(result) == hf_greedy(r["demo_hf"], r["prompts"][3:], NEW)
    good, drafted = accepted(result)
    assert good > 0 and result["rpc"]["step_stats"][0]["verify_steps"] > 0


@pytest.mark.parametrize("run", ["draft_noisy", "draft_self"])
def test_draft_model_greedy_equals_transformers(run: str) -> None:
    r = results()
    result = r["runs"][run]
    assert tokens(result) == hf_greedy(r["tiny_hf"], EIGHT_PROMPTS, 24)
    good, drafted = accepted(result)
    stats = result["rpc"]["step_stats"][0]
    assert stats["draft_calls"] > 0 and stats["verify_steps"] > 0
    if run == "draft_self":
        assert good == drafted > 0  # the target drafting for itself: every draft accepted
    else:
        assert 0 < good < drafted


def target_distributions(hf_dir) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p(t1), p(t2 | t1), p(t3 | t1, t2) over ALLOWED (indices into it), temperature 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    prompt, a = sampling_prompt(), torch.tensor(ALLOWED)

    def probs(seqs: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor(seqs)).logits[:, -1, a]
        return torch.softmax(logits.double(), -1)

    p1 = probs([prompt])[0]
    p2 = probs([prompt + [t] for t in ALLOWED])
    p3 = probs([prompt + [t, u] for t in ALLOWED for u in ALLOWED]).view(8, 8, 8)
    return p1, p2, p3


def chi_square_p(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    """Goodness-of-fit p-value (cells expected under 5 pooled into one)."""
    n = counts.sum()
    expected = expected_p * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def test_random_sampling_keeps_the_target_distribution() -> None:
    """vLLM's rejection sampling (here on the host) must leave the output distribution the
    target model's: the first token (sampled after the prompt), the second (verified: an
    accepted draft or a recovered token) and the third, each against its exact marginal."""
    r = results()
    result = r["runs"]["sampling"]
    out = [[ALLOWED.index(t) for t in seq] for seq in tokens(result)]
    assert all(len(seq) == 3 for seq in out)
    good, drafted = accepted(result)
    assert 0 < good < drafted and result["rpc"]["step_stats"][0]["verify_steps"] > 0
    p1, p2, p3 = target_distributions(r["tiny_hf"])
    m2 = p1 @ p2
    m3 = torch.einsum("a,ab,abc->c", p1, p2, p3)
    for position, exact in enumerate((p1, m2, m3)):
        counts = torch.bincount(torch.tensor([s[position] for s in out]), minlength=8).double()
        p = chi_square_p(counts, exact)
        assert p > 1e-3, (position, p, (counts / counts.sum()).tolist(), exact.tolist())
