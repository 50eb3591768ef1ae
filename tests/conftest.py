"""Shared fixtures: locally built models and transformers' reference greedy output."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Small matmuls on a shared 2-core box run far faster single-threaded; children inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# Mixed prompt lengths the greedy tests share (token ids of the tiny models' vocab).
EIGHT_PROMPTS = [
    [5],
    [100, 200, 300, 400, 500, 600, 700],
    list(range(1000, 1037)),
    [7] * 130,  # crosses a 128-token prefill chunk
    [9, 8, 7],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [3000 + i for i in range(60)],
    [42, 4095, 1, 2],
]


def greedy_request(prompt: list[int], max_tokens: int) -> dict:
    """A ``rbln_llm_run.py`` request: greedy, ``ignore_eos``, exactly ``max_tokens``."""
    return {
        "prompt_token_ids": prompt,
        "params": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
    }


def hf_greedy(
    model_dir: Path | str, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """transformers' own greedy continuation (new token ids only) of each prompt.

    The independent reference every correctness test compares against.
    """
    import torch
    from transformers import AutoModelForCausalLM

    # .float(): a pre-quantized checkpoint (gpt-oss MXFP4) is dequantized to bfloat16 by
    # transformers on CPU; its values are exact in float32, where the comparison runs.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).float()
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


def compiled_model(family: str = "llama", model: dict | None = None, **settings) -> Path:
    """A tiny model of ``family`` (``model``: further ``TinyModelSpec`` fields) compiled on the
    emulator (cached by content and settings)."""
    os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")
    from rbln_ray.models import build_tiny_model
    from rbln_ray.vllm_plugin.loader import CompileSettings, resolve_compiled_dir

    defaults = {"batch_size": 4, "max_seq_len": 512, "decoder_batch_sizes": (4, 2, 1)}
    if settings.get("attn_impl") == "flash_attn":
        # optimum-rbln's ATOM limits: partition >= 1024 and max_seq_len >= 2 partitions.
        defaults.update(kvcache_partition_len=1024, max_seq_len=2048)
    return resolve_compiled_dir(
        build_tiny_model(family=family, **(model or {})),
        CompileSettings(**{**defaults, **settings}),
    )


def run_script(script: str, *args: str, timeout: float = 600, env: dict | None = None) -> dict:
    """Run ``tests/scripts/<script>`` in a fresh process and return its ``RESULT`` JSON."""
    import json
    import subprocess

    proc = subprocess.run(
        [PYTHON, str(ROOT / "tests" / "scripts" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "RBLN_RAY_DEVICE": "emulated", **(env or {})},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-3000:], proc.stderr[-6000:])
    return json.loads(lines[-1][len("RESULT ") :])


def count_refills(history: list) -> int:
    """Prefills that ran while other requests were mid-decode (they decoded before and after).

    ``history`` is the runner's ``StepStats.history``: (step, kind, request ids). A refill is a
    freed compiled batch slot reused without draining the batch: continuous batching.
    """
    decode_steps: dict[str, list[int]] = {}
    for step, kind, ids in history:
        if kind == "decode":
            for req in ids:
                decode_steps.setdefault(req, []).append(step)
    return sum(
        1
        for step, kind, ids in history
        if kind == "prefill"
        and any(min(v) < step < max(v) for r, v in decode_steps.items() if r != ids[0])
    )
