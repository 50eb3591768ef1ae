"""The copier (rbln_ray.models.copier): hand-set weights that must implement an induction
circuit, checked on the model transformers runs: layer 1's heads attend exactly k tokens
back, and greedy decoding continues a span of random tokens the prompt restarts."""

from __future__ import annotations

import pytest
import torch

from rbln_ray.models.copier import CopierShape, copier_model

VOCAB = 4096


@pytest.fixture(scope="module")
def model():
    return copier_model(CopierShape(), VOCAB)


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(16, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_layer_one_heads_attend_their_lag_back(model) -> None:
    ids = torch.tensor([random_tokens(700, seed=0)])
    model.config._attn_implementation = "eager"  # attention weights are returned by eager only
    with torch.no_grad():
        attn = model(ids, output_attentions=True).attentions[0][0]  # [heads, query, key]
    lags = len(CopierShape().match_weights)
    positions = torch.arange(lags, ids.shape[1])
    for head in range(lags):
        looked_at = attn[head, positions].argmax(-1)
        assert torch.equal(looked_at, positions - (head + 1)), f"head {head}"
        assert attn[head, positions].max(-1).values.min() > 0.99, f"head {head} not sharp"


def test_greedy_continues_the_span_its_prompt_restarts(model) -> None:
    for seed in range(3):
        span = random_tokens(300, seed=seed + 1)
        prompt = torch.tensor([span + span[:16]])
        with torch.no_grad():
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=64,
                do_sample=False,
                pad_token_id=0,
            )[0, prompt.shape[1] :].tolist()
        assert out == span[16:80], f"seed {seed}"
