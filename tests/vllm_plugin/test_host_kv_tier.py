"""The host KV tier (``kv_transfer_config: RBLNHostKVConnector``) through ``vllm.LLM``, token-exact
against transformers: prompts whose prefixes the device had to drop come back from host memory
instead of being computed again; prefixes under two ``cache_salt`` values never share; a
prefill engine hands its prompts' KV to a decode engine."""

from __future__ import annotations

import contextlib
import json
import random
import sqlite3

import pytest

from rbln_ray.models import build_tiny_model
from tests.helpers import compiled_model, greedy_request, hf_greedy, run_script
from tests.vllm_plugin.test_prefix_caching import run_exact

pytestmark = pytest.mark.slow


def tier_kwargs(root) -> dict:
    return {"disable_log_stats": False,  # vLLM's prefix-cache counters
            "kv_transfer_config": {"kv_connector": "RBLNHostKVConnector", "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"host_gib": 0.25,
                                                                 "root": str(root)}}}  # fmt: skip


def test_prefixes_the_device_dropped_come_back_from_the_host(tmp_path) -> None:
    """12 distinct 300-token prefixes, then each again (newest first), on 8 RBLN blocks
    (flash): without the tier the oldest prefixes are computed again (the device overwrote
    them); with it every second-round prompt finds its prefix, on the device or loaded from
    the host, and every output equals transformers'. Then the same prompt under two
    ``cache_salt`` values: the second salt finds nothing of the first."""
    rng = random.Random(5)
    prefixes = [[rng.randrange(1, 4096) for _ in range(300)] for _ in range(12)]
    prompts = [p + [rng.randrange(1, 4096) for _ in range(9)] for p in prefixes]
    prompts += [p + [rng.randrange(1, 4096) for _ in range(13)] for p in reversed(prefixes)]
    model = compiled_model("llama", attn_impl="flash_attn")
    result = run_exact(model, prompts, [6] * len(prompts), llm_kwargs=tier_kwargs(tmp_path),
                       metrics=["vllm:external_prefix_cache", "vllm:prefix_cache"])  # fmt: skip
    stats = result["stats"]
    assert stats["host_saves"] > 0 and stats["host_loads"] > 0
    assert stats["host_load_failures"] == 0 and stats["prefix_recomputed_tokens"] == 0
    # every second-round prompt reused its whole prefix (2 full 128-token blocks of 300)
    assert stats["prefix_reused_tokens"] == 12 * 256
    assert stats["host_load_tokens"] == result["metrics"]["vllm:external_prefix_cache_hits"]
    assert result["metrics"]["vllm:external_prefix_cache_hits"] > 0


def test_two_cache_salts_never_share_a_tier_entry(tmp_path) -> None:
    """A prompt under salt ``x``, pushed off the device by twelve other prefixes, comes back
    from the host for salt ``x``; the same prompt under salt ``y`` finds nothing (vLLM's
    block hashes fold the salt in, and the tier is keyed by them). Outputs equal
    transformers'."""
    rng = random.Random(8)
    shared = [rng.randrange(1, 4096) for _ in range(300)]
    # more than the 8 RBLN blocks, and the salted prompts well after the eviction (the tier
    # has an entry once a worker step saved it: the next step's scheduling may not see it)
    fillers = [[rng.randrange(1, 4096) for _ in range(300)] for _ in range(12)]
    prompts = [shared + [7], *fillers, shared + [8, 9], shared + [10, 11]]
    salts = ["x"] + [None] * 12 + ["x", "y"]
    requests = [
        {**greedy_request(p, 6), **({"cache_salt": s} if s else {})}
        for p, s in zip(prompts, salts, strict=True)
    ]
    model = compiled_model("llama", attn_impl="flash_attn")
    result = run_exact(model, prompts, [6] * len(prompts), requests=requests,
                       llm_kwargs=tier_kwargs(tmp_path))  # fmt: skip
    stats = result["stats"]
    assert stats["host_loads"] == 1 and stats["host_load_tokens"] == 256  # salt x's prefix
    assert stats["prefix_reused_tokens"] == 256  # salt y reused nothing


def test_a_prefill_engine_hands_its_prompts_kv_to_a_decode_engine(tmp_path) -> None:
    """Prefill/decode disaggregation through the tier, as vLLM's P/D proxies drive it: a
    prefill engine (``kv_role: kv_producer``) runs each prompt for one token and exports its
    KV to the node's tier before that token leaves the engine; its answer's
    ``kv_transfer_params`` say so. A decode engine (``kv_consumer``) on the same tier then
    loads every full block of each prompt instead of computing it, and decodes on: the first
    token and the whole output equal transformers'. (Which requests export:
    tests/unit/test_pd_exports.py.)"""
    rng = random.Random(21)
    prompts = [[rng.randrange(1, 4096) for _ in range(300 + 40 * i)] for i in range(4)]
    full = [len(p) // 128 * 128 for p in prompts]  # 2, 2, 2 and 3 full 128-token blocks
    model = compiled_model("llama", attn_impl="flash_attn")

    def engine(role: str, max_tokens: int) -> dict:
        kwargs = tier_kwargs(tmp_path)
        kwargs["kv_transfer_config"]["kv_role"] = role
        requests = [greedy_request(p, max_tokens) for p in prompts]
        return {"model": str(model), "requests": requests, "rpc": ["step_stats"],
                "llm_kwargs": kwargs, "metrics": ["vllm:external_prefix_cache"]}  # fmt: skip

    runs = run_script("rbln_llm_run.py", json.dumps({"runs": [
        engine("kv_producer", 1), engine("kv_consumer", 8)]}))["runs"]  # fmt: skip
    prefill, decode = runs
    hf_dir = build_tiny_model(family="llama")
    expected = [hf_greedy(hf_dir, [p], 8)[0] for p in prompts]
    outputs = [o[0] for o in prefill["outputs"]]
    assert [o["token_ids"] for o in outputs] == [e[:1] for e in expected]
    params = [dict(o["kv_transfer_params"]) for o in outputs]
    named = [p.pop("block_hashes") for p in params]  # the exported blocks, by vLLM's hashes
    assert params == [{"do_remote_prefill": True, "host_tier": tmp_path.name, "node_id": None,
                       "exported_tokens": n} for n in full]  # fmt: skip
    assert [len(h) for h in named] == [n // 128 for n in full]
    with contextlib.closing(sqlite3.connect(tmp_path / "index.sqlite")) as db:
        held = {h.hex() for (h,) in db.execute("SELECT hash FROM blocks")}
    assert {h for hs in named for h in hs} == held
    stats = prefill["rpc"]["step_stats"][0]
    assert stats["host_saves"] == 4 and stats["host_save_tokens"] == sum(full)
    assert [o[0]["token_ids"] for o in decode["outputs"]] == expected
    stats = decode["rpc"]["step_stats"][0]
    assert stats["host_loads"] == 4 and stats["host_load_tokens"] == sum(full)
    assert stats["host_load_failures"] == 0
    assert decode["metrics"]["vllm:external_prefix_cache_hits"] == sum(full)
