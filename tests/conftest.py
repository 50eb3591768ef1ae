"""Shared fixtures: locally built models and transformers' reference greedy output."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def hf_greedy(
    model_dir: Path | str, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """transformers' own greedy continuation (new token ids only) of each prompt.

    The independent reference every correctness test compares against.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    # Never stop at EOS and never mask it: matches vLLM's ignore_eos=True.
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=model.config.pad_token_id,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    """One tiny random-weight model directory per supported family."""
    from rbln_ray.models import FAMILIES, build_tiny_model

    return {family: build_tiny_model(family=family) for family in FAMILIES}
