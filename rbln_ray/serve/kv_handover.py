"""Prefill/decode disaggregation across nodes: a prompt's KV from the prefill replica's node
tier to the decode replica's, through Ray's own object transfer.

Within a node the prefill and decode replicas share the node's host KV tier
(:mod:`rbln_ray.vllm_plugin.host_tier`), so the decode engine finds the prompt's blocks by
their hashes. Across nodes it would not: the tier is host memory of one machine. So before a
decode replica hands a request to its engine, it reads the prefill's answer (vLLM's
``kv_transfer_params``, forwarded by the ingress as vLLM's P/D proxies forward it: the
prefill's node and the block hashes it exported) and, when that node is another, runs a Ray
task pinned to it (``NodeAffinitySchedulingStrategy``, no CPU reserved: it reads files) that
reads those entries from that node's tier. The task's return value reaches this node through
Ray's object store, Ray's transfer between raylets (no protocol of ours), and the entries
are added to this node's tier, where the engine's connector finds them as any prefix.

Timing and modelled modes wait out the network's modelled time for the bytes the model
would move (:func:`rbln_ray.emulator.timing.network_seconds`; the link's default and source
are in :mod:`rbln_ray.npu.cost_model`), so no benchmark gets a handover between nodes free.

Nothing here can make an answer wrong or lost: a fetch that fails or times out (the node
gone, the entries evicted meanwhile) only means the decode engine computes the prompt
itself. The node and hashes come from the ingress (which drops a client's own
``kv_transfer_params`` for disaggregated models); they are checked for shape all the same,
and the tier's path on the other node is derived from this replica's own config, never read
from a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbln_ray.vllm_plugin.host_tier import HostKVTier, KVRecord

logger = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 60.0  # a fetch that takes longer is given up: the prompt is computed
MAX_BLOCKS = 8192  # block hashes one handover may name (a prompt's; more is not a prefill's)
_NODE_ID = re.compile(r"[0-9a-f]{16,128}")
_HASH = re.compile(r"[0-9a-f]{2,256}")


def read_records(root: str, model: str, hashes: list[str]) -> list[KVRecord]:
    """On the prefill replica's node: the entries of its tier holding ``hashes``."""
    tier = HostKVTier(Path(root), 1, model)  # the capacity bounds writes; this only reads
    try:
        return tier.records([bytes.fromhex(h) for h in hashes])
    finally:
        tier.close()


def remote_source(params: Any, own_node: str) -> tuple[str, list[str]] | None:
    """(the prefill's node, its exported block hashes) when ``params`` (a request's
    ``kv_transfer_params``) names KV exported on another node than ``own_node``; else None
    (same node, nothing exported, or not in the shape a prefill replica writes)."""
    if not isinstance(params, Mapping) or params.get("do_remote_prefill") is not True:
        return None
    node, hashes = params.get("node_id"), params.get("block_hashes")
    if not isinstance(node, str) or not _NODE_ID.fullmatch(node) or node == own_node:
        return None
    if not isinstance(hashes, list) or not 0 < len(hashes) <= MAX_BLOCKS:
        return None
    if not all(isinstance(h, str) and _HASH.fullmatch(h) for h in hashes):
        return None
    return node, hashes


@dataclass
class KVHandover:
    """A decode replica's side of a handover between nodes (module docstring);
    ``root_on(node)``: where this replica's tier config keeps the tier on ``node``."""

    tier: HostKVTier
    node_id: str
    model_dir: Path
    root_on: Callable[[str], Path]
    _reader: Any = field(default=None, init=False, repr=False)

    async def receive(self, params: Any) -> int:
        """Fetch what ``params`` names from another node into this node's tier; the tokens
        added (0 when there is nothing to fetch, or the fetch failed)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from rbln_ray.emulator.timing import network_seconds

        source = remote_source(params, self.node_id)
        if source is None:
            return 0
        node, hashes = source
        started = time.perf_counter()
        if self._reader is None:  # one remote function per replica (Ray exports it once)
            self._reader = ray.remote(num_cpus=0)(read_records)
        strategy = NodeAffinitySchedulingStrategy(node, soft=False)
        ref = self._reader.options(scheduling_strategy=strategy).remote(
            str(self.root_on(node)), self.tier.model, hashes
        )
        try:
            records = await asyncio.wait_for(ref, FETCH_TIMEOUT_S)
            tokens = sum(r.tokens for r in records)
            left = network_seconds(self.model_dir, tokens) - (time.perf_counter() - started)
            if left > 0:
                await asyncio.sleep(left)
            return await asyncio.to_thread(self.tier.add, records)
        except Exception as exc:  # noqa: BLE001 - the engine computes the prompt instead
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
            logger.warning("KV handover from node %s failed (%s: %s); computing the prompt",
                           node[:8], type(exc).__name__, str(exc).split("\n", 1)[0])  # fmt: skip
            return 0


def handover_for(kv_transfer_config: Any, model_dir: str, node_id: str) -> KVHandover | None:
    """The handover of a decode pool's replica (``kv_role: kv_consumer`` on the host tier's
    connector) on ``node_id``; None for any other engine."""
    from rbln_ray.compile.artifact import is_compiled_dir
    from rbln_ray.vllm_plugin.host_kv_connector import tier_for, tier_root

    if kv_transfer_config is None or kv_transfer_config.kv_role != "kv_consumer":
        return None
    tier = tier_for(kv_transfer_config, model_dir) if is_compiled_dir(model_dir) else None
    if tier is None:
        return None
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    return KVHandover(tier, node_id, Path(model_dir), lambda node: tier_root(extra, node))
