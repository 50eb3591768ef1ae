"""Cache-aware routing with a host KV tier: a replica reports the blocks its device dropped
that its node's tier holds, every replica of that node is credited with them, and the
router prices them as a transfer, not a prefill."""

from __future__ import annotations

import asyncio
import uuid

from ray.serve._private.common import ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from rbln_ray.serve.cache_routing import HOST_LOAD_FRACTION, ServiceRates, estimate_ttft
from rbln_ray.serve.kv_events import STATS_BLOCK_SIZE, STATS_BLOCKS, STATS_EVENTS, STATS_HOST_BLOCKS
from rbln_ray.serve.kv_index import CachedBlocks, chain_hashes
from rbln_ray.serve.service_times import STATS_PREFILL_S_PER_TOKEN, STATS_SERVICE_S
from tests.unit.test_cache_routing import BS, DEPLOYMENT, FakeReplica, first, make_router


def test_the_index_keeps_what_the_tier_holds_when_the_device_drops_it() -> None:
    prompt = list(range(100, 100 + 3 * BS))
    index = CachedBlocks()
    index.stored([b"a", b"b", b"c"], None, prompt, BS)
    keys = chain_hashes(prompt, BS)
    tier = {b"a", b"b"}  # the node's tier holds the first two blocks
    index.removed([b"a", b"b", b"c"], lambda hs: {h for h in hs if h in tier})
    assert index.keys() == [] and index.host_keys() == sorted(keys[:2])
    tier.discard(b"b")  # another engine of the node evicted it from the tier
    index.prune_host(lambda hs: {h for h in hs if h in tier})
    assert index.host_keys() == [keys[0]]
    index.stored([b"a"], None, prompt[:BS], BS)  # loaded back onto the device
    assert index.keys() == [keys[0]] and index.host_keys() == []


def test_a_host_hit_costs_a_transfer_not_a_prefill() -> None:
    rates = ServiceRates(prefill_s_per_token=1e-3, service_s=2.0)
    cold = estimate_ttft(rates, 4, 0, uncached_tokens=3000)
    warm = estimate_ttft(rates, 4, 0, uncached_tokens=0, host_tokens=3000)
    assert warm == 3000 * 1e-3 * HOST_LOAD_FRACTION < cold


def test_replicas_of_the_node_holding_a_prefix_in_its_tier_are_preferred() -> None:
    """Two nodes of two replicas; replica a1 of node A reported a document as held in A's
    tier. Both replicas of node A are credited with it (they share the tier); with equal
    loads, the request goes to node A, not to node B's replicas."""
    doc = list(range(7000, 7000 + 8 * BS))
    timed = {STATS_PREFILL_S_PER_TOKEN: 1e-3, STATS_SERVICE_S: 2.0}

    def stats(host: list[int] | None = None) -> dict:
        return {STATS_BLOCK_SIZE: BS, STATS_BLOCKS: [], STATS_EVENTS: 1,
                STATS_HOST_BLOCKS: host or [], **timed}  # fmt: skip

    async def scenario() -> None:
        router = make_router()
        held = chain_hashes(doc, BS)
        replicas = [
            FakeReplica(ReplicaID(name, DEPLOYMENT), stats(held if name == "a1" else None))
            for name in ("a1", "a2", "b1", "b2")
        ]
        for r in replicas:
            r.node_id = r.replica_id.unique_id[0]  # node "a" or "b"
        rid = uuid.uuid4().hex
        meta = RequestMetadata(request_id=rid, internal_request_id=rid)
        pending = PendingRequest(args=[{"prompt": doc + [1, 2]}], kwargs={}, metadata=meta)
        groups = await router.choose_replicas(replicas, pending)
        order = [g[0].replica_id.unique_id for g in groups]
        assert set(order[:2]) == {"a1", "a2"}, order
        assert await first(router, replicas, pending) in ("a1", "a2")

    asyncio.run(scenario())
