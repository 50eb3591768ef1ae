"""Cache-aware routing without a cluster: the block keys, a replica's index of vLLM's KV cache
events (through vLLM's own ZeroMQ publisher), the policy, and the router's state."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest

from rbln_ray.serve.cache_routing import (
    CacheAwareRouter,
    Candidate,
    PromptTokenizer,
    ServiceRates,
    estimate_ttft,
    order_candidates,
    request_scope,
    router_config,
    scoped_session,
    session_of,
)
from rbln_ray.serve.kv_events import STATS_BLOCK_SIZE, STATS_BLOCKS, STATS_EVENTS, pack_keys
from rbln_ray.serve.kv_index import CachedBlocks, chain_hashes, held_prefix
from rbln_ray.serve.routing import rank
from rbln_ray.serve.service_times import (
    STATS_PREFILL_S_PER_TOKEN,
    STATS_SERVICE_S,
    ServiceTimes,
)

BS = 4  # a small block size keeps the token lists readable


# ------------------------------------------------------------------ keys and the index
def test_chain_keys_name_whole_prefixes() -> None:
    tokens = list(range(10))
    keys = chain_hashes(tokens, BS)
    assert len(keys) == 2  # the partial last block has no key
    assert chain_hashes(tokens[:8], BS) == keys
    assert chain_hashes(tokens, BS, limit=1) == keys[:1]
    # the same block after a different prefix is a different key
    assert chain_hashes([9, 9, 9, 9, *tokens[4:8]], BS)[1] != keys[1]
    assert chain_hashes([0, 1, 2, 3, 7, 7, 7, 7], BS)[0] == keys[0]
    with pytest.raises(ValueError, match="block_size"):
        chain_hashes(tokens, 0)
    assert held_prefix(keys, {keys[0]}) == 1
    assert held_prefix(keys, {keys[1]}) == 0  # a held block after a missing one does not count
    assert held_prefix(keys, {keys[0]}, {keys[1]}) == 2


def test_index_renames_vllm_blocks_to_prompt_keys() -> None:
    index = CachedBlocks()
    prompt = list(range(100, 112))  # 3 blocks
    keys = chain_hashes(prompt, BS)
    index.stored(["a", "b"], None, prompt[:8], BS)  # vLLM's hashes are opaque to the index
    index.stored(["c"], "b", prompt[8:12], BS)  # the next block, its parent named by vLLM
    assert index.keys() == sorted(keys) and index.block_size == BS
    index.stored(["z"], "unknown-parent", [1, 2, 3, 4], BS)  # cannot be renamed: left out
    index.stored(["p"], None, [1, 2], 2 * BS)  # a partial block: left out
    assert index.keys() == sorted(keys)
    index.stored(["a"], None, prompt[:4], BS)  # a reuse names the same block again
    assert len(index) == 3
    index.removed(["c"])
    assert held_prefix(keys, set(index.keys())) == 2
    index.cleared()
    assert index.keys() == [] and index.events == 7


def test_listener_indexes_what_vllms_publisher_sends() -> None:
    """The engine's own publisher (vLLM's ZmqEventPublisher) to the replica's listener."""
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )

    from rbln_ray.serve.kv_events import KVEventListener

    listener = KVEventListener.start()
    config = listener.engine_config()
    assert config.enable_kv_cache_events and config.endpoint == listener.endpoint
    publisher = ZmqEventPublisher(0, endpoint=config.endpoint)
    prompt = list(range(7, 7 + 3 * BS))
    try:
        # A subscriber misses what a PUB socket sends before their connection is up (ZeroMQ's
        # "slow joiner"; an engine publishes nothing for seconds after it binds): clear until
        # the listener hears it.
        deadline = time.monotonic() + 60
        while listener.report()[STATS_EVENTS] == 0:
            assert time.monotonic() < deadline, "the listener never connected"
            publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
            time.sleep(0.05)
        seen = listener.report()[STATS_EVENTS]
        stored = BlockStored(
            block_hashes=[11, 12, 13],
            parent_block_hash=None,
            token_ids=prompt,
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        publisher.publish(KVEventBatch(ts=time.time(), events=[stored]))
        publisher.publish(
            KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[13], medium="GPU")])
        )
        while listener.report()[STATS_EVENTS] < seen + 2:
            assert time.monotonic() < deadline, "the listener never saw the events"
            time.sleep(0.01)  # polling the listener thread's progress
        report = listener.report()
    finally:
        publisher.shutdown()
        listener.close()
    assert report[STATS_BLOCK_SIZE] == BS
    # the keys as one int64 byte string (kv_events.pack_keys), sorted
    assert report[STATS_BLOCKS] == pack_keys(sorted(chain_hashes(prompt, BS)[:2]))


# ------------------------------------------------------------------ the policy
def cand(
    rid: str, load: int = 0, held: int = 0, capacity: int = 8, ttft: float | None = None
) -> Candidate:
    return Candidate(replica_id=rid, load=load, capacity=capacity, held_blocks=held, ttft_s=ttft)


def test_policy_prefers_the_cache_then_the_session_within_the_load_slack() -> None:
    a, b, c = cand("a", held=3), cand("b", held=5), cand("c")
    assert order_candidates([a, b, c], None, "k", load_slack=4)[0] == "b"
    # equal caches: the session's replica, then the key's rendezvous hash (not the load:
    # a burst sharing a new prefix stays together up to the slack)
    a, b = cand("a", load=2, held=5), cand("b", load=1, held=5)
    assert order_candidates([a, b], "a", "k", 4)[0] == "a"
    assert order_candidates([a, b], "b", "k", 4)[0] == "b"
    assert order_candidates([a, b], None, "k", 4) == rank("k", ["a", "b"])
    # the cache's replica carries more than the slack over the least loaded: load wins
    busy, idle = cand("a", load=6, held=9), cand("b", load=1)
    assert order_candidates([busy, idle], "a", "k", 4) == ["b", "a"]
    assert order_candidates([busy, idle], "a", "k", 5) == ["a", "b"]
    # a full replica goes last whatever it holds
    full = cand("a", load=8, held=9)
    assert order_candidates([full, cand("b", load=7)], None, "k", 4) == ["b", "a"]
    assert order_candidates([], None, "k", 4) == []


def test_estimate_prices_the_slot_wait_against_the_uncached_prefill() -> None:
    rates = ServiceRates(prefill_s_per_token=0.001, service_s=8.0)
    # free slots (load < batch): only the prefill of what the replica lacks
    assert estimate_ttft(rates, 4, load=3, uncached_tokens=500) == pytest.approx(0.5)
    # every slot busy: one of 4 slots frees every 8 / 4 s; two ahead wait for two
    assert estimate_ttft(rates, 4, load=4, uncached_tokens=0) == pytest.approx(2.0)
    assert estimate_ttft(rates, 4, load=5, uncached_tokens=100) == pytest.approx(4.1)


def test_policy_sends_a_request_where_its_first_token_comes_soonest() -> None:
    # the cache's replica waits for a slot longer than the other would prefill: leave it
    cached, idle = cand("a", load=6, held=9, ttft=4.0), cand("b", load=1, ttft=2.3)
    assert order_candidates([cached, idle], "a", "k", 4) == ["b", "a"]
    # a short wait is worth a long miss, even beyond the load slack
    cached, idle = cand("a", load=6, held=9, ttft=1.0), cand("b", load=1, ttft=2.3)
    assert order_candidates([cached, idle], None, "k", 4) == ["a", "b"]
    # equal estimates: the longer held prefix, then the session, then the hash
    a, b = cand("a", held=2, ttft=0.5), cand("b", held=3, ttft=0.5)
    assert order_candidates([a, b], "a", "k", 4)[0] == "b"
    a, b = cand("a", ttft=0.5), cand("b", ttft=0.5)
    assert order_candidates([a, b], "b", "k", 4)[0] == "b"
    assert order_candidates([a, b], None, "k", 4) == rank("k", ["a", "b"])
    # a full replica goes last, however soon
    full = cand("a", load=8, held=9, ttft=0.0)
    assert order_candidates([full, cand("b", load=7, ttft=9.0)], None, "k", 4) == ["b", "a"]


def test_policy_spreads_new_sessions_and_agrees_on_each() -> None:
    replicas = [cand(r) for r in ("a", "b", "c", "d")]
    firsts = [order_candidates(replicas, None, f"session-{i}", 4)[0] for i in range(64)]
    assert set(firsts) == {"a", "b", "c", "d"}
    again = [order_candidates(replicas[::-1], None, f"session-{i}", 4)[0] for i in range(64)]
    assert again == firsts  # the same key agrees on a replica whatever the order


# ------------------------------------------------------------------ what a request says
@dataclass
class Call:
    """An HTTP-call-like request (a JSON body and forwarded headers)."""

    body: bytes
    headers: tuple = ()


def test_session_comes_from_the_header_then_the_user_field() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    chat = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], user="alice"
    )
    assert session_of(chat, {}) == "alice"
    assert session_of(chat, {"session": "s-1"}) == "s-1"
    call = Call(b'{"user": "bob"}', ((b"x-session-id", b"s-2"),))
    assert session_of(call, {}) == "s-2"
    assert session_of(Call(b'{"user": "bob"}'), {}) == "bob"
    assert session_of(Call(b"not json"), {}) is None
    assert len(session_of({"user": "x" * 10_000}, {})) == 256


def test_prompt_tokens_as_the_replica_renders_them() -> None:
    """Chat and text prompts tokenized with the model's tokenizer and template, as vLLM's
    renderer does (the same prompt through vLLM's own renderer is the end-to-end test's);
    token-id prompts as given."""
    from transformers import AutoTokenizer

    from rbln_ray.models.tokenizer import build_tokenizer

    path = str(build_tokenizer())  # every locally built model's tokenizer and chat template
    tok = PromptTokenizer(path)
    hf = AutoTokenizer.from_pretrained(path)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "def f():"}]},
    ]
    expected = hf.encode(
        hf.apply_chat_template(
            [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "def f():"},
            ],
            tokenize=False,
            add_generation_prompt=True,
        ),
        add_special_tokens=False,
    )
    assert tok.tokens({"messages": messages}) == expected
    assert tok.tokens({"prompt": "import os"}) == hf.encode("import os")
    assert tok.tokens({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert tok.tokens({"prompt": [[5, 6], [7]]}) == [5, 6]
    assert PromptTokenizer(None).tokens({"prompt": "x"}) is None
    assert PromptTokenizer("/nonexistent").tokens({"prompt": "x"}) is None


# ------------------------------------------------------------------ the router's state
@dataclass
class FakeReplica:
    """What the router reads of Serve's RunningReplica."""

    replica_id: ReplicaID
    routing_stats: dict[str, Any] = field(default_factory=dict)
    max_ongoing_requests: int = 8


DEPLOYMENT = DeploymentID(name="LLMServer:m", app_name="app")


def replica(name: str, **kw: Any) -> FakeReplica:
    return FakeReplica(ReplicaID(name, DEPLOYMENT), **kw)


def pending(prompt: list[int], **kwargs: Any) -> PendingRequest:
    rid = uuid.uuid4().hex
    meta = RequestMetadata(request_id=rid, internal_request_id=rid)
    return PendingRequest(args=[{"prompt": prompt}], kwargs=kwargs, metadata=meta)


def make_router(batch_size: int = 4) -> CacheAwareRouter:
    router = CacheAwareRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(tokenizer=None, batch_size=batch_size, recent_ttl_s=60)
    return router


def report(tokens: list[int], events: int = 1) -> dict[str, Any]:
    keys = chain_hashes(tokens, BS)
    return {STATS_BLOCK_SIZE: BS, STATS_BLOCKS: keys, STATS_EVENTS: events}


async def first(router: CacheAwareRouter, replicas: list[FakeReplica], req: PendingRequest) -> str:
    groups = await router.choose_replicas(replicas, req)
    assert all(len(g) == 1 for g in groups) and len(groups) == len(replicas)
    return groups[0][0].replica_id.unique_id


def test_router_follows_reported_caches_sends_and_sessions() -> None:
    async def scenario() -> None:  # PendingRequest needs a running loop
        router = make_router()
        doc = list(range(1000, 1000 + 4 * BS))
        a, b = replica("a", routing_stats=report(doc)), replica("b")
        # a reported the document: a request that starts with it goes there
        assert await first(router, [a, b], pending(doc + [1, 2, 3])) == "a"
        # b did not report it yet, but was just sent it: the next request follows
        other = list(range(2000, 2000 + 4 * BS))
        req = pending(other + [9])
        chosen = await first(router, [a, b], req)
        router.on_request_routed(req, ReplicaID(chosen, DEPLOYMENT), None)
        assert await first(router, [a, b], pending(other + [5, 5])) == chosen
        # the send counts after its request ends too (until the TTL)
        router.on_request_completed(ReplicaID(chosen, DEPLOYMENT), req.metadata.internal_request_id)
        assert await first(router, [a, b], pending(other + [6, 6])) == chosen
        # a session with no cached prefix anywhere sticks to where it went first
        picks = set()
        for turn in range(4):
            req = pending([turn] * BS * (turn + 1), session="s")
            chosen = await first(router, [a, b], req)
            picks.add(chosen)
            router.on_request_routed(req, ReplicaID(chosen, DEPLOYMENT), None)
        assert len(picks) == 1

    asyncio.run(scenario())


def test_router_balances_load_and_forgets_dead_replicas() -> None:
    async def scenario() -> None:  # PendingRequest needs a running loop
        router = make_router(batch_size=2)
        doc = list(range(3000, 3000 + 4 * BS))
        a, b = replica("a", routing_stats=report(doc)), replica("b")
        sent = []
        for _ in range(8):  # all want a's cache; a takes up to the slack more than b
            req = pending(doc + [1])
            chosen = await first(router, [a, b], req)
            router.on_request_routed(req, ReplicaID(chosen, DEPLOYMENT), None)
            sent.append(chosen)
        assert sent.count("a") - sent.count("b") <= 2 + 1 and sent.count("b") >= 3
        # a dies: its state goes, and its session moves
        req = pending([1] * BS, session="s")
        router.on_request_routed(req, ReplicaID("a", DEPLOYMENT), None)
        assert await first(router, [b], pending(doc)) == "b"  # Serve no longer offers a
        assert "a" not in router._reports and "a" not in router._recent
        assert router._sessions.get("s") is None
        assert await first(router, [b], pending(doc, session="s")) == "b"

    asyncio.run(scenario())


def test_router_weighs_reported_service_times() -> None:
    """With times reported, a replica holding the prompt keeps it while its slot wait is
    shorter than the other's prefill of the whole prompt, and loses it once it is not."""

    async def scenario(service_s: float, load: int) -> str:  # PendingRequest needs a loop
        router = make_router(batch_size=2)
        doc = list(range(5000, 5000 + 100 * BS))  # 400 tokens: 0.4 s to prefill
        times = {STATS_PREFILL_S_PER_TOKEN: 0.001, STATS_SERVICE_S: service_s}
        a = replica("a", routing_stats={**report(doc), **times})
        b = replica("b", routing_stats=dict(times))
        for _ in range(load):  # requests a runs (b runs none)
            req = pending([7] * BS)
            assert await first(router, [a], req) == "a"
            router.on_request_routed(req, ReplicaID("a", DEPLOYMENT), None)
        return await first(router, [a, b], pending(doc + [1], session="s"))

    # a has a free slot: it holds the prompt, so it is sooner
    assert asyncio.run(scenario(service_s=10.0, load=1)) == "a"
    # both slots busy, one frees every 0.3 s / 2: sooner than 0.4 s of prefill on b
    assert asyncio.run(scenario(service_s=0.3, load=2)) == "a"
    # one frees every 10 s / 2: b prefills the whole prompt sooner
    assert asyncio.run(scenario(service_s=10.0, load=2)) == "b"


def test_replica_reports_its_service_times_from_vllms_request_stats() -> None:
    """The stat logger, fed vLLM's own stats objects, reports the window's prefill time per
    prefilled token (a ratio of sums) and mean slot time; warm-up is forgotten."""
    from vllm.v1.metrics.loggers import StatLoggerBase
    from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats

    def finished(prompt: int, cached: int, prefill: float, inference: float) -> Any:
        return FinishedRequestStats(
            finish_reason=None,
            num_prompt_tokens=prompt,
            num_cached_tokens=cached,
            prefill_time=prefill,
            inference_time=inference,
        )

    times = ServiceTimes()
    logger = times.stat_logger()(None, 0)  # as vLLM builds a per-engine logger
    assert isinstance(logger, StatLoggerBase)
    assert times.report() == {}
    step = IterationStats()
    step.finished_requests = [finished(1000, 200, 0.8, 4.0), finished(300, 100, 0.2, 2.0)]
    logger.record(None, step)
    logger.record(None, None)  # a step without iteration stats changes nothing
    out = times.report()
    assert out[STATS_PREFILL_S_PER_TOKEN] == pytest.approx(1.0 / 1000)
    assert out[STATS_SERVICE_S] == pytest.approx(3.0)
    times.reset()
    assert times.report() == {}


def test_the_router_imports_without_vllm() -> None:
    """A Python client's deployment handle builds the router in the client's process, which
    need not import vLLM (seconds of start-up)."""
    import subprocess
    import sys

    code = (
        "import sys; import rbln_ray.serve.cache_routing; "
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_router_config_names_this_router_and_reports_every_second(tmp_path) -> None:
    from rbln_ray.serve.config import ModelDeploymentConfig

    cfg = ModelDeploymentConfig(name="m", model=str(tmp_path), engine_kwargs={"tokenizer": "t"})
    config = router_config(cfg, batch_size=4)
    assert config.request_router_class.endswith("cache_routing.CacheAwareRouter")
    assert config.request_router_kwargs == {"tokenizer": "t", "batch_size": 4, "served_name": "m"}
    assert config.request_routing_stats_period_s == 1.0
    assert router_config(cfg.model_copy(update={"engine_kwargs": {}}), 8).request_router_kwargs[
        "tokenizer"
    ] == str(tmp_path)


def test_router_reads_http_calls_and_honours_a_required_replica() -> None:
    """The ingress forwards an HTTPCall (JSON body bytes, the x-session-id header among its
    forwarded headers); a call naming a replica (a stored Responses API response) goes
    there whatever the caches say."""
    import json

    from rbln_ray.serve.http_call import HTTPCall, forwarded_headers

    async def scenario() -> None:  # PendingRequest needs a running loop
        router = make_router()
        doc = list(range(4000, 4000 + 4 * BS))
        a, b = replica("a", routing_stats=report(doc)), replica("b")
        headers = forwarded_headers([(b"X-Session-Id", b"conv-1"), (b"cookie", b"x")])
        call = HTTPCall("POST", "/v1/completions", headers=headers,
                        body=json.dumps({"prompt": doc + [7]}).encode())  # fmt: skip
        assert session_of(call, {}) == "conv-1"
        rid = uuid.uuid4().hex
        meta = RequestMetadata(request_id=rid, internal_request_id=rid)
        # the body's prompt starts with what a reported holding
        assert await first(router, [a, b], PendingRequest([call], {}, meta)) == "a"
        pinned_call = HTTPCall("POST", "/v1/responses", body=call.body, replica="b")
        rid = uuid.uuid4().hex
        meta = RequestMetadata(request_id=rid, internal_request_id=rid)
        groups = await router.choose_replicas([a, b], PendingRequest([pinned_call], {}, meta))
        assert [[r.replica_id.unique_id for r in g] for g in groups] == [["b"]]

    asyncio.run(scenario())


# ------------------------------------------------------------------ hardening: client input
def test_routing_never_renders_a_template_or_option_the_request_brings(tmp_path) -> None:
    """The router renders only the model's own chat template, passing on only the
    ``chat_template_kwargs`` that template reads: a request's own template (a "template
    bomb" would stall the ingress rendering it) or ``tokenize`` is dropped, as vLLM's
    replica drops or refuses them."""
    from transformers import AutoTokenizer

    from rbln_ray.models.tokenizer import build_tokenizer

    hf = AutoTokenizer.from_pretrained(str(build_tokenizer()))
    # the model's template, reading one variable of its own (as Qwen3's `enable_thinking`)
    hf.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if terse %}(terse){% endif %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    hf.save_pretrained(tmp_path)
    tok = PromptTokenizer(str(tmp_path))
    messages = [{"role": "user", "content": "def f():"}]

    def expected(**kwargs: Any) -> list[int]:
        text = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
        return hf.encode(text, add_special_tokens=False)

    bomb = "{% for a in range(3) %}EVIL{% endfor %}"
    body = {
        "messages": messages,
        "chat_template_kwargs": {"chat_template": bomb, "tokenize": True, "terse": True},
    }
    assert tok.tokens(body) == expected(terse=True)
    assert tok.tokens({"messages": messages, "chat_template_kwargs": {"x": 1}}) == expected()
    assert tok.tokens({"messages": messages, "chat_template_kwargs": "not a dict"}) == expected()


def test_routing_without_tokens_past_the_budget_and_the_queue_bound() -> None:
    """A render that does not finish within the budget (or a queue of them) never holds a
    request: it is routed without tokens, and the router's one thread carries the rest."""
    import threading

    release = threading.Event()

    class Stuck:
        def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
            release.wait()
            return "x"

        def encode(self, text: str, **kwargs: Any) -> list[int]:
            return [1, 2, 3]

    tok = PromptTokenizer(None, budget_s=0.05)
    tok._failed, tok._tokenizer = False, Stuck()  # a loaded tokenizer whose render hangs
    chat = {"messages": [{"role": "user", "content": "hi"}]}

    async def scenario() -> None:
        assert await tok.tokens_within_budget(chat) is None  # past the budget
        # token-id prompts need no render, yet wait behind the stuck one: also without tokens
        assert await tok.tokens_within_budget({"prompt": [4, 5]}) is None
        waiting, tok._waiting = tok._waiting, 10**6  # as if the queue were full
        assert await tok.tokens_within_budget({"prompt": [4, 5]}) is None  # not submitted
        tok._waiting = waiting
        release.set()
        assert await asyncio.wrap_future(tok._pool.submit(lambda: None)) is None  # drained
        assert tok._waiting == 0
        assert await tok.tokens_within_budget({"prompt": [4, 5]}) == [4, 5]

    try:
        asyncio.run(scenario())
    finally:
        release.set()


def test_block_keys_carry_lora_and_cache_salt_as_vllm_hashes_them() -> None:
    """vLLM keeps blocks of two ``cache_salt`` values or two adapters apart; so do the keys.
    The extra keys a replica's index folds in are the ones vLLM's own
    ``generate_block_hash_extra_keys`` gives its events, and the router computes the same
    from the request alone."""
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
    from vllm.v1.request import Request

    prompt = list(range(50, 50 + 3 * BS))
    for lora, salt in ((None, None), (None, "tenant-a"), ("sql", None), ("sql", "tenant-a")):
        request = Request(
            "r", prompt, SamplingParams(max_tokens=1), None,
            lora_request=LoRARequest(lora, 1, "/x") if lora else None, cache_salt=salt,
        )  # fmt: skip
        extra = [generate_block_hash_extra_keys(request, i * BS, (i + 1) * BS, 0)[0]
                 for i in range(3)]  # fmt: skip
        index = CachedBlocks()
        index.stored([1, 2, 3], None, prompt, BS, extra)
        keys = chain_hashes(prompt, BS, lora_name=lora, cache_salt=salt)
        assert index.keys() == sorted(keys), (lora, salt)
    plain = chain_hashes(prompt, BS)
    assert chain_hashes(prompt, BS, cache_salt="a")[0] != plain[0]
    assert chain_hashes(prompt, BS, cache_salt="a") != chain_hashes(prompt, BS, cache_salt="b")
    assert chain_hashes(prompt, BS, lora_name="sql")[0] != plain[0]
    assert request_scope({"model": "sql", "cache_salt": "a"}, "m") == ("sql", "a")
    assert request_scope({"model": "m", "cache_salt": ""}, "m") == (None, None)


def test_one_tenants_cache_and_sessions_never_steer_anothers() -> None:
    """A prefix cached under one ``cache_salt`` (or adapter) does not draw another salt's
    request, and a session id is the same session only within one tenant (API key), salt
    and adapter."""
    import json

    from rbln_ray.serve.http_call import HTTPCall, tenant_of

    def call(body: dict[str, Any], tenant: str = "", session: str | None = None) -> PendingRequest:
        headers = ((b"x-session-id", session.encode()),) if session else ()
        rid = uuid.uuid4().hex
        meta = RequestMetadata(request_id=rid, internal_request_id=rid)
        raw = HTTPCall("POST", "/v1/completions", headers=headers,
                       body=json.dumps(body).encode(), tenant=tenant)  # fmt: skip
        return PendingRequest([raw], {}, meta)

    async def scenario() -> None:
        router = make_router()
        router._served_name = "m"
        doc = list(range(5000, 5000 + 4 * BS))
        salted = {STATS_BLOCK_SIZE: BS, STATS_EVENTS: 1,
                  STATS_BLOCKS: chain_hashes(doc, BS, cache_salt="A")}  # fmt: skip
        a, b = replica("a", routing_stats=salted), replica("b")
        # the hash's own choice for each request, with neither replica holding anything
        blank = make_router()
        blank._served_name = "m"
        for salt, lora in (("B", None), (None, None), (None, "sql")):
            body = {"model": lora or "m", "prompt": doc + [1], "cache_salt": salt}
            fresh = await first(blank, [replica("a"), replica("b")], call(body))
            assert await first(router, [a, b], call(body)) == fresh, (salt, lora)
        body = {"model": "m", "prompt": doc + [1], "cache_salt": "A"}
        assert await first(router, [a, b], call(body)) == "a"
        # sessions: a session id of tenant 1 sticks; tenant 2's same id is its own session
        t1, t2 = tenant_of("key-1"), tenant_of("key-2")
        body = {"model": "m", "prompt": [1, 2, 3]}
        name = next(f"s{i}" for i in range(100)
                    if rank(scoped_session(None, f"s{i}", None, None), ["a", "b"])[0] == "a"
                    and rank("\0".join((t2, "", "", f"s{i}")), ["a", "b"])[0] == "b")  # fmt: skip
        req = call(body, t1, name)
        router.on_request_routed(req, ReplicaID("a", DEPLOYMENT), None) if await first(
            router, [replica("a"), replica("b")], req
        ) else None
        assert router._sessions.get("\0".join((t1, "", "", name))) == "a"
        assert await first(router, [replica("a"), replica("b")], call(body, t2, name)) == "b"

    asyncio.run(scenario())
