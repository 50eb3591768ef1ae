"""vllm.LLM with compiled-in LoRA adapters and with quantized checkpoints (compiled on first
use), against independent plain-torch references, under continuous batching; and the
refusals at engine start. One process runs every engine in turn (rbln_llm_run's ``runs``).
"""

from __future__ import annotations

import json
import random

import pytest

from rbln_ray.models import build_tiny_model
from rbln_ray.models.adapters import build_tiny_adapter
from rbln_ray.models.quantized import build_tiny_quantized_model
from tests.helpers import (
    compiled_model,
    greedy_request,
    hf_greedy,
    hf_greedy_merged,
    hf_greedy_quantized,
    run_script,
)

pytestmark = pytest.mark.slow

COMPILE = {"batch_size": 4, "max_seq_len": 512, "decoder_batch_sizes": [4, 2, 1]}
NEW = 12


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(rng.randint(3, 150))] for _ in range(n)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every engine of this file, one after another in one process."""
    hf = build_tiny_model(family="llama")
    a = build_tiny_adapter(hf, r=4, alpha=8, targets=("q_proj", "v_proj"), seed=1)
    b = build_tiny_adapter(hf, r=8, alpha=16, targets=("o_proj", "gate_proj", "down_proj"), seed=2)
    b_other = build_tiny_adapter(hf, r=8, alpha=16, targets=("o_proj",), seed=3)
    wide = build_tiny_adapter(hf, r=16, alpha=16, targets=("q_proj",), seed=4)
    names = {None: None, "a": a, "b": b}
    # base, a, b interleaved: every decode batch of 4 mixes the base model and both adapters
    lora_prompts = _prompts(12, 3)
    which = [[None, "a", "b"][i % 3] for i in range(12)]
    lora_requests = []
    for prompt, name in zip(lora_prompts, which, strict=True):
        req = greedy_request(prompt, NEW)
        if name:  # vLLM's ids need not match the compiled ones: adapters are chosen by name
            req["lora"] = {"name": name, "id": 7 if name == "a" else 3, "path": str(names[name])}
        lora_requests.append(req)
    bad = [
        {**greedy_request([5, 6, 7], 4), "lora": {"name": "c", "id": 9, "path": str(a)}},
        {**greedy_request([5, 6, 7], 4), "lora": {"name": "b", "id": 3, "path": str(b_other)}},
    ]
    lora_kwargs = {
        "enable_lora": True,
        "max_loras": 2,  # acceptance 5: base rows beside both adapters at max_loras=2
        "max_lora_rank": 8,
        "additional_config": {
            "rbln_compile": {**COMPILE, "lora_modules": {"a": str(a), "b": str(b)}}
        },
    }
    quant_prompts = _prompts(10, 4)
    shared = [list(range(20, 150)) + p[:5] for p in _prompts(4, 5)]  # a 130-token prefix
    quantized = {
        "int8": build_tiny_quantized_model("int8"),
        "fp8": build_tiny_quantized_model("fp8"),
        "int8+fp8kv": build_tiny_quantized_model("int8", "fp8"),
    }
    plain = compiled_model("llama")
    specs = [
        {
            "model": str(hf),
            "llm_kwargs": lora_kwargs,
            "requests": lora_requests + bad,
            "rpc": ["step_stats"],
        },
        *[
            {
                "model": str(q),
                "llm_kwargs": {"additional_config": {"rbln_compile": COMPILE}},
                "requests": [greedy_request(p, NEW) for p in quant_prompts]
                + ([greedy_request(p, NEW) for p in shared] if "fp8kv" in name else []),
                "passes": 2 if "fp8kv" in name else 1,  # the second reuses cached fp8 KV
                "rpc": ["step_stats"],
            }
            for name, q in quantized.items()
        ],
        # refused at start, naming the problem
        {"model": str(plain), "llm_kwargs": {"enable_lora": True}, "requests": []},
        {
            "model": str(hf),
            "llm_kwargs": {
                **lora_kwargs,
                "additional_config": {
                    "rbln_compile": {**COMPILE, "lora_modules": {"w": str(wide)}}
                },
            },
            "requests": [],
        },
        {"model": str(plain), "llm_kwargs": {"kv_cache_dtype": "fp8"}, "requests": []},
        {"model": str(hf), "llm_kwargs": {"quantization": "fp8"}, "requests": []},
        {
            "model": str(quantized["int8"]),
            "llm_kwargs": {**lora_kwargs, "additional_config": lora_kwargs["additional_config"]},
            "requests": [],
        },
    ]
    # the host KV tier with an adapter: adapter a's prompt, pushed off the 4 eager blocks by 8
    # base prompts, comes back from the host for adapter a; the same prompt for the base
    # model shares nothing of it (vLLM's block hashes fold the adapter in)
    rng = random.Random(6)
    tier_prompt = [rng.randrange(10, 4000) for _ in range(200)]
    tier_fillers = _prompts(8, 7)
    tier_requests = [
        {**greedy_request(tier_prompt + [11], NEW), "lora": lora_of("a", a)},
        *[greedy_request(f, NEW) for f in tier_fillers],
        {**greedy_request(tier_prompt + [12, 13], NEW), "lora": lora_of("a", a)},
        greedy_request(tier_prompt + [12, 13], NEW),
    ]
    tier_root = tmp_path_factory.mktemp("tier")
    specs.append(
        {
            "model": str(hf),
            "llm_kwargs": {
                **lora_kwargs,
                "kv_transfer_config": {
                    "kv_connector": "RBLNHostKVConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"host_gib": 0.25, "root": str(tier_root)},
                },
            },
            "requests": tier_requests,
            "rpc": ["step_stats"],
        }
    )
    path = tmp_path_factory.mktemp("specs") / "runs.json"
    path.write_text(json.dumps({"runs": specs}))
    out = run_script("rbln_llm_run.py", f"@{path}", timeout=1500)["runs"]
    return {
        "out": out,
        "hf": hf,
        "adapters": names,
        "which": which,
        "lora_prompts": lora_prompts,
        "quantized": quantized,
        "quant_prompts": quant_prompts,
        "shared": shared,
        "tier_prompt": tier_prompt,
        "tier_fillers": tier_fillers,
    }


def lora_of(name: str, path) -> dict:
    return {"name": name, "id": 7 if name == "a" else 3, "path": str(path)}


def test_lora_batch_mixes_base_and_two_adapters_token_exact(runs) -> None:
    """Acceptance 1 and 5: base rows and rows of two adapters (ranks 4 and 8, disjoint
    targets) decode in the same batches at max_loras=2; each equals transformers with its
    adapter merged into the weights."""
    result = runs["out"][0]
    assert "error" not in result, result
    hf, adapters = runs["hf"], runs["adapters"]
    good = result["outputs"][: len(runs["which"])]
    for out, prompt, name in zip(good, runs["lora_prompts"], runs["which"], strict=True):
        assert out[0]["token_ids"] == hf_greedy_merged(hf, adapters[name], [prompt], NEW)[0]
    base = hf_greedy(hf, runs["lora_prompts"], NEW)
    for out, expected, name in zip(good, base, runs["which"], strict=True):
        assert (out[0]["token_ids"] == expected) == (name is None)  # adapters change tokens
    kind = dict(zip(result["request_ids"], runs["which"], strict=False))
    mixed = [
        {kind.get(r.rsplit("-", 1)[0], "?") for r in ids}  # vLLM id + "-" + a suffix
        for _, step, ids in result["rpc"]["step_stats"][0]["history"]
        if step == "decode"
    ]
    assert any({None, "a", "b"} <= rows for rows in mixed), mixed


def test_lora_requests_for_adapters_not_compiled_in_finish_with_an_error(runs) -> None:
    result = runs["out"][0]
    unknown, changed = result["outputs"][len(runs["which"]) :]
    assert unknown[0]["finish_reason"] == "error" and unknown[0]["token_ids"] == []
    assert changed[0]["finish_reason"] == "error" and changed[0]["token_ids"] == []


@pytest.mark.parametrize(("index", "name"), [(1, "int8"), (2, "fp8"), (3, "int8+fp8kv")])
def test_quantized_checkpoints_match_the_dequantized_reference(runs, index, name) -> None:
    """Acceptance 2: 10 requests (and 4 sharing a prefix) on a batch-4 artifact compiled on
    first use from the quantized checkpoint; each equals transformers computing the same
    quantized arithmetic in plain torch."""
    result = runs["out"][index]
    assert "error" not in result, result
    qdir = runs["quantized"][name]
    prompts = runs["quant_prompts"] + (runs["shared"] if "fp8kv" in name else [])
    expected = hf_greedy_quantized(qdir, prompts, NEW)
    for outputs in result["passes"]:
        assert [o[0]["token_ids"] for o in outputs] == expected
    assert [o[0]["token_ids"] for o in result["outputs"]] != hf_greedy(runs["hf"], prompts, NEW)
    stats = result["rpc"]["step_stats"][0]
    assert (
        stats["prefill_requests"] >= len(prompts) and stats["decode_rows"] > stats["decode_steps"]
    )
    if "fp8kv" in name:
        assert result["config"]["kv_cache_dtype"] == "fp8_e4m3"
        assert result["config"]["enable_prefix_caching"]
        assert stats["prefix_reused_tokens"] >= 128  # the second pass reused fp8 KV


@pytest.mark.parametrize(
    ("index", "names"),
    [
        (4, ["no LoRA adapters compiled in", "compiled into the model when the engine starts"]),
        (5, ["'w'", "rank 16 > max_lora_rank=8"]),
        (6, ["kv_cache_dtype='fp8'", "not fp8"]),
        (7, ["quantization='fp8'", "does not run on RBLN"]),
        (8, ["LoRA adapters on a quantized checkpoint"]),
    ],
)
def test_unservable_lora_and_quantization_settings_are_refused_at_start(runs, index, names):
    error = runs["out"][index].get("error", "")
    assert all(n in error for n in names), error


def test_an_adapters_prefix_comes_back_from_the_host_tier_for_that_adapter_only(runs) -> None:
    """Issue 45, acceptance 1: with the host KV tier, adapter a's 200-token prompt (pushed off
    the device by 8 base prompts) is loaded back from the host for adapter a (its one full
    128-token block), never for the base model's same prompt; every output equals transformers
    with the adapter merged (or the base model)."""
    result = runs["out"][9]
    assert "error" not in result, result
    hf, a = runs["hf"], runs["adapters"]["a"]
    prompt = runs["tier_prompt"]
    expected = [
        hf_greedy_merged(hf, a, [prompt + [11]], NEW)[0],
        *hf_greedy(hf, runs["tier_fillers"], NEW),
        hf_greedy_merged(hf, a, [prompt + [12, 13]], NEW)[0],
        hf_greedy(hf, [prompt + [12, 13]], NEW)[0],
    ]
    assert [o[0]["token_ids"] for o in result["outputs"]] == expected
    stats = result["rpc"]["step_stats"][0]
    assert stats["host_saves"] > 0 and stats["host_load_failures"] == 0
    assert stats["host_loads"] == 1 and stats["host_load_tokens"] == 128
