"""The cache-aware router at scale: the key index, the prefix depths it gives, the faster block
keys, and the indexed path's choices against the full scan's rule (``order_candidates``) on
random router states."""

from __future__ import annotations

import asyncio
import random
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
    _Recent,
    _RecentMasks,
    hashed_ranks,
    order_candidates,
)
from rbln_ray.serve.kv_events import (
    STATS_BLOCK_SIZE,
    STATS_BLOCKS,
    STATS_EVENTS,
    STATS_HOST_BLOCKS,
)
from rbln_ray.serve.kv_index import (
    ROOT,
    HolderIndex,
    _key,
    block_extra_keys,
    chain_hashes,
    depth_classes,
    extend_chain,
    held_prefix,
    slots_of,
)
from rbln_ray.serve.service_times import (
    STATS_LOAD,
    STATS_PREFILL_S_PER_TOKEN,
    STATS_REPORT,
    STATS_SERVICE_S,
)

BS = 4
DEPLOYMENT = DeploymentID(name="LLMServer:m", app_name="app")


# ------------------------------------------------------------------ keys
def reference_chain(tokens, block_size, lora=None, salt=None) -> list[int]:
    """chain_hashes as it was written first: one _key per block."""
    keys, parent = [], ROOT
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        parent = _key(parent, block, block_extra_keys(i, lora, salt))
        keys.append(int.from_bytes(parent, "big", signed=True))
    return keys


def test_block_keys_are_unchanged_and_extend_turn_by_turn() -> None:
    rng = random.Random(3)
    for _ in range(200):
        tokens = [rng.randrange(-(2**40), 2**40) for _ in range(rng.randrange(0, 300))]
        size = rng.choice([1, 4, 16, 128])
        lora, salt = rng.choice([None, "sql"]), rng.choice([None, "tenant-a"])
        keys = chain_hashes(tokens, size, lora_name=lora, cache_salt=salt)
        assert keys == reference_chain(tokens, size, lora, salt)
        cut = rng.randrange(0, len(tokens) + 1)
        head = chain_hashes(tokens[:cut], size, lora_name=lora, cache_salt=salt)
        assert extend_chain(head, tokens, size, lora, salt) == keys
    assert chain_hashes(list(range(40)), BS, limit=3) == reference_chain(list(range(12)), BS)


# ------------------------------------------------------------------ the key index
def test_holder_index_names_each_keys_replicas_by_slot() -> None:
    index = HolderIndex()
    index.add(3, [10, 11])
    assert index.mask(10) == 1 << 3 and index.mask(99) == 0
    index.add(70, [10])  # a second holder (a slot past 64 bits)
    index.add(3, [10])  # again: no change
    assert index.mask(10) == (1 << 3) | (1 << 70) and index.entries() == 3
    index.remove(3, [10, 11, 12])
    assert index.mask(10) == 1 << 70 and index.mask(11) == 0 and len(index) == 1
    index.remove(5, [10])  # not a holder
    index.remove(70, [10])
    assert len(index) == 0 and index.entries() == 0
    assert slots_of((1 << 70) | 0b101) == [0, 2, 70]


def test_depth_classes_are_each_replicas_held_prefix() -> None:
    rng = random.Random(5)
    for _ in range(100):
        keys = [rng.randrange(1000) for _ in range(rng.randrange(0, 12))]
        holds = {s: {k for k in keys if rng.random() < 0.8} for s in range(rng.randrange(1, 9))}
        index = HolderIndex()
        for slot, held in holds.items():
            index.add(slot, held)
        got = {s: d for d, mask in depth_classes(keys, index.mask) for s in slots_of(mask)}
        want = {s: held_prefix(keys, held) for s, held in holds.items()}
        assert got == {s: d for s, d in want.items() if d}


def test_recent_masks_follow_sends_expiry_and_forgetting() -> None:
    now = [0.0]
    masks = _RecentMasks()
    recent = _Recent(2, masks, lambda: now[0])
    recent.add([1, 2])
    recent.add([2])
    assert masks.running == {1: 4, 2: 4}
    recent.done([2], ttl=5)  # one of two requests carrying key 2 ends: still running
    assert masks.running == {1: 4, 2: 4} and not masks.expiring
    recent.done([1, 2], ttl=5)
    assert not masks.running and masks.expiring == {1: 4, 2: 4} and 1 in recent
    now[0] = 6.0
    assert 1 not in recent  # expired, though still masked until pruned
    recent.prune()
    assert not masks.expiring
    recent.add([7])
    recent.forget()
    assert not masks.running and not masks.expiring


# ------------------------------------------------------------------ the tie-break
def test_hashed_ranks_agree_whatever_the_order_and_spread_sessions() -> None:
    ids = [f"replica-{i}" for i in range(16)]
    ranks = hashed_ranks("s-1", ids)
    assert sorted(ranks.values()) == list(range(16))
    assert hashed_ranks("s-1", ids[::-1]) == ranks
    firsts = [min(ids, key=hashed_ranks(f"s-{i}", ids).__getitem__) for i in range(800)]
    counts = [firsts.count(rid) for rid in ids]
    assert min(counts) > 20 and max(counts) < 85  # 50 each expected
    # a replica that leaves moves only the keys it was first for
    fewer = ids[1:]
    moved = [
        i
        for i in range(800)
        if firsts[i] != ids[0]
        and min(fewer, key=hashed_ranks(f"s-{i}", fewer).__getitem__) != firsts[i]
    ]
    assert moved == []


# ------------------------------------------------------------------ the indexed path
@dataclass
class FakeReplica:
    replica_id: ReplicaID
    routing_stats: dict[str, Any] = field(default_factory=dict)
    max_ongoing_requests: int = 8
    node_id: str | None = None


def pending(prompt: list[int], session: str | None) -> PendingRequest:
    rid = uuid.uuid4().hex
    meta = RequestMetadata(request_id=rid, internal_request_id=rid)
    kwargs = {"session": session} if session else {}
    return PendingRequest(args=[{"prompt": prompt}], kwargs=kwargs, metadata=meta)


def reference(router: CacheAwareRouter, replicas: list[FakeReplica], request: Any) -> list[str]:
    """The full scan's rule, with the indexed path's tie-break."""
    request.block_size = router._block_size(replicas)
    rates = router._rates(replicas)
    session = router._sessions.get(request.session) if request.session else None
    ids = [r.replica_id.unique_id for r in replicas]
    host = router._host_by_node(replicas)
    candidates = [router._candidate(r, request, rates, host) for r in replicas]
    return order_candidates(
        candidates, session, request.key, router._batch_size, hashed_ranks(request.key, ids)
    )


def random_fleet(rng: random.Random, n: int, prompts: list[list[int]], timed: bool, nodes: int = 0):
    """``nodes``: replicas spread over that many nodes, a third of them reporting blocks
    their node's host KV tier holds (0: no node, no tier)."""
    replicas = []
    for i in range(n):
        held: set[int] = set()
        for prompt in rng.sample(prompts, rng.randrange(0, 4)):
            held |= set(chain_hashes(prompt[: rng.randrange(0, len(prompt) + 1)], BS))
        stats: dict[str, Any] = {STATS_BLOCK_SIZE: BS, STATS_BLOCKS: sorted(held)}
        if nodes and rng.random() < 1 / 3:
            hosted = rng.choice(prompts)
            stats[STATS_HOST_BLOCKS] = chain_hashes(hosted[: rng.randrange(len(hosted) + 1)], BS)
        stats[STATS_EVENTS] = rng.randrange(3)
        if timed:
            stats[STATS_PREFILL_S_PER_TOKEN] = rng.choice([0.001, 0.002])
            stats[STATS_SERVICE_S] = rng.choice([0.3, 2.0, 10.0])
        if rng.random() < 0.5:  # a replica that reports its load (others do not)
            stats[STATS_LOAD], stats[STATS_REPORT] = rng.randrange(10), 0
        node = f"n{rng.randrange(nodes)}" if nodes else None
        replicas.append(FakeReplica(ReplicaID(f"r{i:03d}", DEPLOYMENT), stats, 8, node))
    return replicas


@pytest.mark.parametrize("seed", range(9))
def test_indexed_choice_is_the_full_scans_order(seed: int) -> None:
    """Random fleets (reports, this router's loads and recent sends, some expired, Serve's
    queue-length cache above a few loads, reported loads changing, sessions, full replicas,
    replicas leaving; for seeds 6-8, nodes whose host KV tiers hold blocks past what their
    devices hold): the indexed path returns the first replicas of the full scan's order, the
    whole order when asked for all of it, with and without reported times."""
    rng = random.Random(seed)
    nodes = rng.choice([3, 7]) if seed >= 6 else 0
    now = [100.0]

    async def scenario() -> None:
        n = rng.choice([12, 40, 90])  # 90: classes past 32 members, ranked with numpy
        top = rng.choice([3, 8, n])
        router = CacheAwareRouter(
            DEPLOYMENT,
            DeploymentHandleSource.UNKNOWN,
            use_replica_queue_len_cache=True,
            get_curr_time_s=lambda: now[0],
        )
        router.initialize_state(
            tokenizer=None, batch_size=4, recent_ttl_s=5, clock=lambda: now[0],
            exact_scan_max=2, top_choices=top,
        )  # fmt: skip
        system = [rng.randrange(50) for _ in range(3 * BS)]
        prompts = [system + [rng.randrange(50) for _ in range(rng.randrange(8 * BS))]
                   for _ in range(12)]  # fmt: skip
        replicas = random_fleet(rng, n, prompts, timed=seed % 3 != 0, nodes=nodes)
        sessions = [f"s{i}" for i in range(6)]
        for step in range(60):
            if step == 30:  # some replicas leave, new ones come (slots are reused)
                more = random_fleet(rng, 3, prompts, timed=seed % 3 != 0, nodes=nodes)
                replicas = replicas[5:] + more
                for i, r in enumerate(replicas[-3:]):
                    r.replica_id = ReplicaID(f"new{step}-{i}", DEPLOYMENT)
                replicas = list(replicas)
            for r in rng.sample(replicas, 2):
                router.replica_queue_len_cache.update(r.replica_id, rng.randrange(10))
            if step % 7 == 3:  # new reports, with loads: Serve hands a new replica list
                for r in rng.sample(replicas, 3):
                    r.routing_stats = {**r.routing_stats, STATS_LOAD: rng.randrange(10),
                                       STATS_REPORT: step}  # fmt: skip
                replicas = list(replicas)
            prompt = rng.choice(prompts) + [rng.randrange(50) for _ in range(rng.randrange(6))]
            req = pending(prompt, rng.choice([*sessions, None]))
            groups = await router.choose_replicas(replicas, req)
            got = [g[0].replica_id.unique_id for g in groups]
            request = router._pending[req.metadata.internal_request_id]
            want = reference(router, replicas, request)
            assert got == want[: len(got)] and len(got) == min(top, len(replicas))
            chosen = groups[rng.randrange(len(groups))][0]  # Serve may route further down
            router.on_request_routed(req, chosen.replica_id, None)
            if rng.random() < 0.5 and router._inflight:
                rid = rng.choice(list(router._inflight))
                router.on_request_completed(None, rid)
            now[0] += rng.choice([0.1, 0.5, 3.0])

    asyncio.run(scenario())


def test_indexed_path_refuses_when_capacities_differ_and_serve_hands_new_lists() -> None:
    """Replicas of two configs (a redeploy in progress) take the full scan; a new replica
    list from Serve re-indexes (update_replicas' hook)."""

    async def scenario() -> None:
        router = CacheAwareRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(tokenizer=None, batch_size=4, exact_scan_max=2)
        times = {STATS_PREFILL_S_PER_TOKEN: 0.001, STATS_SERVICE_S: 1.0}
        replicas = [FakeReplica(ReplicaID(f"r{i}", DEPLOYMENT), dict(times)) for i in range(5)]
        replicas[0].max_ongoing_requests = 4
        groups = await router.choose_replicas(replicas, pending([1] * 8, "s"))
        assert len(groups) == 5  # the full scan's whole order
        same = [FakeReplica(r.replica_id, dict(times)) for r in replicas]
        router.refresh_index(same)
        assert router._indexed is same
        groups = await router.choose_replicas(same, pending([1] * 8, "s"))
        assert len(groups) == min(len(same), router._top_choices)

    asyncio.run(scenario())


def test_reports_carry_their_keys_as_one_int64_string() -> None:
    """A replica's held keys packed as native int64s (what replicas send: a 1,024-replica
    broadcast then unpickles as copies, not 300,000 ints) or as a list (as they sent them
    before): the same keys."""
    from rbln_ray.serve.kv_events import pack_keys, report_keys

    keys = chain_hashes(list(range(64)), BS)
    packed = pack_keys(keys)
    assert isinstance(packed, bytes) and len(packed) == 8 * len(keys)
    assert report_keys(keys) == report_keys(packed) == frozenset(keys)
    assert report_keys(None) == report_keys(b"") == frozenset()

    async def scenario() -> None:
        router = CacheAwareRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(tokenizer=None, batch_size=4, exact_scan_max=2)
        times = {STATS_PREFILL_S_PER_TOKEN: 0.001, STATS_SERVICE_S: 1.0}
        stats = {STATS_BLOCK_SIZE: BS, STATS_BLOCKS: packed, STATS_EVENTS: 1, **times}
        replicas = [FakeReplica(ReplicaID(f"r{i}", DEPLOYMENT), dict(times)) for i in range(4)]
        replicas[2].routing_stats = stats
        groups = await router.choose_replicas(replicas, pending(list(range(64)) + [9], None))
        assert groups[0][0].replica_id.unique_id == "r2"

    asyncio.run(scenario())


def test_routers_learn_each_others_load_from_the_replicas_reports() -> None:
    """Two ingress routers: A sends six requests to the replica holding a document; B,
    which sent none there, still sends the next request there (it knows no load) until the
    replica's report says it carries six; then B prices the slot wait and goes elsewhere,
    and counts its own later sends on top of what the report said."""

    async def scenario() -> None:
        doc = list(range(9000, 9000 + 100 * BS))  # 400 tokens: 0.4 s to prefill elsewhere
        times = {STATS_PREFILL_S_PER_TOKEN: 0.001, STATS_SERVICE_S: 10.0}
        held = {STATS_BLOCK_SIZE: BS, STATS_BLOCKS: chain_hashes(doc, BS), STATS_EVENTS: 1}
        replicas = [FakeReplica(ReplicaID(f"r{i}", DEPLOYMENT), dict(times)) for i in range(10)]
        replicas[0].routing_stats = {**held, **times}
        a, b = (CacheAwareRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN) for _ in "ab")
        for router in (a, b):
            router.initialize_state(tokenizer=None, batch_size=4, exact_scan_max=2)
        for _ in range(6):
            req = pending(doc + [1], None)
            await a.choose_replicas(replicas, req)
            a.on_request_routed(req, replicas[0].replica_id, None)
        assert (await b.choose_replicas(replicas, pending(doc + [2], None)))[0][0] is replicas[0]
        reported = [FakeReplica(r.replica_id, dict(r.routing_stats)) for r in replicas]
        reported[0].routing_stats.update({STATS_LOAD: 6, STATS_REPORT: 1})
        choice = (await b.choose_replicas(reported, pending(doc + [3], None)))[0][0]
        assert choice.replica_id.unique_id != "r0"
        assert b._known_load("r0") == 6
        req = pending(doc + [4], None)
        await b.choose_replicas(reported, req)
        b.on_request_routed(req, replicas[0].replica_id, None)
        assert b._known_load("r0") == 7  # its own send on top of the report's six
        again = [FakeReplica(r.replica_id, dict(r.routing_stats)) for r in reported]
        await b.choose_replicas(again, pending(doc + [5], None))  # the same report again
        assert b._known_load("r0") == 7

    asyncio.run(scenario())


def test_a_replica_reports_its_engines_load_with_each_report() -> None:
    """The stat logger, fed vLLM's own stats objects, keeps the engine's requests after each
    step (running and waiting, less those the step finished); every report carries it with
    a new sequence number, also before any request has ended (no times yet)."""
    from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

    from rbln_ray.serve.service_times import ServiceTimes

    times = ServiceTimes()
    logger = times.stat_logger()(None, 0)
    assert times.report() == {}
    logger.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=2), IterationStats())
    assert times.report() == {STATS_LOAD: 5, STATS_REPORT: 2}
    step = IterationStats()
    step.finished_requests = [
        FinishedRequestStats(finish_reason=None, num_prompt_tokens=100, num_cached_tokens=0,
                             prefill_time=0.1, inference_time=1.0)
    ]  # fmt: skip
    logger.record(SchedulerStats(num_running_reqs=4, num_waiting_reqs=0), step)
    logger.record(None, None)  # a step without stats keeps the last load
    out = times.report()
    assert out[STATS_LOAD] == 3 and out[STATS_REPORT] == 3
    assert out[STATS_SERVICE_S] == pytest.approx(1.0)


def test_a_lone_routers_own_finished_requests_never_read_as_others_load() -> None:
    """A report is up to a period old when a router reads it: the requests it counted there
    may have ended since. One router alone must find no one else's load in it."""

    async def scenario() -> None:
        times = {STATS_PREFILL_S_PER_TOKEN: 0.001, STATS_SERVICE_S: 1.0}
        replicas = [FakeReplica(ReplicaID(f"r{i}", DEPLOYMENT), dict(times)) for i in range(4)]
        router = CacheAwareRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(tokenizer=None, batch_size=4, exact_scan_max=2)
        sent = []
        for i in range(3):
            req = pending([i] * 8, None)
            await router.choose_replicas(replicas, req)
            router.on_request_routed(req, replicas[0].replica_id, None)
            sent.append(req.metadata.internal_request_id)
        router.on_request_completed(None, sent[0])  # ends after the replica's report ...
        report = [FakeReplica(r.replica_id, dict(r.routing_stats)) for r in replicas]
        report[0].routing_stats.update({STATS_LOAD: 3, STATS_REPORT: 1})  # ... said 3
        await router.choose_replicas(report, pending([9] * 8, None))
        assert router._known_load("r0") == 2

    asyncio.run(scenario())
