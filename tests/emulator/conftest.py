"""Shared fixtures: emulator on, a per-session emulated node, transformers references."""

from __future__ import annotations

import os
import uuid

import pytest

# Locks are keyed by node; a private node id keeps this session off other sessions' devices.
os.environ["RBLN_RAY_DEVICE"] = "emulated"
os.environ.setdefault("RBLN_RAY_NODE_ID", f"pytest-{uuid.uuid4().hex[:8]}")
# Tiny matmuls on a shared 2-core box are far faster single-threaded (no OpenMP barriers);
# children inherit this through the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from rbln_ray.emulator import ensure_runtime  # noqa: E402

ensure_runtime()

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

_REFERENCE_CACHE: dict[tuple, list[int]] = {}


def transformers_greedy(hf_dir, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' own ``generate(do_sample=False)`` on one unpadded prompt (cached)."""
    key = (str(hf_dir), tuple(prompt), new_tokens)
    if key not in _REFERENCE_CACHE:
        import torch
        from transformers import AutoModelForCausalLM

        model = _hf_model(str(hf_dir))
        ids = torch.tensor([prompt], dtype=torch.int64)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=None,
        )
        _REFERENCE_CACHE[key] = out[0, len(prompt) :].tolist()
        del AutoModelForCausalLM
    return _REFERENCE_CACHE[key]


_MODELS: dict[str, object] = {}


def _hf_model(hf_dir: str):
    if hf_dir not in _MODELS:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        _MODELS[hf_dir] = model
    return _MODELS[hf_dir]


@pytest.fixture(scope="session")
def tiny_models():
    from rbln_ray.models import build_tiny_model

    return {f: build_tiny_model(family=f) for f in ("llama", "qwen2", "qwen3", "mistral")}
