"""Prefill/decode disaggregation through the Serve app and the real ``openai`` client: the
package app's ``tiny-pd`` (the tiny Llama with one prefill and one decode replica, KV handed
over through a host KV tier) answers as the co-located ``tiny`` and transformers do, streaming
and not, and loses nothing when its prefill replica is killed mid-flight. (It rides this
package's app: a model of two replicas beside the fault tests' costs no app start.)"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest

from rbln_ray.models import build_tiny_model
from tests.helpers import hf_greedy
from tests.reliability.conftest import MODEL, PD_MODEL, PREFILL_TIMEOUT_S, wait_until
from tests.serve.conftest import RunningApp

pytestmark = pytest.mark.slow

MAX_TOKENS = 12


def prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of 260-400 token ids (two or three full 128-token blocks to hand over),
    none holding the fault tests' poison token."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 4000) for _ in range(rng.randrange(260, 400))] for _ in range(n)]


def steps(deployment: str) -> dict:
    """Step counters of the deployment's (one) replica's engine."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, "rbln-ray")
    return handle.engine_stats.remote().result()["steps"][0]


def handovers() -> tuple[int, int]:
    """(prompts the prefill pool exported, and the decode pool loaded) so far."""
    return steps(f"LLMServer:{PD_MODEL}:prefill")["host_saves"], decode_loads()


def test_disaggregated_answers_equal_colocated_and_transformers(tiny_app: RunningApp) -> None:
    """Completions (token ids, streamed text) and a chat: ``tiny-pd`` equals ``tiny`` and
    transformers' greedy tokens, and each long prompt was exported by the prefill replica and
    loaded by the decode replica."""
    import openai
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=f"{tiny_app.url}/v1", api_key="unused", max_retries=0)
    hf_dir = build_tiny_model(family="llama")
    tok = AutoTokenizer.from_pretrained(hf_dir)
    asked = prompts(3, seed=31)
    expected = [hf_greedy(hf_dir, [p], MAX_TOKENS)[0] for p in asked]
    saved, loaded = handovers()
    kw = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"return_token_ids": True}}
    for model in (PD_MODEL, MODEL):
        got = [client.completions.create(model=model, prompt=p, **kw).choices[0] for p in asked]
        assert [c.token_ids for c in got] == expected, model
    assert handovers() == (saved + 3, loaded + 3)  # every prompt went through the tier
    streamed = client.completions.create(
        model=PD_MODEL, prompt=asked[0], stream=True, max_tokens=MAX_TOKENS, temperature=0
    )
    assert "".join(c.choices[0].text for c in streamed) == tok.decode(expected[0]).rstrip("\ufffd")
    messages = [{"role": "user", "content": "def helper(x):\n    return x\n" * 30}]
    answers = []
    for model, stream in ((MODEL, False), (PD_MODEL, False), (PD_MODEL, True)):
        reply = client.chat.completions.create(
            model=model, messages=messages, stream=stream, max_tokens=MAX_TOKENS, temperature=0
        )
        answers.append(
            "".join(c.choices[0].delta.content or "" for c in reply)
            if stream
            else reply.choices[0].message.content
        )
    assert answers[0] and answers == [answers[0]] * 3, answers


async def complete(client: httpx.AsyncClient, url: str, prompt: list[int]) -> dict:
    body = {"model": PD_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    r = await client.post(f"{url}/v1/completions", json=body)
    return {"status": r.status_code, "body": r.json() if r.status_code == 200 else r.text}


def test_a_prefill_replica_killed_mid_flight_loses_no_request(
    tiny_app: RunningApp, pd_tier: Path
) -> None:
    """24 concurrent requests; once the prefill replica has handed a prompt over, it is
    killed: every request succeeds with transformers' tokens. The ones it had not prefilled
    (in flight on it, or queued for it until ``pd.prefill_timeout_s``) were computed by the
    decode replica from their prompts."""
    import ray
    from ray import serve

    asked = prompts(24, seed=47)
    prefill = serve.get_deployment_handle(f"LLMServer:{PD_MODEL}:prefill", "rbln-ray")
    victim = prefill.engine_stats.remote().result()["actor_name"]
    loaded = decode_loads()
    entries = tier_entries(pd_tier)

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=PREFILL_TIMEOUT_S + 240) as client:
            tasks = [asyncio.create_task(complete(client, tiny_app.url, p)) for p in asked]
            # a prompt handed over, by the tier's own count (the replica's handle would queue
            # a stats call behind the requests it holds)
            await asyncio.to_thread(
                wait_until, lambda: tier_entries(pd_tier) > entries, 120, 0.05, "a handover"
            )
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
            return await asyncio.gather(*tasks)

    outcomes = asyncio.run(run())
    hf_dir = build_tiny_model(family="llama")
    expected = [hf_greedy(hf_dir, [p], MAX_TOKENS)[0] for p in asked]
    assert [o["status"] for o in outcomes] == [200] * len(asked), outcomes
    assert [o["body"]["choices"][0]["token_ids"] for o in outcomes] == expected
    # the decode replica loaded the prompts handed over and computed the others itself
    assert 0 < decode_loads() - loaded < len(asked), (loaded, decode_loads())


def tier_entries(root: Path) -> int:
    from rbln_ray.vllm_plugin.host_tier import HostKVTier

    return HostKVTier(root, 1, "").usage()[1]


def decode_loads() -> int:
    return steps(f"LLMServer:{PD_MODEL}")["host_loads"]
