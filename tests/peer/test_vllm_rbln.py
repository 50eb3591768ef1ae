"""Rebellions' own vLLM plugin, vllm-rbln 0.12.0, runs unmodified on the emulator.

In the side environment (``make peer-env``), with vllm-rbln's defaults: its RBLN sampler
(graphs compiled by ``rebel.core.torch_compile.rbln_backend`` calling ``torch.ops.rbln.*``),
prefix caching (hits copied on the device with ``Runtime._copy_kv_cache``) and chunked
prefill at the compiled chunk. One engine start serves every request of this module.
The reference is transformers' own greedy output on the same weights.
"""

from __future__ import annotations

import json
import random
import uuid

import pytest

from benchmarks.peer_env import peer_env, peer_python
from rbln_ray.models import build_tiny_model
from tests.helpers import (
    EIGHT_PROMPTS,
    ROOT,
    SCRIPTS,
    compiled_model,
    greedy_request,
    hf_greedy,
    run_python,
)

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
MIXED = EIGHT_PROMPTS
_rng = random.Random(260)
SHARED = [_rng.randrange(10, 4000) for _ in range(260)]
SHARED_PREFIX = [SHARED + [_rng.randrange(10, 4000) for _ in range(3 + i)] for i in range(8)]


def run_in_peer(script: str, spec: dict, timeout: float) -> tuple[dict, str]:
    """Run ``tests/scripts/<script>`` in the side env; (its RESULT JSON, stdout + stderr)."""
    result, proc = run_python(
        [str(SCRIPTS / script), json.dumps(spec)],
        python=peer_python(),
        full_env=peer_env(RBLN_RAY_NODE_ID=f"peer-{uuid.uuid4().hex[:8]}"),  # private devices
        timeout=timeout,
        cwd=ROOT,
    )
    assert result is not None
    return result, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def peer_run() -> dict:
    """One vllm-rbln engine (side env, emulated ATOM) over every prompt; outputs and logs."""
    model = compiled_model("llama")  # the same artifact rbln-ray's own tests serve
    spec = {
        "model": str(model),
        # rbln-ray's runtime-call log, read through vLLM's public worker extension hook
        "llm_kwargs": {"worker_extension_cls": "rbln_ray.emulator.call_log.RuntimeCallsExtension"},
        "requests": [greedy_request(p, NEW_TOKENS) for p in MIXED + SHARED_PREFIX],
        "rpc": ["emulator_calls"],
    }
    result, log = run_in_peer("rbln_llm_run.py", spec, timeout=900)
    return {**result, "log": log}


def test_it_is_vllm_rbln_with_its_defaults(peer_run):
    log = peer_run["log"]
    assert "Platform plugin rbln is activated" in log
    assert "vllm_rbln:register" in log and "rbln_ray.vllm_plugin" not in log
    assert "Using RBLN sampler: True" in log  # graphs via rbln_backend + torch.ops.rbln.*
    assert "enable_prefix_caching=True" in log
    assert "max_num_batched_tokens from 1024 to 128" in log  # chunked prefill at the chunk


def test_greedy_token_exact_on_mixed_prompts(peer_run):
    got = [o[0]["token_ids"] for o in peer_run["outputs"][: len(MIXED)]]
    assert got == hf_greedy(build_tiny_model(family="llama"), MIXED, NEW_TOKENS)


def test_shared_prefix_hits_are_copied_on_the_device_and_token_exact(peer_run):
    got = [o[0]["token_ids"] for o in peer_run["outputs"][len(MIXED) :]]
    assert got == hf_greedy(build_tiny_model(family="llama"), SHARED_PREFIX, NEW_TOKENS)
    assert "KVCacheCopyError" not in peer_run["log"]
    calls = peer_run["rpc"]["emulator_calls"][0]["calls"]
    copies = [c for c in calls if c["kind"] == "copy"]
    # every later shared-prefix request reused the cached 256-token prefix (2 x 128 blocks)
    assert len(copies) >= len(SHARED_PREFIX) - 1, f"{len(copies)} KV copies"


def test_vllm_rbln_rejection_sampling_graph_is_greedy_verification():
    """vllm-rbln's own graph around torch.ops.rbln.rejection_sample (its speculative-decoding
    path), compiled with its own helper: greedy output equals a plain-Python verification."""
    gen = random.Random(5)
    vocab, width, counts = 10, 3, [3, 1, 2, 0]
    rows = [[gen.random() for _ in range(vocab)] for _ in range(width * len(counts))]
    best = [max(range(vocab), key=row.__getitem__) for row in rows]
    drafts = [best[0], best[1], (best[2] + 1) % vocab, best[3], best[4], (best[5] + 3) % vocab]
    starts = [sum(counts[:r]) for r in range(len(counts))]
    per_batch = [
        drafts[s : s + n] + [-1] * (width - n) for s, n in zip(starts, counts, strict=True)
    ]
    bonus = [[7], [8], [9], [6]]
    spec = {
        "draft_token_ids": drafts + [0] * (width * len(counts) - len(drafts)),
        "target_logits": rows,
        "cu_num_draft_tokens": [s + n for s, n in zip(starts, counts, strict=True)],
        "draft_per_batch": per_batch,
        "bonus_token_ids": bonus,
        "num_draft_tokens": counts,
    }
    expected = []
    for r, (s, n) in enumerate(zip(starts, counts, strict=True)):
        out, accepted = [], 0
        while accepted < n and drafts[s + accepted] == best[s + accepted]:
            out.append(drafts[s + accepted])
            accepted += 1
        out.append(best[s + accepted] if accepted < n else bonus[r][0])
        expected.append(out + [-1] * (width + 1 - len(out)))
    result, _ = run_in_peer("peer_rejection_sample.py", spec, timeout=300)
    assert result["out"] == expected
    assert expected[0][:3] == drafts[:2] + [best[2]]  # the case mixes accepts and a rejection
